"""Serving a deployment: the engine's experts in the plan's functions on the ``local``
backend (real worker processes, real object store in a temporary directory).

The model is tiny-mixtral trimmed to 2 blocks of 4 experts (as in the CLI backend tests),
saved as a checkpoint directory the plan names. Layer 0 sends its tokens in the payload
(direct), layer 1 through the object store (storage), so both compute/request and storage
costs are attributed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from typer.testing import CliRunner

from moefleet.cli import app as cli
from tests.serve.conftest import (
    MODEL,
    PLAN_PROMPTS,
    billed_series,
    complete_plan_prompts,
    running,
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_dir(small_mixtral_dir: Path) -> Path:
    return small_mixtral_dir


def _plan(path: Path, model: str) -> Path:
    path.write_text(
        f"model: {model}\nplatform: aws-lambda\nsegment_memory_mb: [512, 512]\nlayers:\n"
        "  - {layer: 0, method: direct, experts: [{memory_mb: 256}, {memory_mb: 256}, "
        "{memory_mb: 256}, {memory_mb: 256}]}\n"
        "  - {layer: 1, method: storage, experts: [{memory_mb: 320}, {memory_mb: 320}, "
        "{memory_mb: 320}, {memory_mb: 320}]}\n")
    return path


@pytest.fixture(scope="module")
def in_process(model_dir: Path) -> Iterator[tuple[Any, dict[str, Any]]]:
    from moefleet.models.registry import load_adapter
    from tests.engine_helpers import build_engine

    adapter = load_adapter(str(model_dir))
    with running(build_engine(adapter, max_num_seqs=4)) as s:
        yield adapter, complete_plan_prompts(s.url)


def test_served_deployment_matches_in_process_and_bills_its_invocations(
        model_dir: Path, tmp_path: Path, in_process: tuple[Any, dict[str, Any]]) -> None:
    from moefleet.compose import EngineOptions, open_engine
    from moefleet.platform import open_store
    from moefleet.platform.billing import Meter

    adapter, want = in_process
    plan_path = _plan(tmp_path / "plan.yaml", str(model_dir))
    from moefleet.plan import DeploymentPlan

    store_dir = tmp_path / "store"
    with open_engine(adapter, plan=DeploymentPlan.load(plan_path),
                         store=open_store(str(store_dir)), backend="local",
                         model_ref=str(model_dir), backend_options={"workers": 2},
                         options=EngineOptions(max_num_seqs=4), audit=True) as d:
        assert any(store_dir.rglob("*"))  # the weights were uploaded
        with running(d.engine, biller=d.biller) as s:
            got = complete_plan_prompts(s.url)
            billed = billed_series(s.url)
        audit, audit_storage = d.biller.audit, d.biller.audit_storage
        unattributed = d.biller.unattributed
    assert not [p for p in store_dir.rglob("*") if p.is_file()]  # torn down: weights gone

    # greedy outputs equal the in-process server's
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in want["choices"]]
    usage = got["usage"]["billed_cost"]
    assert usage["basis"] == "invocations" and want["usage"]["billed_cost"]["basis"] == (
        "in-process-estimate")
    assert usage["usd"] > 0 and usage["compute"] > 0 and usage["requests"] > 0
    assert usage["storage"] > 0  # layer 1 passes its tokens through the store
    assert isinstance(usage["invocations"], int) and usage["invocations"] > 0

    # the request's cost is the sum of its attributed records, re-priced independently
    assert audit is not None
    meter = Meter(d.biller.spec)
    rids = [f"{got['id']}-{i}-0" for i in range(len(PLAN_PROMPTS))]
    assert all(audit[r] for r in rids)
    assert usage["invocations"] == sum(len(audit[r]) for r in rids)
    mine = sum(meter.cost_of(rec).total * share for r in rids for rec, share in audit[r])
    mine += sum(audit_storage[r] for r in rids)
    assert usage["usd"] == pytest.approx(mine, rel=1e-9)
    # every invocation of this one request is attributed: shares of a record sum to 1
    per_record: dict[int, float] = {}
    for r in rids:
        for rec, share in audit[r]:
            per_record[id(rec)] = per_record.get(id(rec), 0.0) + share
    assert per_record and all(v == pytest.approx(1.0) for v in per_record.values())
    assert unattributed.total == 0

    # /metrics: per expert function and part, summing to what the request was billed
    fns = {f for f, _, basis in billed if basis == "invocations"} - {"<engine>"}
    assert all(re.search(r"exp-[01]-\d", f) for f in fns)
    assert {re.search(r"exp-([01])-", f).group(1) for f in fns} == {"0", "1"}  # type: ignore[union-attr]
    assert billed[("<engine>", "storage", "invocations")] > 0  # the engine's own PUT/GETs
    assert sum(billed.values()) == pytest.approx(usage["usd"], rel=1e-9)


def test_serve_refuses_a_plan_for_another_model(model_dir: Path, tmp_path: Path) -> None:
    plan = _plan(tmp_path / "other.yaml", "tiny-moe-lm-e32")
    r = CliRunner().invoke(cli, ["serve", "--model", str(model_dir), "--plan", str(plan),
                                 "--port", "0"])
    assert r.exit_code != 0
    assert "the plan is for model 'tiny-moe-lm-e32'" in r.output


def test_serve_plan_subprocess_deploys_serves_and_tears_down(model_dir: Path,
                                                             tmp_path: Path) -> None:
    """What a user runs: ``moefleet serve --plan`` in its own process, stopped by SIGTERM."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.serve.conftest import free_port

    plan = _plan(tmp_path / "plan.yaml", str(model_dir))
    store, port = tmp_path / "store", free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2] / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moefleet", "serve", "--model", str(model_dir), "--plan",
         str(plan), "--backend", "local", "--workers", "1", "--store", str(store),
         "--port", str(port), "--served-name", MODEL],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail(f"serve exited: {proc.communicate()[1].decode()[-2000:]}")
            try:
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("serve --plan did not come up")
            time.sleep(0.3)
        assert [p for p in store.rglob("*") if p.is_file()]  # weights uploaded
        r = requests.post(url + "/v1/completions", json={
            "model": MODEL, "prompt": "A river ran", "max_tokens": 2, "temperature": 0},
            timeout=120)
        assert r.status_code == 200, r.text
        billed = r.json()["usage"]["billed_cost"]
        assert billed["basis"] == "invocations" and billed["usd"] > 0
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            _, err = proc.communicate(timeout=10)
    assert "deployment torn down" in err.decode()
    assert not [p for p in store.rglob("*") if p.is_file()]  # its weights are gone
