"""``moefleet serve`` as a real subprocess on a free port, stopped by its pid."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.serve.conftest import free_port, tiny_adapter


def test_serve_subprocess(tmp_path: Path) -> None:
    adapter = tiny_adapter()
    model_dir = tmp_path / "tiny-served"
    adapter.model.save_pretrained(model_dir)
    adapter.tokenizer.save_pretrained(model_dir)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2] / "src"), os.environ.get("PYTHONPATH", "")]),
        "MOEFLEET_API_KEY": "k"}
    proc = subprocess.Popen([sys.executable, "-m", "moefleet", "serve", "--model",
                             str(model_dir), "--port", str(port), "--max-num-seqs", "4",
                             # SALC starts at threshold 1 (zero brownout): same outputs
                             "--brownout", "ways=2,slo-ttft=30,slo-tpot=30,mode=full"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
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
