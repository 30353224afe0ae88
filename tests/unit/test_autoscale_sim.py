"""Policies inside the simulator: HPA follows a step in load; decisions take effect after
the configured delay; a static policy never reconfigures."""

from __future__ import annotations

from moefleet.autoscale.baselines import make_policy
from moefleet.control import FunctionConfig, MetricsSnapshot, PolicyState, ScalingController
from moefleet.sim import SimConfig, Simulator
from moefleet.workloads import StepWorkload
from tests.unit.sim_helpers import arrivals, plan, profile, spec

CFG = SimConfig(scaling="replicas", interval_s=5.0, apply_delay_s=1.0, prewarm=True,
                keep_alive_s=60.0)


def simulate(policy: ScalingController | None, workload: StepWorkload):  # type: ignore[no-untyped-def]
    sim = Simulator(plan(experts=4), profile(), spec(), top_k=1, decoder=False, config=CFG,
                    controller=policy, seed=3)
    return sim.run(workload, 120.0)


def test_hpa_scales_up_after_a_step() -> None:
    step = StepWorkload(1.0, 60.0, 10.0)  # 1 request/s, then 10/s from t = 60 s
    hpa = simulate(make_policy("hpa", upscale_delay_s=0.0, downscale_delay_s=30.0), step)
    rows = hpa.timeline
    before = max(sum(map(sum, r["expert_replicas"])) for r in rows if 50 <= r["t_s"] <= 60)
    after = max(sum(map(sum, r["expert_replicas"])) for r in rows if 70 <= r["t_s"] <= 120)
    assert before == 4  # one replica per expert once the light load has settled
    assert after > before
    assert hpa.reconfigurations > 0
    static = simulate(None, step)
    assert static.reconfigurations == 0
    assert hpa.latency["p95"] < static.latency["p95"]  # the extra replicas cut queueing


class _OnceAt(ScalingController):
    """At the first snapshot, give exp-0-0 2048 MB (2 vCPUs: compute twice as fast)."""

    name = "once"

    def decide(self, snapshot: MetricsSnapshot, state: PolicyState):  # type: ignore[no-untyped-def]
        if state:
            return {}, state
        return {"exp-0-0": FunctionConfig(2048, 1, 1)}, True


def test_decision_applies_after_delay_with_a_cold_start() -> None:
    cfg = SimConfig(interval_s=5.0, apply_delay_s=1.0, prewarm=True, keep_alive_s=600.0)
    sim = Simulator(plan(), profile(), spec(), top_k=1, decoder=False, config=cfg,
                    controller=_OnceAt())
    r = sim.run(arrivals(0.0, 5.5, 6.5), 10.0)
    # t=0: old config, warm: 0.435. t=5.5: decided at 5, applied at 6: 0.435 again.
    # t=6.5: new size -> new instance: invoke 0.1 + cold 1.0 + 0.01 + 1.0, then payload
    # 0.005 + compute 0.05 at 2 vCPUs: 0.115 + 2.11 + 0.055 + 0.005 + post 0.11 = 2.395.
    assert abs(r.latency["min"] - 0.435) < 1e-9
    assert abs(r.latency["max"] - 2.395) < 1e-9
    assert r.cold_starts == 1 and r.reconfigurations == 1
