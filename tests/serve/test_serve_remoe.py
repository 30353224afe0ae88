"""Serving a Remoe plan: this process is the main function (non-experts, KV cache, local
experts), each layer's remote experts run in its group function on the ``local`` backend
(real worker processes, a real object store in a temporary directory, real HTTP).

The model is the 2-block x 4-expert tiny Mixtral saved as a checkpoint; the plan keeps
experts 0-1 of each layer in the main function and sends 2-3 to one group function with
2 replicas, with a 2 GB GPU share on alibaba-fc-gpu: on this CPU machine "GPU emulated".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.serve.conftest import (
    MODEL,
    PLAN_PROMPTS,
    billed_series,
    complete_plan_prompts,
    running,
)

pytestmark = pytest.mark.timeout(300)

PLATFORM = "alibaba-fc-gpu"


def _remoe_plan(path: Path, adapter: Any, model: str) -> Path:
    from moefleet.remoe.plans import manual_plan

    shape = adapter.summary()
    plan = manual_plan(shape, PLATFORM, {layer: [2, 3] for layer in shape.moe_layers},
                       main_memory_mb=2048, remote_memory_mb=1024, replicas=2, gpu_gb=2.0)
    return plan.model_copy(update={"model": model}).save(path)


def test_served_remoe_plan_matches_in_process_and_bills_main_plus_remote(
        small_mixtral_dir: Path, tmp_path: Path) -> None:
    from moefleet.compose import EngineOptions, open_engine
    from moefleet.models.registry import load_adapter
    from moefleet.plan import DeploymentPlan
    from moefleet.platform import open_store
    from moefleet.platform.billing import Meter
    from tests.engine_helpers import build_engine

    model = str(small_mixtral_dir)
    adapter = load_adapter(model)
    with running(build_engine(adapter, max_num_seqs=4)) as s:
        want = complete_plan_prompts(s.url)
    plan = DeploymentPlan.load(_remoe_plan(tmp_path / "remoe.yaml", adapter, model))
    store_dir = tmp_path / "store"
    with open_engine(adapter, plan=plan, store=open_store(str(store_dir)), backend="local",
                     model_ref=model, backend_options={"workers": 1},
                     options=EngineOptions(max_num_seqs=4), audit=True) as d:
        # one group per layer; the main function is this process
        assert len(d.backend.functions()) == 2 and d.device == "cpu"
        assert not d.backend.records()  # nothing invoked yet (no main function to call)
        with running(d.engine, biller=d.biller) as s:
            got = complete_plan_prompts(s.url)
            billed = billed_series(s.url)
        biller = d.biller
        forward_s = sum(st.forward_s for st in d.engine.stats.steps)
        remote_calls = [r for r in d.backend.records() if r.kind == "expert"]
    assert not [p for p in store_dir.rglob("*") if p.is_file()]  # torn down: weights gone

    # greedy outputs equal the in-process server's (monolithic model)
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in want["choices"]]
    usage = got["usage"]["billed_cost"]
    assert usage["basis"] == "invocations+main-time" and usage["gpu"] == "emulated"
    assert usage["main_usd"] > 0 and usage["remote_usd"] > 0 and usage["invocations"] > 0
    assert usage["usd"] == pytest.approx(usage["main_usd"] + usage["remote_usd"], rel=1e-12)

    # remote part: the request's attributed records, re-priced by a fresh meter
    meter = Meter(biller.spec)
    rids = [f"{got['id']}-{i}-0" for i in range(len(PLAN_PROMPTS))]
    assert biller.audit is not None and all(biller.audit[r] for r in rids)
    remote = sum(meter.cost_of(rec).total * share for r in rids for rec, share in
                 biller.audit[r])
    assert usage["remote_usd"] == pytest.approx(remote, rel=1e-9)
    assert len(remote_calls) == len({id(rec) for r in rids for rec, _ in biller.audit[r]})
    # main part: each request's seconds in the main function as one invocation at the
    # plan's memory and GPU share (2 of the A10's 24 GB); the seconds are the engine's
    # forward time, split by tokens with nothing lost
    main_recs = [biller.audit_main[r] for r in rids]
    assert all(m.memory_mb == 2048 and m.gpu_share == pytest.approx(2 / 24)
               for m in main_recs)
    assert sum(m.duration_s for m in main_recs) == pytest.approx(forward_s, rel=1e-9)
    assert biller.unattributed_main_s == 0
    main = sum(meter.cost_of(m).total for m in main_recs)
    assert usage["main_usd"] == pytest.approx(main, rel=1e-9)
    assert usage["usd"] == pytest.approx(main + remote, rel=1e-9)

    # /metrics: the main function's part (labelled GPU emulated) and each group function's
    # part sum to what the request was billed
    main_series = {k: v for k, v in billed.items() if k[0] == "main"}
    assert {k[2] for k in main_series} == {"main-time-gpu-emulated"}
    assert sum(main_series.values()) == pytest.approx(usage["main_usd"], rel=1e-9)
    groups = {f for f, _, basis in billed if basis == "invocations"}
    assert groups == {"exp-0-2_3", "exp-1-2_3"}
    assert sum(billed.values()) == pytest.approx(usage["usd"], rel=1e-9)


def test_serve_remoe_plan_refuses_cuda_on_a_machine_without_one(
        small_mixtral_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from typer.testing import CliRunner

    from moefleet.cli import app as cli
    from moefleet.models.registry import load_adapter

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plan = _remoe_plan(tmp_path / "remoe.yaml", load_adapter(str(small_mixtral_dir)),
                       str(small_mixtral_dir))
    r = CliRunner().invoke(cli, ["serve", "--model", str(small_mixtral_dir), "--plan",
                                 str(plan), "--device", "cuda", "--port", "0"])
    assert r.exit_code == 2
    assert "torch sees no CUDA GPU here" in r.output and "--device" in r.output


def test_serve_cli_with_a_remoe_plan_answers_over_http_and_tears_down(
        small_mixtral_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``moefleet serve --plan remoe.yaml`` itself (in process: ``uvicorn.Server.run`` is
    replaced by a real server on a thread that is queried, then stopped, as Ctrl-C
    would)."""
    import threading
    import time

    import uvicorn
    from typer.testing import CliRunner

    from moefleet.cli import app as cli
    from moefleet.models.registry import load_adapter
    from tests.engine_helpers import build_engine
    model = str(small_mixtral_dir)
    adapter = load_adapter(model)
    with running(build_engine(adapter, max_num_seqs=4)) as s:
        want = complete_plan_prompts(s.url)
    plan = _remoe_plan(tmp_path / "remoe.yaml", adapter, model)
    seen: dict[str, Any] = {}

    real_run = uvicorn.Server.run

    def serve_once(self: Any, sockets: Any = None) -> None:
        """The CLI's server, run on a thread on the socket the CLI bound, queried, then
        stopped (as Ctrl-C would)."""
        thread = threading.Thread(target=real_run, args=(self,), kwargs={"sockets": sockets},
                                  daemon=True)
        thread.start()
        while not self.started:
            time.sleep(0.02)
        url = f"http://127.0.0.1:{sockets[0].getsockname()[1]}"
        try:
            seen["got"] = complete_plan_prompts(url)
            seen["billed"] = billed_series(url)
        finally:
            self.should_exit = True
            thread.join(30)

    monkeypatch.setattr(uvicorn.Server, "run", serve_once)
    store = tmp_path / "store"
    # systems combine: Remoe's split, a brownout guard (threshold 1: exact) and injected
    # throttles at the backend (retried: exact), all through one engine
    r = CliRunner().invoke(cli, ["serve", "--model", model, "--plan", str(plan), "--backend",
                                 "local", "--workers", "1", "--store", str(store),
                                 "--served-name", MODEL, "--port", "0",
                                 "--brownout", "ways=2,threshold=1,mode=full",
                                 "--inject-faults", "throttle:0.2:3"])
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())  # rich wraps lines at the terminal's width
    assert "this process is the main function" in out and "GPU emulated" in out
    assert "brownout: 2-way united experts, full, threshold 1" in out
    assert "faults: throttle at 20% of calls, at the backend (emulated)" in out
    assert "deployment torn down" in out
    assert not [p for p in store.rglob("*") if p.is_file()]
    got = seen["got"]
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in want["choices"]]
    usage = got["usage"]["billed_cost"]
    assert usage["usd"] == pytest.approx(usage["main_usd"] + usage["remote_usd"], rel=1e-12)
    assert sum(seen["billed"].values()) == pytest.approx(usage["usd"], rel=1e-9)
