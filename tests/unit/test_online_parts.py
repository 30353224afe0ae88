"""The pure parts of the online run: the simulator's caller-side overhead, the memory
floor and the replay of applied decisions (no backend, no clock)."""

from __future__ import annotations

import pytest

from moefleet.control import (
    Decisions,
    FunctionConfig,
    FunctionMetrics,
    MemoryFloor,
    MetricsSnapshot,
    PolicyState,
    Replayed,
    ScalingController,
)
from moefleet.workloads.base import Arrival


def _snap(t: float, configs: dict[str, FunctionConfig]) -> MetricsSnapshot:
    fns = {n: FunctionMetrics(name=n, kind="expert", layer=0, expert=i, config=c, instances=1,
                              calls=0, tokens=0, cold_starts=0, busy_s=0.0, instance_s=10.0,
                              p95_latency_s=0.0, token_share=0.0, request_share=0.0,
                              interval_s=10.0)
           for i, (n, c) in enumerate(configs.items())}
    return MetricsSnapshot(t_s=t, interval_s=10.0, functions=fns, arrivals=0, completions=0,
                           in_flight_requests=0, p95_latency_s=0.0, slo_s=1.0,
                           slo_violation_rate=0.0)


class _Ask(ScalingController):
    name = "ask"

    def __init__(self, decisions: Decisions) -> None:
        self.decisions = decisions

    def decide(self, snapshot: MetricsSnapshot, state: PolicyState) -> tuple[Decisions,
                                                                             PolicyState]:
        return dict(self.decisions), state


def test_memory_floor_raises_and_counts_and_drops_no_ops() -> None:
    cur = {"exp-0-0": FunctionConfig(512, 1, 1), "exp-0-1": FunctionConfig(1024, 2, 1)}
    ask = _Ask({"exp-0-0": FunctionConfig(256, 1, 1),  # clamps back to the current config
                "exp-0-1": FunctionConfig(128, 4, 1), "exp-0-2": FunctionConfig(2048, 1, 1)})
    floor = MemoryFloor(ask, {"exp-0-0": 512, "exp-0-1": 512, "exp-0-2": 512})
    out, _ = floor.decide(_snap(10.0, cur), None)
    assert out == {"exp-0-1": FunctionConfig(512, 4, 1), "exp-0-2": FunctionConfig(2048, 1, 1)}
    assert [(n, d.memory_mb, a.memory_mb) for _, n, d, a in floor.clamped] == [
        ("exp-0-0", 256, 512), ("exp-0-1", 128, 512)]


def test_replayed_decides_again_at_the_interval_it_was_taken() -> None:
    c1, c2 = FunctionConfig(2048, 1, 1), FunctionConfig(1024, 4, 2)
    # applied 1 s after the snapshots of intervals 1 and 3 (poll lag of a real loop)
    ctl = Replayed([(11.04, "a", c1), (31.06, "b", c2), (31.06, "a", c2)], 10.0)
    state = ctl.initial_state()
    got = []
    deployed = {"a": FunctionConfig(512), "b": FunctionConfig(512)}
    for k in range(1, 5):
        out, state = ctl.decide(_snap(10.0 * k, deployed), state)
        got.append(out)
    assert got == [{"a": c1}, {}, {"a": c2, "b": c2}, {}]
    # a function the snapshot lacks gets no decision (the count still advances)
    out, _ = ctl.decide(_snap(30.0, {"b": FunctionConfig(512)}), 2)
    assert out == {"b": c2}


def test_caller_overhead_delays_the_request_but_holds_no_slot() -> None:
    from moefleet.autoscale.smoe.harness import build_scenario
    from moefleet.sim import SimConfig, SimError, Simulator

    sc = build_scenario()  # 4 MoE blocks: pre, experts, post = 12 sequential stages

    def run(caller_s: float, n: int) -> list[float]:
        cfg = SimConfig(scaling="replicas", prewarm=True, keep_alive_s=1e9, node_slots=1,
                        caller_overhead_s=caller_s, keep_requests=True)
        sim = Simulator(sc.plan, sc.profile, sc.spec, router=sc.routing(), config=cfg,
                        decoder=False)
        res = sim.run([Arrival(0.001 * i, f"r{i}", 64) for i in range(n)], 10.0)
        return [row["latency_s"] for row in res.request_log]

    (alone,), (alone_c,) = run(0.0, 1), run(0.01, 1)
    assert alone_c - alone == pytest.approx(12 * 0.01)
    # three requests on one slot: the caller's time overlaps the others' calls, so the
    # last one finishes far less than 12 x 10 ms later
    assert max(run(0.01, 3)) - max(run(0.0, 3)) < 0.05
    with pytest.raises(SimError, match="caller_overhead_s"):
        SimConfig(caller_overhead_s=-1.0)
