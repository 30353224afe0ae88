"""The runtime control loop against the local backend, on a fake clock."""

from __future__ import annotations

import pytest

from moefleet.control import (
    ControlError,
    Decisions,
    FunctionConfig,
    MetricsSnapshot,
    PolicyState,
    ScalingController,
)
from moefleet.runtime import FunctionSpec, HandlerRef
from moefleet.runtime.control import ControlConfig, ControlLoop
from moefleet.runtime.local import LocalBackend
from moefleet.runtime.payload import pack

DEBUG = HandlerRef("moefleet.runtime.handlers:debug_handler")


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class _Grow(ScalingController):
    """Doubles the memory of the busiest expert once; records what it saw."""

    name = "grow"

    def __init__(self) -> None:
        self.seen: list[MetricsSnapshot] = []

    def decide(self, snapshot: MetricsSnapshot, state: PolicyState) -> tuple[Decisions,
                                                                             PolicyState]:
        self.seen.append(snapshot)
        if state:
            return {}, state
        busiest = max((m for m in snapshot.functions.values() if m.kind == "expert"),
                      key=lambda m: m.calls)
        c = busiest.config
        return {busiest.name: FunctionConfig(c.memory_mb * 2, 2, c.concurrency)}, True


def test_control_loop_snapshots_and_applies_with_delay() -> None:
    clock = _Clock()
    ctl = _Grow()
    with LocalBackend("aws-lambda", workers=1, retry_backoff_s=0.01) as b:
        for e in range(2):
            b.deploy(FunctionSpec(f"exp-0-{e}", "expert", DEBUG, memory_mb=256, layer=0,
                                  experts=(e,)))
        loop = ControlLoop(b, ctl, ControlConfig(interval_s=10, apply_delay_s=2, slo_s=1.0),
                           clock=clock)
        for i in range(3):
            loop.request_started()
            b.invoke("exp-0-0", pack(meta={"op": "pid"}), request_id=f"r{i}")
            loop.request_finished(0.5 if i else 2.0)
        b.invoke("exp-0-1", pack(meta={"op": "pid"}), request_id="r0")
        assert loop.tick() is None  # not an interval yet
        clock.t += 10
        snap = loop.tick()
        assert snap is not None and snap.arrivals == 3 and snap.completions == 3
        m0, m1 = snap.functions["exp-0-0"], snap.functions["exp-0-1"]
        assert (m0.calls, m1.calls, m0.cold_starts) == (3, 1, 1)
        assert m0.token_share == pytest.approx(0.75) and m1.request_share == pytest.approx(1 / 3)
        assert snap.slo_violation_rate == pytest.approx(1 / 3)
        assert b.spec("exp-0-0").memory_mb == 256  # decided, not applied yet
        clock.t += 1
        loop.tick()
        assert not loop.applied
        clock.t += 1
        loop.tick()
        assert [(n, c.memory_mb, c.replicas) for _, n, c in loop.applied] == [
            ("exp-0-0", 512, 2)]
        spec = b.spec("exp-0-0")
        assert (spec.memory_mb, spec.replicas) == (512, 2)
        rec = b.invoke("exp-0-0", pack(meta={"op": "pid"})).record
        assert rec.cold and rec.memory_mb == 512  # a memory change starts cold
        clock.t += 10
        snap2 = loop.tick()
        assert snap2 is not None and snap2.functions["exp-0-0"].calls == 1
        assert snap2.functions["exp-0-0"].config.memory_mb == 512


def test_bad_interval_is_an_error() -> None:
    with pytest.raises(ControlError, match="interval"):
        ControlConfig(interval_s=0)
    with pytest.raises(ControlError, match="delay"):
        ControlConfig(apply_delay_s=-1)
