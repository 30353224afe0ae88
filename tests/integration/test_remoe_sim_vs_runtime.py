"""The Remoe simulator against the Remoe runtime, structurally: the same plan, requests
and routing give the same remote calls and token-slots per layer, exactly.

A 2-layer, 4-expert Mixtral; experts 2 and 3 of each layer remote in a function with 2
replicas; two prompts, each alone in a main invocation on the local backend. The
routing of every engine step is recorded in process (``record_passes``) and replayed by
the simulator with the runtime's dispatch: ``split`` for a plan without LPT groups,
``lpt`` for one whose group gives each replica its own experts. Times and costs are compared in
``benchmarks/remoe_sim_vs_runtime.py``, not here: on a shared machine they are not a
test's business.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moefleet.calibration.remoe import measure_plan, record_passes, record_slots
from moefleet.models.hf import HFMoEAdapter
from moefleet.models.tiny import small_mixtral
from moefleet.plan.remoe import Layout
from moefleet.plan.remoe.shapes import Timing, problem_for
from moefleet.platform import load_platform, open_store
from moefleet.remoe.dims import dims_from_adapter
from moefleet.remoe.plans import manual_plan
from moefleet.sim.remoe import RemoeSimulator

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
PLATFORM = "alibaba-fc-gpu"
TOKENS = 4


def test_simulator_makes_the_runtimes_remote_calls(tmp_path: Path) -> None:
    adapter = HFMoEAdapter(small_mixtral())
    shape = adapter.summary()
    layers = list(shape.moe_layers)
    remote = {layer: (2, 3) for layer in layers}
    plan = manual_plan(shape, PLATFORM, remote, main_memory_mb=2048, remote_memory_mb=1024,
                       replicas=2, gpu_gb=1.0)
    platform = load_platform(PLATFORM)
    prompts = [[5, 17, 300, 42, 7, 99, 3, 8, 250, 11], [1000, 2, 3]]
    run = measure_plan(plan, adapter, prompts, platform=platform,
                       store=open_store(str(tmp_path / "store")), max_tokens=TOKENS,
                       workers=1)
    passes, _, tokens = record_passes(adapter, prompts, TOKENS)
    assert [list(r.tokens) for r in run["results"]] == tokens
    assert all(len(p) == TOKENS and p[0].prefill for p in passes)  # 1 prefill + 3 decode

    hidden = int(shape.hidden_size)
    real_calls: dict[int, int] = {}
    real_slots: dict[int, int] = {}
    for r in run["remote_records"]:
        li = layers.index(r.layer)
        real_calls[li] = real_calls.get(li, 0) + 1
        real_slots[li] = real_slots.get(li, 0) + record_slots(r, hidden)
    assert sum(run["remote_invocations"]) == len(run["remote_records"])

    s_LE = np.full((len(layers), 4), 0.25)
    p = problem_for(dims_from_adapter(adapter), Timing(1e9, 1e9), platform, s_LE, n_in=8,
                    n_out=TOKENS, ttft_slo_s=30.0, tpot_slo_s=1.0, model="small-mixtral")
    x = np.zeros((len(layers), 4), bool)
    x[:, 2:] = True
    lay = Layout("remoe", 2048, x, (1024,) * len(layers), (((2,), (3,)),) * len(layers))
    sim = RemoeSimulator(p, lay, dispatch="split").run([0.0, 1e4], passes=passes)
    # every remote slot the router chose, in as many calls as the runtime made
    expected_slots = {li: int(sum(ps.counts_LE[li, 2:].sum() for req in passes for ps in req))
                      for li in range(len(layers))}
    assert sim.slots_by_layer == real_slots == expected_slots
    assert sim.calls_by_layer == real_calls
    assert sim.remote_calls == len(run["remote_records"])
    assert len(run["main_records"]) == len(prompts)

    # With LPT groups in the plan (replica j serves expert 2 or 3), the runtime calls
    # each replica that got a slot, as the paper's dispatch does: a decode token routed
    # to both remote experts costs two calls.
    lpt_plan = manual_plan(shape, PLATFORM, remote, main_memory_mb=2048,
                           remote_memory_mb=1024, replicas=2, gpu_gb=1.0,
                           replica_experts={layer: [[2], [3]] for layer in layers})
    lpt_run = measure_plan(lpt_plan, adapter, prompts, platform=platform,
                           store=open_store(str(tmp_path / "store-lpt")), max_tokens=TOKENS,
                           workers=1)
    assert [list(r.tokens) for r in lpt_run["results"]] == tokens
    lpt_calls: dict[int, int] = {}
    for r in lpt_run["remote_records"]:
        li = layers.index(r.layer)
        lpt_calls[li] = lpt_calls.get(li, 0) + 1
    lpt = RemoeSimulator(p, lay, dispatch="lpt").run([0.0, 1e4], passes=passes)
    assert lpt.slots_by_layer == real_slots
    assert lpt.calls_by_layer == lpt_calls == {
        li: int(sum((ps.counts_LE[li, 2:] > 0).sum() for req in passes for ps in req))
        for li in range(len(layers))}
    assert lpt.remote_calls > sim.remote_calls  # the split dispatch merges them
