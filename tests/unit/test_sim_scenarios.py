"""Hand-computed simulator scenarios (numbers from tests/unit/sim_helpers.py; the
arithmetic is in the comments). One block with one MoE layer unless said otherwise."""

from __future__ import annotations

import pytest

from moefleet.control import MetricsSnapshot, PolicyState, ScalingController
from moefleet.sim import SimConfig, Simulator
from tests.unit.sim_helpers import GB_S, GET, PUT, REQ, arrivals, plan, profile, spec

WARM = SimConfig(prewarm=True)


def run(p=None, prof=None, times=(0.0,), cfg=WARM, duration=100.0, decoder=False, top_k=1,
        prompt=10, output=None, policy=None):  # type: ignore[no-untyped-def]
    sim = Simulator(p or plan(), prof or profile(), spec(), top_k=top_k, decoder=decoder,
                    config=cfg, controller=policy)
    return sim.run(arrivals(*times, prompt=prompt, output=output), duration)


def test_one_request_warm_exact_latency_and_bill() -> None:
    r = run()
    # pre: warm 0.1 + 10 tok x 0.001 = 0.11, result back 10 x 1000 B / 2e6 B/s = 0.005;
    # expert: warm 0.1 + payload 0.005 + compute 10 x 0.01 = 0.1 -> 0.32, back -> 0.325;
    # post: warm 0.1 + payload 0.005 -> 0.43, back -> 0.435.
    assert r.latency["mean"] == pytest.approx(0.435, abs=1e-12)
    assert r.latency["p95"] == pytest.approx(0.435, abs=1e-12)
    # billed: pre 0.010 s, expert 0.105 s, post 0.005 s, all at 1 GB; three request fees.
    assert r.cost.compute == pytest.approx((0.010 + 0.105 + 0.005) * GB_S, rel=1e-9)
    assert r.cost.request == pytest.approx(3 * REQ)
    assert r.cost.storage == 0.0
    assert r.invocations == 3 and r.cold_starts == 0


def test_cold_start_then_warm_within_keep_alive() -> None:
    r = run(times=(0.0, 10.0), cfg=SimConfig(keep_alive_s=600.0))
    # cold: pre invoke 0.1 + init 1.0 + param 0.01 + 0.01 -> 1.12, back 1.125; expert
    # 0.1 + init 1.0 + 0.01 + 1e6/1e6 = 2.01, handler 0.105 -> 3.34, back 3.345; post
    # (warm segment instance) 0.105 -> 3.45, back 3.455. The second request: 0.435.
    assert r.latency["max"] == pytest.approx(3.455, abs=1e-9)
    assert r.latency["min"] == pytest.approx(0.435, abs=1e-9)
    assert r.cold_starts == 2
    # INIT is billed on this platform: (1.01 + 0.01) + (2.01 + 0.105) + 0.005 cold run.
    assert r.cost.compute == pytest.approx((1.02 + 2.115 + 0.005 + 0.12) * GB_S, rel=1e-9)


def test_scale_to_zero_after_keep_alive() -> None:
    cfg = SimConfig(keep_alive_s=5.0, interval_s=1.0)
    r = run(times=(0.0, 20.0), cfg=cfg, duration=30.0)
    assert r.cold_starts == 4  # both requests start both functions cold
    by_t = {round(row["t_s"]): row["instances"] for row in r.timeline}
    assert by_t[1] == 1 and by_t[2] == 2  # the expert starts once the segment is done
    assert by_t[8] == 2  # expert idle since 3.34, segment since 3.45: gone at 8.34, 8.45
    assert by_t[9] == 0 and by_t[19] == 0
    assert by_t[21] == 1 and by_t[22] == 2  # cold again: segment first, then the expert


def test_concurrency_limit_queues_calls() -> None:
    cfg = SimConfig(prewarm=True, scaling="replicas", concurrency=1)
    r = run(times=(0.0, 0.0), cfg=cfg)
    # A: 0.435 as alone. B's pre waits for A's (free at 0.11): 0.22, back 0.225; its
    # expert call waits for A's (free at 0.32): 0.525, back 0.53; post 0.53 + 0.11.
    assert r.latency["min"] == pytest.approx(0.435, abs=1e-9)
    assert r.latency["max"] == pytest.approx(0.64, abs=1e-9)
    assert r.peak_instances == 2  # never more than one instance per function


def test_on_demand_starts_a_second_instance_instead() -> None:
    r = run(times=(0.0, 0.0), cfg=SimConfig(prewarm=True))
    # B's pre finds the warm instance busy: a new cold one, 0.1 + 1.01 + 0.01, back
    # 1.125; its expert call finds the expert's instance idle again: 1.335; post 1.445.
    assert r.cold_starts == 1
    assert r.latency["min"] == pytest.approx(0.435, abs=1e-9)
    assert r.latency["max"] == pytest.approx(1.445, abs=1e-9)


def test_concurrency_shares_vcpus() -> None:
    cfg = SimConfig(prewarm=True, scaling="replicas", concurrency=2)
    r = run(times=(0.0, 0.0), cfg=cfg)
    # Both pre calls run at once on the 1-vCPU instance: the second gets 0.5 vCPU, 0.01 s
    # becomes 0.02 s (back at 0.125). B's expert call overlaps A's: 0.2 s of compute,
    # back at 0.125 + 0.1 + 0.205 + 0.005 = 0.435; post 0.105 + 0.005 -> 0.545.
    assert r.latency["min"] == pytest.approx(0.435, abs=1e-9)
    assert r.latency["max"] == pytest.approx(0.545, abs=1e-9)


def test_storage_method_times_and_requests() -> None:
    r = run(p=plan(method="storage"))
    # pre: compute 0.01 + upload T_acc 0.01 + 10 x 1000/1e6 = 0.03 -> 0.13, back 0.135;
    # expert (ODS a=2): 2 x 0.01 + 2 x 0.01 + 0.1 = 0.14 -> 0.375; post: payload 0.005 +
    # download 0.02 -> 0.5, back 0.505.
    assert r.latency["mean"] == pytest.approx(0.505, abs=1e-12)
    assert r.cost.storage == pytest.approx(2 * PUT + 2 * GET)  # pre PUT, expert GET+PUT, post GET
    assert r.cost.compute == pytest.approx((0.03 + 0.14 + 0.025) * GB_S, rel=1e-9)


def test_pipelined_method_overlaps_minibatches() -> None:
    r = run(p=plan(method="pipelined", beta=4))
    # expert with r=10, beta=4: blocks 4,4,2 -> 0.054 + 0.054 + 0.032 + tail 0.012 = 0.152
    assert r.latency["mean"] == pytest.approx(0.135 + 0.1 + 0.152 + 0.13, abs=1e-12)
    assert r.cost.storage == pytest.approx(3 * PUT + 3 * (GET + PUT) + 3 * GET)  # 3 objects


def test_replicas_split_tokens_and_more_vcpus_run_faster() -> None:
    r = run(p=plan(replicas=2))
    # 5 tokens per replica: 0.0025 + 0.05 = 0.0525; response 0.0025.
    assert r.latency["mean"] == pytest.approx(0.115 + 0.1 + 0.0525 + 0.0025 + 0.11, abs=1e-12)
    assert r.invocations == 4
    fast = run(p=plan(memory_mb=2048))  # 2 vCPUs: compute 0.1 -> 0.05
    assert fast.latency["mean"] == pytest.approx(0.435 - 0.05, abs=1e-12)
    assert fast.cost.compute == pytest.approx((0.010 + 0.055 * 2 + 0.005) * GB_S, rel=1e-9)


def test_prefill_then_decode_steps() -> None:
    for mode in ("per-request", "batched"):
        cfg = SimConfig(prewarm=True, decode=mode)  # type: ignore[arg-type]
        r = run(cfg=cfg, decoder=True, output=3)
        # prefill 0.435; a 1-token step (payloads 0.0005 s each way, block 0 gets token ids
        # for free): pre 0.1 + 0.001 + 0.0005, expert 0.1 + 0.0005 + 0.01 + 0.0005, post
        # 0.1 + 0.0005 + 0.0005
        step = 0.1015 + 0.111 + 0.101
        assert r.ttft["mean"] == pytest.approx(0.435, abs=1e-12)
        assert r.tpot["mean"] == pytest.approx(step, abs=1e-12)
        # the prefill pass yields the first token (as in the engine): 2 more steps for 3
        assert r.latency["mean"] == pytest.approx(0.435 + 2 * step, abs=1e-12)
        assert r.requests["output_tokens"] == 3


def test_batched_decode_shares_passes() -> None:
    r = run(times=(0.0, 0.0), cfg=SimConfig(prewarm=True, scaling="replicas", concurrency=4),
            decoder=True, output=2)
    # The engine's scheduler batches both prefills into one step (3 calls); their first
    # tokens come from it, the second tokens from one shared decode step (3 calls).
    assert r.invocations == 6
    per_request = run(times=(0.0, 0.0), cfg=SimConfig(prewarm=True, scaling="replicas",
                                                     concurrency=4, decode="per-request"),
                      decoder=True, output=2)
    # without batching: each request's prefill and decode pass on its own, 2 x 2 x 3 calls
    assert per_request.invocations == 12


def test_payload_over_limit_spills_through_the_store() -> None:
    r = run(prompt=2000)
    # 2000 tokens x 1000 B = 2 MB > the 1 MB payload limit: every executor <-> function
    # hop goes through the store, 0.01 + 2 MB / 1e6 B/s = 2.01 s. pre: 0.1 + 2.0 compute
    # + 2.01 back; expert: 0.1 + 2.01 in + 20.0 + 2.01 back; post: 0.1 + 2.01 + 2.01.
    assert r.latency["mean"] == pytest.approx(4.11 + 24.12 + 4.12, abs=1e-9)
    # functions: GET expert-in, post-in; PUT pre-out, expert-out, post-out; the executor
    # the other side of each hop: PUT expert-in, post-in; GET pre-, expert-, post-out.
    assert r.cost.storage == pytest.approx(5 * PUT + 5 * GET)
    assert r.cost_by_function["<executor>"].storage == pytest.approx(2 * PUT + 3 * GET)


def test_slo_violations_counted() -> None:
    r = run(times=(0.0, 10.0), cfg=SimConfig(slo_s=1.0))
    assert r.slo_violation_rate == pytest.approx(0.5)  # the cold 3.455 s one misses 1 s


class _Recorder(ScalingController):
    name = "recorder"

    def __init__(self) -> None:
        self.snapshots: list[MetricsSnapshot] = []

    def decide(self, snapshot: MetricsSnapshot, state: PolicyState):  # type: ignore[no-untyped-def]
        self.snapshots.append(snapshot)
        return {}, state


def test_snapshot_metrics() -> None:
    rec = _Recorder()
    run(times=(0.0, 5.0), cfg=SimConfig(prewarm=True, interval_s=1.0), policy=rec,
        p=plan(experts=2), top_k=1, prompt=10)
    first = rec.snapshots[0]
    e0, e1 = first.functions["exp-0-0"], first.functions["exp-0-1"]
    assert e0.tokens + e1.tokens == 10
    assert e0.token_share + e1.token_share == pytest.approx(1.0)
    seg = first.functions["seg-0"]
    assert seg.calls == 2 and seg.busy_s == pytest.approx(0.11 + 0.105)  # pre + post
    assert seg.instance_s == pytest.approx(1.0)  # one prewarmed instance all interval
    assert seg.utilisation == pytest.approx(0.215)
    # Latency 0.115 + 0.1 + d_max x (0.0005 + 0.01 + 0.0005) + 0.11: the busier expert.
    d_max = max(e0.tokens, e1.tokens)
    assert first.completions == 1
    assert first.p95_latency_s == pytest.approx(0.325 + 0.011 * d_max, abs=1e-12)
    assert e0.request_share == 1.0 and e1.request_share == 1.0


def test_node_slots_serialise_calls() -> None:
    r = run(p=plan(experts=2), top_k=2, cfg=SimConfig(prewarm=True, node_slots=1))
    # Both experts get all 10 tokens. One slot: the second expert call waits for the first
    # (0.115 -> 0.32), runs 0.32 -> 0.525, back 0.53; post 0.53 -> 0.635, back 0.64.
    assert r.latency["mean"] == pytest.approx(0.64, abs=1e-12)
    free = run(p=plan(experts=2), top_k=2)
    assert free.latency["mean"] == pytest.approx(0.435, abs=1e-12)
