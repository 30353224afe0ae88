"""An ODS/BO plan's segment functions played by the serving process
(compose/played_segments.py): each step is held to the segments' vCPU share and yields
the invocations the platform would bill (a ``pre`` per block lasting its share of the
step's CPU time, a zero-length ``post`` per MoE block), split by the step's tokens."""

from __future__ import annotations

import time

import pytest

from moefleet.compose.played_segments import PlayedSegment, SegmentPlayedRunner
from moefleet.engine.runner import RunnerOutput
from moefleet.engine.scheduler import ScheduledSeq, SchedulerOutput
from moefleet.platform import load_platform
from moefleet.platform.billing import Meter
from tests.unit import runner_helpers


class Busy(runner_helpers.Busy):
    vocab_size = 11


def _step(*tokens: int) -> SchedulerOutput:
    return SchedulerOutput([ScheduledSeq(i, [1] * n, 0, True, False) for i, n in
                            enumerate(tokens)])


def _segments(memory_mb: int, moe: tuple[bool, ...]) -> list[PlayedSegment]:
    return [PlayedSegment(f"x/seg-{b}", memory_mb, b, m) for b, m in enumerate(moe)]


def test_a_step_is_billed_as_the_segments_invocations_split_by_tokens() -> None:
    spec = load_platform("aws-lambda")
    played = SegmentPlayedRunner(Busy(0.04), _segments(1769, (True, False, True)),  # type: ignore[arg-type]
                                 spec)
    assert played.vcpus == pytest.approx(1.0)  # 1,769 MB is one vCPU: nothing to hold
    played.execute(_step(3, 1))
    got = played.drain()
    assert played.drain() == []  # drained once
    # a pre per block, a post per MoE block, in block order
    assert [(r.function, r.end_s > 0) for r, _ in got] == [
        ("x/seg-0", True), ("x/seg-0", False), ("x/seg-1", True), ("x/seg-2", True),
        ("x/seg-2", False)]
    pre = [r.duration_s for r, _ in got if r.duration_s > 0]
    assert sum(pre) >= 0.04 * 0.95 and max(pre) == pytest.approx(min(pre))
    assert all(s == {"0": 0.75, "1": 0.25} for _, s in got)
    assert all(r.kind == "segment" and r.memory_mb == 1769 for r, _ in got)
    meter = Meter(spec)
    post = meter.price(got[1][0])
    assert post[0].request > 0 and post[1] > 0  # billed at the platform's minimum
    assert played.store_requests() == (0, 0) and played.vocab_size == 11
    played.free([4])
    assert played.inner.freed == [4] and played.max_model_len == 64  # type: ignore[attr-defined]


def test_a_step_is_held_to_a_fraction_of_a_vcpu_and_billed_held() -> None:
    spec = load_platform("aws-lambda")
    v = spec.vcpus(512)
    assert v < 0.5
    played = SegmentPlayedRunner(Busy(0.03), _segments(512, (True, True)), spec)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    res = played.execute(_step(2))
    wall = time.perf_counter() - t0
    assert wall >= 0.03 / v * 0.95 and played.stretch_s > 0
    assert res.forward_s == pytest.approx(0.03 + played.stretch_s)
    pre = sum(r.duration_s for r, _ in played.drain())
    assert pre >= 0.03 / v * 0.95  # what a held block's handler lasts, billed so


def test_an_empty_step_bills_nothing_and_no_segment_is_refused() -> None:
    spec = load_platform("aws-lambda")
    played = SegmentPlayedRunner(Busy(0.0), _segments(1024, (True,)), spec)  # type: ignore[arg-type]
    played.execute(SchedulerOutput())
    assert played.drain() == []
    with pytest.raises(ValueError, match="at least one block"):
        SegmentPlayedRunner(Busy(0.0), [], spec)  # type: ignore[arg-type]


def test_play_segments_is_refused_where_no_segment_function_exists() -> None:
    from moefleet.compose import EngineOptions
    from moefleet.errors import MoefleetError

    with pytest.raises(MoefleetError, match="'segments' runner really invokes"):
        EngineOptions(runner="segments", play_segments=True)


def test_the_platforms_startup_is_waited_and_a_first_call_billed_as_init() -> None:
    """With the backend's startup emulation: every invocation waits the warm start, each
    segment's first one the cold start too, billed as INIT; later steps are warm."""
    from moefleet.runtime.local_startup import StartupEmulation

    spec = load_platform("aws-lambda")
    emu = StartupEmulation(cold_s=0.05, warm_s=0.01)
    played = SegmentPlayedRunner(Busy(0.0), _segments(1769, (True, False)), spec,  # type: ignore[arg-type]
                                 startup=emu)
    t0 = time.perf_counter()
    res = played.execute(_step(1))
    first = time.perf_counter() - t0
    calls = 3  # pre + post of block 0, pre of block 1
    assert first >= (calls * 0.01 + 2 * 0.05) * 0.95
    assert res.forward_s >= calls * 0.01 + 2 * 0.05
    got = played.drain()
    assert [(r.cold, r.init_s) for r, _ in got] == [(True, 0.05), (False, 0.0), (True, 0.05),
                                                    ]
    assert Meter(spec).price(got[0][0])[1] > Meter(spec).price(got[1][0])[1]  # INIT billed
    t0 = time.perf_counter()
    played.execute(_step(1))
    assert time.perf_counter() - t0 < 2 * 0.05  # warm now: the warm starts only
    assert not any(r.cold for r, _ in played.drain())


def _burn(seconds: float) -> None:
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass


def test_the_expert_seams_cpu_is_the_coordinators_not_a_segments() -> None:
    """Invoking the expert functions is the coordinator's work (unbilled, as the
    simulator prices it): the seam's CPU time is taken out of the segments' bill; the
    timed stack keeps the stack's own attributes."""
    from moefleet.compose.played_segments import SeamClock

    class Experts:
        def __init__(self) -> None:
            self.owners: list[str] = []

        def set_owners(self, owners: list[str]) -> None:
            self.owners = owners

        def __call__(self, seconds: float) -> None:
            _burn(seconds)

    clock = SeamClock()
    experts = clock.wrap(Experts())
    experts.set_owners(["7"])
    assert experts.owners == ["7"]

    class Forward(Busy):
        def execute(self, out: object) -> RunnerOutput:
            _burn(0.02)  # non-experts
            experts(0.06)  # the expert seam
            return RunnerOutput([], None, forward_s=0.08)

    spec = load_platform("aws-lambda")
    played = SegmentPlayedRunner(Forward(0.0), _segments(1769, (True,)), spec,  # type: ignore[arg-type]
                                 seam=clock)
    played.execute(_step(1))
    pre = sum(r.duration_s for r, _ in played.drain())
    assert 0.02 * 0.9 <= pre < 0.05, pre  # the 0.06 s in the seam is not billed


def test_the_played_forward_runs_on_one_thread_and_restores_the_count() -> None:
    """The played segments hold at most one vCPU each, and run on one torch thread as the
    local backend's functions of that size do."""
    spec = load_platform("aws-lambda")
    seen, after = runner_helpers.threads_seen_by(
        lambda r: SegmentPlayedRunner(r, _segments(1769, (True,)), spec),  # type: ignore[arg-type]
        _step(1))
    assert seen == [1] and after == 2
