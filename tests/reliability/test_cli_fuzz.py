"""≥ 200 hostile argument sets across every command (see ``cli_fuzz.py``): each fails
with one clean ``error:`` line (or a usage error), a non-zero exit, no traceback, no
files left behind and no model build; the process that ran them all peaked below 2 GB.

The sets run in one child process (in-process CliRunner inside it, for speed), so its
peak RSS (``ru_maxrss``) is the largest memory any fuzzed command reached, unaffected by
whatever else this pytest process loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(400)
def test_hostile_cli_arguments_fail_cleanly_and_stay_small() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT),
                                                        *sys.path])}
    proc = subprocess.run([sys.executable, str(ROOT / "tests/reliability/cli_fuzz.py"),
                           "200", "17"], capture_output=True, text=True, env=env, timeout=380)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-2000:]
    report = json.loads(lines[-1].removeprefix("REPORT "))
    assert report["runs"] >= 200
    assert report["failures"] == [], json.dumps(report["failures"][:10], indent=1)
    assert report["peak_rss_mb"] < 2048
