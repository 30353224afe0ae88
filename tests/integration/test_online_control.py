"""The online harness end to end on a real deployment, on a fake clock: a controller's
decisions reach the local backend (the calls after them run on the new configuration),
a decision below the memory floor is clamped, and the simulator predicts the same
replay (same arrivals, plan and controller)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moefleet.control import (
    Decisions,
    FunctionConfig,
    MetricsSnapshot,
    PolicyState,
    ScalingController,
)
from moefleet.workloads.base import Arrival

pytestmark = [pytest.mark.integration]

MODEL = "tiny-mixtral-random"  # 3 MoE layers x 8 experts, top-2


class _Scripted(ScalingController):
    """At its first snapshot: exp-0-1 to 2048 MB, exp-1-2 to 128 MB (below the floor) and
    one replica. The replica change keeps the clamped decision a change whatever the
    floor measures: a floor equal to the plan's memory (the local runtime's RSS varies by
    machine and sits near a rung) would otherwise turn it into the current config, which
    :class:`MemoryFloor` drops."""

    name = "scripted"

    def __init__(self) -> None:
        self.seen: list[MetricsSnapshot] = []

    def decide(self, snapshot: MetricsSnapshot, state: PolicyState) -> tuple[Decisions,
                                                                             PolicyState]:
        self.seen.append(snapshot)
        if state:
            return {}, state
        return {"exp-0-1": FunctionConfig(2048, 1, 1),
                "exp-1-2": FunctionConfig(128, 1, 1)}, True


class _FakeClock:
    """Time moves only when the driver sleeps (and a little real time passes, so the
    request threads make progress)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, dt: float) -> None:
        import time

        time.sleep(0.005)
        self.t += dt


def test_online_run_applies_decisions_and_the_simulator_replays_it(tmp_path: Path) -> None:
    from moefleet.autoscale.smoe.harness import build_scenario
    from moefleet.calibration.smoe_online import OnlineSetup, calibrate_local
    from moefleet.experiments.smoe_online import (
        memory_floor,
        pod_plans,
        requests_for,
        run_measured,
        run_simulated,
        token_counts,
    )
    from moefleet.models import load_adapter, zoo
    from moefleet.profiles.cache import profile_for

    zoo.build(MODEL)
    adapter = load_adapter(MODEL)
    s = adapter.summary()
    sc = build_scenario(f"synthetic:blocks={s.num_layers},experts=8,top_k=2,hidden=64,"
                        "decoder=0", slo_s=1.0, interval_s=2.0)
    plans = pod_plans(sc, MODEL)
    profile = profile_for(MODEL)
    floor = memory_floor(plans[0], profile, (128, 256, 512, 1024, 2048))
    assert floor["exp-1-2"] > 128  # the local runtime alone is bigger than 128 MB
    setup = OnlineSetup(warmup=2, workers=1, prompt_tokens=8, poll_s=0.25)
    arrivals = [Arrival(t, f"online-{i}", 8) for i, t in enumerate((0.2, 1.0, 3.5, 4.0, 5.0))]
    warm_ids = ["warm-0", "warm-1"]
    batches, trace = requests_for(adapter, [*warm_ids, *(a.request_id for a in arrivals)],
                                  "wikitext2", None, 8)
    clock, ctl = _FakeClock(), _Scripted()
    log, warm = run_measured(sc, plans, adapter, ctl, floor, arrivals, 6.0, batches, warm_ids,
                             str(tmp_path / "store"), setup, clock=clock, sleep=clock.sleep)
    assert sorted(log.latencies) == sorted(a.request_id for a in arrivals) and not log.failed
    assert ctl.seen and ctl.seen[0].functions["seg-0"].calls > 0  # real records reached it
    applied = {name: cfg for _, name, cfg in log.applied}
    assert applied["exp-0-1"] == FunctionConfig(2048, 1, 1)
    assert applied["exp-1-2"] == FunctionConfig(floor["exp-1-2"], 1, 1)  # clamped, not raw
    assert log.clamped_floor == 1
    # Every request that arrived after the decision was applied ran exp-0-1 on the new
    # memory, and the first call on the new memory (by start time) was cold. Requests are
    # picked by arrival, not by record order: under load an earlier request (old memory)
    # can finish after later ones, and it can be the one whose call, dispatched after
    # the change, started the new instance, so the cold call is found by memory and time.
    applied_at = next(t for t, name, _ in log.applied if name == "exp-0-1") - log.t0
    after = {a.request_id for a in arrivals if a.t_s > applied_at}
    late = [r for r in log.records if r.function == "exp-0-1" and r.request_id in after]
    assert late and all(r.memory_mb == 2048 for r in late)
    resized = sorted((r for r in log.records if r.function == "exp-0-1"
                      and r.memory_mb == 2048), key=lambda r: r.start_s)
    assert resized[0].cold
    assert {r.memory_mb for r in log.records if r.function == "exp-1-2"} >= {floor["exp-1-2"]}

    tokens = token_counts(batches)
    cal, prof, caller_s = calibrate_local(sc, plans[0], profile, trace, s.vocab_size, warm,
                                          setup, tokens)
    assert caller_s >= 0 and cal.cold_start_s is not None
    sim_log, res = run_simulated(sc, plans[0], prof, trace, s.vocab_size, _Scripted(),
                                 floor, arrivals, 6.0, warm_ids, setup, cal, tokens, caller_s)
    assert sorted(sim_log.latencies) == sorted(log.latencies)
    assert res.reconfigurations >= 2 and sim_log.clamped_floor == 1
    # exact routing replay: every request makes as many calls in the simulator as it made
    # on the backend (pods never split a call, so configurations do not change the count)
    sim_calls = {rid: sum(r.request_id == rid for r in sim_log.records) for rid in log.calls}
    assert sim_calls == log.calls
