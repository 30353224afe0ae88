"""Timing primitives for compute profiles: clocks, thread settings, robust per-call times.

Clocks: at one thread, the CPU time of the calling thread (``time.thread_time``): torch
then computes in that thread, so the clock counts the function's work and not the time
other processes held the core; on an idle machine it equals wall time. At more threads,
wall time (``time.perf_counter``), the only honest clock for parallel work, which a busy
machine inflates; the profile's ``raw["notes"]`` say so when the load was high.

Each (function, v, n) cell: one warm-up call and one calibration call (the faster of the
two sets how many calls make one repeat, ≥ ``min_repeat_s``), then ``repeats`` repeats
in which every call is timed on its own; the cell's value is the median over all its
calls. Per-call medians matter on a shared machine: with 2 threads on 2 busy cores, one
descheduled worker thread stalls a call for a whole scheduler slice (ms for a µs call),
and a median over many calls discards those stalls where an average per repeat would
absorb them. Repeats are interleaved over batch sizes (round r of every n before round
r+1) so a burst of load hits one repeat of each cell instead of every repeat of one cell.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import platform
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

import torch

MIN_REPEAT_S = 5e-3  # one repeat lasts at least this long: µs calls run many times
MAX_INNER_CALLS = 200  # ... but never more than this many calls per repeat


def available_cpus() -> int:
    """CPUs this process may run on (the affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def clock_for(threads: int) -> Callable[[], float]:
    """The clock a cell at ``threads`` is timed with (see the module docstring)."""
    return time.thread_time if threads == 1 else time.perf_counter


@contextlib.contextmanager
def torch_threads(v: int) -> Iterator[None]:
    """Run with ``v`` intra-op threads; the previous setting is restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(v)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def time_cells(
    runners: Sequence[Callable[[], object]],
    repeats: int,
    min_repeat_s: float = MIN_REPEAT_S,
    clock: Callable[[], float] = time.perf_counter,
) -> list[list[float]]:
    """Per-call seconds of each runner by ``clock``: ``repeats`` rounds, interleaved.

    A round runs each runner enough times to last ``min_repeat_s`` (at least once) and
    times every call on its own, so the median over all calls of a cell shrugs off the
    calls that another process or a descheduled worker thread slowed down.
    """
    inner: list[int] = []
    for run in runners:
        dt = math.inf
        for _ in range(2):  # warm-up (allocates, wakes threads), then calibration:
            t0 = clock()  # the faster of the two is the less disturbed one
            run()
            dt = min(dt, clock() - t0)
        inner.append(max(1, min(MAX_INNER_CALLS, math.ceil(min_repeat_s / max(dt, 1e-9)))))
    samples: list[list[float]] = [[] for _ in runners]
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection inside a timed call is noise, not the function's cost
    try:
        for _ in range(repeats):
            for k, run in enumerate(runners):
                for _ in range(inner[k]):
                    t0 = clock()
                    run()
                    samples[k].append(clock() - t0)
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples


def median(xs: Sequence[float]) -> float:
    """The median (mean of the middle two for an even count)."""
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else 0.5 * (s[m - 1] + s[m])


def machine_info() -> dict[str, Any]:
    """What the profile was measured on (a planner may want to rescale to another CPU)."""
    cpu_model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu_model": cpu_model,
        "cpus": available_cpus(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def load_avg() -> list[float] | None:
    """1, 5 and 15-minute load averages, or None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None
