"""The shared bounds/hysteresis/delay wrapper (time is the snapshot's) and the baselines."""

from __future__ import annotations

from dataclasses import replace

import pytest

from moefleet.autoscale import ElasticMoEPolicy, HPAPolicy, make_policy
from moefleet.control import (
    Bounded,
    ControlError,
    Decisions,
    FunctionConfig,
    FunctionMetrics,
    MetricsSnapshot,
    PolicyState,
    ScalingBounds,
    ScalingController,
    StaticPolicy,
)
from moefleet.errors import UnknownNameError


class Want(ScalingController):
    """Wants whatever the test says (``self.target``) for function ``f``."""

    name = "want"

    def __init__(self) -> None:
        self.target: FunctionConfig | None = None

    def decide(self, snapshot: MetricsSnapshot, state: PolicyState) -> tuple[Decisions,
                                                                             PolicyState]:
        calls = (state or 0) + 1  # state is a plain int: the inner state is threaded through
        return ({"f": self.target} if self.target else {}), calls


def snap(replicas: int = 2, memory: int = 1024, concurrency: int = 1, t: float = 0.0,
         **metrics: float) -> MetricsSnapshot:
    m = FunctionMetrics(name="f", kind="expert", layer=0, expert=0,
                        config=FunctionConfig(memory, replicas, concurrency), **metrics)
    return MetricsSnapshot(t_s=t, interval_s=metrics.get("interval_s", 1.0),
                           functions={"f": m})


def test_bounds_clamp_and_round_memory() -> None:
    b = ScalingBounds(min_replicas=2, max_replicas=4, max_concurrency=3,
                      memory_options_mb=(512, 1024, 2048))
    assert b.clamp(FunctionConfig(700, 9, 7)) == FunctionConfig(1024, 4, 3)
    assert b.clamp(FunctionConfig(9999, 1, 1)) == FunctionConfig(2048, 2, 1)
    with pytest.raises(ControlError):
        ScalingBounds(min_replicas=3, max_replicas=2)
    with pytest.raises(ControlError):
        FunctionConfig(1024, 0, 1)


def test_upscale_delay_in_snapshot_time() -> None:
    inner = Want()
    pol = Bounded(inner, upscale_delay_s=10.0, downscale_delay_s=30.0)
    state = pol.initial_state()
    inner.target = FunctionConfig(1024, 4, 1)
    out, state = pol.decide(snap(), state)
    assert out == {}  # wanted since t=0, not yet 10 s
    out, state = pol.decide(snap(t=9.9), state)
    assert out == {}
    out, state = pol.decide(snap(t=10.0), state)
    assert out == {"f": FunctionConfig(1024, 4, 1)}
    assert state.inner == 3  # the inner policy's own state went round three times


def test_direction_change_or_silence_resets_the_timer() -> None:
    inner = Want()
    pol = Bounded(inner, upscale_delay_s=10.0, downscale_delay_s=10.0)
    state = pol.initial_state()
    inner.target = FunctionConfig(1024, 4, 1)
    _, state = pol.decide(snap(), state)
    inner.target = FunctionConfig(1024, 1, 1)  # now down: timer restarts at 6
    out, state = pol.decide(snap(t=6.0), state)
    out, state = pol.decide(snap(t=12.0), state)
    assert out == {}
    out, state = pol.decide(snap(t=16.0), state)
    assert out == {"f": FunctionConfig(1024, 1, 1)}
    inner.target = FunctionConfig(1024, 4, 1)
    _, state = pol.decide(snap(t=16.0), state)  # up wanted from 16
    inner.target = None
    _, state = pol.decide(snap(t=20.0), state)  # silence: forgotten
    inner.target = FunctionConfig(1024, 4, 1)
    out, state = pol.decide(snap(t=27.0), state)
    assert out == {}  # the timer restarted at 27, not 16


def test_hysteresis_ignores_small_changes() -> None:
    inner = Want()
    pol = Bounded(inner, ScalingBounds(max_replicas=100), tolerance=0.1)
    state = pol.initial_state()
    inner.target = FunctionConfig(1024, 21, 1)  # 21 vs 20 = 5%: ignored
    out, state = pol.decide(snap(replicas=20), state)
    assert out == {}
    inner.target = FunctionConfig(1024, 23, 1)  # 15%: applied (no delay configured)
    out, state = pol.decide(snap(replicas=20), state)
    assert out["f"].replicas == 23
    inner.target = FunctionConfig(1024, 20, 2)  # concurrency always counts
    out, _ = pol.decide(snap(replicas=20), state)
    assert out["f"].concurrency == 2


def test_state_is_not_mutated() -> None:
    inner = Want()
    pol = Bounded(inner, upscale_delay_s=5.0)
    s0 = pol.initial_state()
    inner.target = FunctionConfig(1024, 4, 1)
    _, s1 = pol.decide(snap(), s0)
    assert s0.pending == {} and "f" in s1.pending


def test_hpa_rule() -> None:
    hpa = HPAPolicy(target=2.0)
    # busy 10 s in a 1 s interval = 10 calls in flight on average, 2 queued: 12 / 2 = 6.
    out, _ = hpa.decide(snap(replicas=2, busy_s=10.0, queued=2), None)
    assert out["f"].replicas == 6
    out, _ = hpa.decide(snap(replicas=6, busy_s=0.0), None)
    assert out["f"].replicas == 1
    rps = HPAPolicy(target=5.0, metric="rps")
    out, _ = rps.decide(snap(replicas=1, calls=22, interval_s=2.0), None)
    assert out["f"].replicas == 3  # 11 calls/s over 5 per replica


def test_elasticmoe_rule() -> None:
    pol = ElasticMoEPolicy(target_utilisation=0.5)
    # 1000 tokens served in 2 busy seconds = 500 tokens/s per replica; 1000 tokens/s load
    # at 50% target utilisation needs 4 replicas.
    out, _ = pol.decide(snap(replicas=1, tokens=1000, busy_s=2.0, interval_s=1.0), None)
    assert out["f"].replicas == 4
    # No calls yet: the profile's capacity decides; no load -> 1 replica.
    out, _ = pol.decide(snap(replicas=3, capacity_tokens_per_s=100.0), None)
    assert out["f"].replicas == 1


def test_make_policy() -> None:
    assert isinstance(make_policy("static"), StaticPolicy)
    assert make_policy("HPA").name == "hpa"
    assert isinstance(make_policy("elasticmoe"), Bounded)
    with pytest.raises(UnknownNameError):
        make_policy("magic")
    with pytest.raises(ControlError):
        Bounded(StaticPolicy(), upscale_delay_s=-1.0)


def test_unknown_function_in_decision_is_an_error() -> None:
    class Bad(ScalingController):
        def decide(self, snapshot: MetricsSnapshot, state: PolicyState) -> tuple[
                Decisions, PolicyState]:
            return {"nope": FunctionConfig(1024)}, state

    with pytest.raises(ControlError, match="nope"):
        Bounded(Bad()).decide(snap(), Bounded(Bad()).initial_state())


def test_metrics_properties() -> None:
    m = snap(replicas=2, concurrency=2, busy_s=3.0, instance_s=2.0, in_flight=3,
             instances=2, tokens=50, calls=5, interval_s=2.0).functions["f"]
    assert m.utilisation == pytest.approx(0.75)  # 3 busy s over 2 inst-s x 2 slots
    assert m.mean_concurrency == pytest.approx(1.5)
    assert m.concurrency_utilisation == pytest.approx(0.75)
    assert m.tokens_per_s == 25 and m.calls_per_s == 2.5
    assert replace(m, instances=0, in_flight=0).concurrency_utilisation == 0.0
