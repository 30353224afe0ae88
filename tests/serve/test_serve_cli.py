"""``moefleet serve`` as a real subprocess on a free port, stopped by its pid."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.serve.conftest import tiny_adapter


def test_serve_subprocess(tmp_path: Path) -> None:
    adapter = tiny_adapter()
    model_dir = tmp_path / "tiny-served"
    adapter.model.save_pretrained(model_dir)
    adapter.tokenizer.save_pretrained(model_dir)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2] / "src"), os.environ.get("PYTHONPATH", "")]),
        "MOEFLEET_API_KEY": "k"}
    proc = subprocess.Popen([sys.executable, "-m", "moefleet", "serve", "--model",
                             str(model_dir), "--port", "0", "--max-num-seqs", "4",
                             # SALC starts at threshold 1 (zero brownout): same outputs
                             "--brownout", "ways=2,slo-ttft=30,slo-tpot=30,mode=full"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # --port 0: the banner says which port was bound
        deadline = time.monotonic() + 240
        assert proc.stderr is not None
        banner = ""
        while "serving" not in banner:
            line = proc.stderr.readline().decode()
            if not line and proc.poll() is not None:
                pytest.fail(f"serve exited: {proc.communicate()[1].decode()[-2000:]}")
            banner += line
            assert time.monotonic() < deadline, "no banner"
        m = re.search(r"http://127\.0\.0\.1:(\d+)", banner)
        assert m and int(m.group(1)) > 0, banner
        url = f"http://127.0.0.1:{m.group(1)}"
        while True:
            if proc.poll() is not None:
                pytest.fail(f"serve exited: {proc.communicate()[1].decode()[-2000:]}")
            try:
                if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            if time.monotonic() > deadline:
                pytest.fail("serve did not come up")
            time.sleep(0.2)
        req = urllib.request.Request(
            url + "/v1/completions", method="POST",
            data=json.dumps({"model": "tiny-served", "prompt": "hi", "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json", "Authorization": "Bearer k"})
        body = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert body["usage"]["completion_tokens"] == 2
        metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
        setting = [ln for ln in metrics.splitlines()
                   if 'setting="brownout_threshold_prefill"' in ln]
        assert setting and float(setting[0].split()[-1]) == 1.0
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode is not None


def test_serve_rejects_bad_options() -> None:
    from typer.testing import CliRunner

    from moefleet.cli import app

    r = CliRunner().invoke(app, ["serve", "--model", "tiny-moe-lm", "--port", "70000"])
    assert r.exit_code == 2 and "--port" in r.output
    r = CliRunner().invoke(app, ["serve", "--model", "x", "--brownout", "ways=1,slo-ttft=1,"
                                 "slo-tpot=1"])
    assert r.exit_code == 2 and "ways=1" in r.output
    r = CliRunner().invoke(app, ["serve", "--model", "x", "--plan", "missing.yaml"])
    assert r.exit_code == 2 and "missing.yaml" in r.output
    r = CliRunner().invoke(app, ["serve", "--model", "x", "--plan", "p.yaml", "--backend",
                                 "nope"])
    assert r.exit_code == 2 and "unknown backend 'nope'" in r.output
    r = CliRunner().invoke(app, ["serve", "--model", "x", "--workers", "2"])
    assert r.exit_code == 2 and "only apply with --plan" in r.output


def test_serve_port_in_use_is_one_error_line_before_loading() -> None:
    from typer.testing import CliRunner

    from moefleet.cli import app

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        r = CliRunner().invoke(app, ["serve", "--model", "tiny-moe-lm", "--port", str(port)])
    assert r.exit_code != 0 and time.monotonic() - t0 < 30
    assert f"error: port {port} is in use" in r.output and "--port 0" in r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("args,what", [
    (["--max-per-client", "0"], "--max-per-client"), (["--admission-wait", "nan"],
                                                      "--admission-wait"),
    (["--body-timeout", "0"], "body_timeout_s"), (["--header-timeout", "-1"],
                                                  "head_timeout_s"),
    (["--max-header-kb", "0"], "max_head_bytes"), (["--max-waiting", "0"], "--max-waiting"),
])
def test_serve_rejects_bad_connection_options(args, what) -> None:
    from typer.testing import CliRunner

    from moefleet.cli import app

    r = CliRunner().invoke(app, ["serve", "--model", "tiny-moe-lm", "--port", "0", *args])
    assert r.exit_code == 2 and what in r.output and "Traceback" not in r.output
