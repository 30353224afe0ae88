"""The hostile-input corpus (``hostile_corpus.py``): each case through the real CLI, in
process (typer's runner), must end with one ``error:`` line or a usage error, a non-zero
exit, no traceback, no output file and within ``BOUND_S``; a subset runs as subprocesses
to prove that nothing but the error and its hint reaches stderr."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moefleet.cli import app
from tests.reliability.hostile_corpus import Seeds, all_cases, make_seeds

runner = CliRunner()
CASES = {f"{kind}:{name}": build for kind, name, build in all_cases()}
BOUND_S = 20.0
USAGE = ("Invalid value",)  # a range or type error; a missing option would prove nothing


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> Seeds:
    return make_seeds(tmp_path_factory.mktemp("hostile-seeds"))


def outputs(folder: Path) -> set[str]:
    return {p.name for p in folder.rglob("*") if p.is_file() and not p.is_symlink()}


def check_refusal(code: int, output: str) -> None:
    assert code != 0, output
    assert "Traceback" not in output, output
    errors = [ln for ln in output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 or any(u in output for u in USAGE), output


def test_corpus_is_large_and_covers_every_kind() -> None:
    kinds = {k.split(":")[0] for k in CASES}
    assert len(CASES) >= 300
    assert kinds >= {"plan", "checkpoint", "activation", "counts", "dataset", "output",
                     "cli-number"}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_input_is_refused(case: str, seeds: Seeds, tmp_path: Path) -> None:
    args = CASES[case](seeds, tmp_path)
    before = outputs(tmp_path)
    old = Path.cwd()
    os.chdir(tmp_path)
    try:
        t0 = time.monotonic()
        res = runner.invoke(app, args)
        took = time.monotonic() - t0
    finally:
        os.chdir(old)
    check_refusal(res.exit_code, res.output)
    assert took < BOUND_S, f"{case} took {took:.1f} s"
    assert outputs(tmp_path) == before, outputs(tmp_path) - before


SUBPROCESS = ["plan:billion-laughs/show", "plan:groups-overlap/run", "dataset:dev-zero/generate",
              "checkpoint:metadata-missing-keys/eval", "activation:strings",
              "output:dev-full/export", "cli-number:train-time-budget-nan"]


@pytest.mark.timeout(240)
def test_no_traceback_reaches_stderr_of_a_real_process(seeds: Seeds, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    for case in SUBPROCESS:
        work = tmp_path / case.replace(":", "_").replace("/", "_")
        work.mkdir()
        args = CASES[case](seeds, work)
        proc = subprocess.run([sys.executable, "-m", "moefleet", *args], capture_output=True,
                              text=True, timeout=120, env=env, cwd=work)
        assert proc.returncode != 0, (case, proc.stderr)
        assert "Traceback" not in proc.stderr, (case, proc.stderr)
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert lines and all(ln.startswith(("error:", "hint:")) for ln in lines), \
            (case, proc.stderr)
