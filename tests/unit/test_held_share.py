"""A main held to its CPU share (compose/held_share.py): each forward is stretched to
cpu_s / vcpus of wall time and the stretch is in forward_s (the main's bill)."""

from __future__ import annotations

import time

import pytest

from moefleet.compose.held_share import ShareHeldRunner
from tests.unit.runner_helpers import Busy, threads_seen_by


def test_a_forward_is_stretched_to_its_share_and_billed_so() -> None:
    held = ShareHeldRunner(Busy(0.05), vcpus=0.25)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    res = held.execute(None)  # type: ignore[arg-type]
    wall = time.perf_counter() - t0
    assert wall >= 0.05 / 0.25 * 0.95
    assert res.forward_s == pytest.approx(wall, rel=0.2) and held.stretch_s > 0.1
    held.free([3])
    assert held.inner.freed == [3] and held.vocab_size == 7  # type: ignore[attr-defined]
    assert held.max_model_len == 64  # the inner runner's sizes


@pytest.mark.parametrize("vcpus", [0.0, 1.0, -0.5])
def test_a_share_outside_zero_one_is_refused(vcpus: float) -> None:
    with pytest.raises(ValueError, match="held share"):
        ShareHeldRunner(Busy(0.0), vcpus)  # type: ignore[arg-type]


def test_the_held_forward_runs_on_one_thread_and_restores_the_count() -> None:
    """A share below one vCPU gets one torch thread, as the local backend's functions do
    (a second thread's spin would be stretched as the main's work)."""
    seen, after = threads_seen_by(lambda r: ShareHeldRunner(r, vcpus=0.5), None)  # type: ignore[arg-type]
    assert seen == [1] and after == 2
