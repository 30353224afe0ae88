"""An ODS/BO plan's segment functions, played by the serving process (emulated).

A plan's non-experts live in segment functions, one per block; the platform would invoke
each one twice per step of an MoE block (``pre``: attention, gate, scatter; ``post``:
gather, combine, residual, the head at the last), once for a dense block, and bill every
invocation (the request price, the duration rounded up to its granularity). Segment
functions keep no KV cache between calls (:class:`~moefleet.runtime.segments.SegmentRunner`
serves prompts only), so a decoding run plays them here, and where it stands in for the
platform (``compare --measure``; ``EngineOptions(play_segments=True)``),
:class:`SegmentPlayedRunner` makes this process bill and pace as they would:

- each step's forward is held to the segments' vCPU share (each block's CPU time
  ``cpu_s / B`` stretched to ``/ min(1, vcpus)`` of its memory, as the local backend
  holds its functions; :func:`~moefleet.runtime.local_limits.hold_to_share`);
- each step yields the invocation records the platform would meter: per block a ``pre``
  record lasting the block's share of the held CPU time, and for an MoE block a ``post``
  record of zero duration (its gather and combine are in the ``pre`` share; billed at the
  platform's minimum), every record split among the step's sequences by their tokens;
- with the backend's startup emulation (``startup``, as the local backend's
  ``startup="platform"``), each invocation waits the platform's warm start (one after
  another, as the pipeline calls them; not billed), and a segment's first call its cold
  start too, billed as INIT (the played segments start cold once: a run shorter than the
  keep-alive).

``cpu_s`` is the step's non-expert CPU time: the calling thread's CPU time during the
forward less what it spent inside the expert seam (:class:`SeamClock`). Invoking the
expert functions (packing, sending, receiving, unpacking the rows) is the pipeline's
coordinator's work, which the platform does not bill to a segment (as
:mod:`moefleet.sim.pipeline` prices it); billed to the segments, the process's CPU read
31-35 ms per decode step of 6 rows on tiny-moe-lm, where the calibrated non-expert time of
the 4 blocks is 6 ms.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from moefleet.compose.wrapped_runner import WrappedRunner
from moefleet.engine.runner import ModelRunner, RunnerOutput
from moefleet.engine.scheduler import SchedulerOutput
from moefleet.platform import InvocationRecord, PlatformSpec
from moefleet.runtime.local_limits import hold_to_share
from moefleet.runtime.local_startup import StartupEmulation


class SeamClock:
    """Calling-thread CPU seconds spent inside the expert seam since the last
    :meth:`take` (the engine's step runs in one thread)."""

    def __init__(self) -> None:
        self.cpu_s = 0.0

    def wrap(self, experts: Any) -> Any:
        """``experts`` (an expert stack) timed; every other attribute is its own."""
        return _Timed(experts, self)

    def take(self) -> float:
        got, self.cpu_s = self.cpu_s, 0.0
        return got


class _Timed:
    def __init__(self, inner: Any, clock: SeamClock) -> None:
        self._inner, self._clock = inner, clock

    def __getattr__(self, name: str) -> Any:  # set_owners, close, skips_marked_pairs...
        return getattr(self._inner, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        try:
            return self._inner(*args, **kwargs)
        finally:
            self._clock.cpu_s += time.thread_time() - t0


@dataclass(frozen=True)
class PlayedSegment:
    """One block's segment function: its backend name, memory and whether the block is an
    MoE layer (a ``post`` call too)."""

    function: str
    memory_mb: int
    block: int
    moe: bool


class SegmentPlayedRunner(WrappedRunner):
    """``inner`` paced and billed as ``segments`` (see the module docstring); also the
    biller's :class:`~moefleet.compose.billing.Attributed` source of their records."""

    def __init__(self, inner: ModelRunner, segments: list[PlayedSegment],
                 spec: PlatformSpec, startup: StartupEmulation | None = None,
                 seam: SeamClock | None = None) -> None:
        if not segments:
            raise ValueError("a plan with segment functions has at least one block")
        super().__init__(inner)
        self.segments = list(segments)
        self.shares = [min(1.0, float(spec.vcpus(s.memory_mb))) for s in self.segments]
        if not all(v > 0 for v in self.shares):
            raise ValueError(f"segment vCPU shares must be > 0, got {self.shares}")
        # B blocks of cpu/B each, block b at shares[b]: the forward lasts cpu * mean(1/v)
        self.vcpus = len(self.shares) / sum(1.0 / v for v in self.shares)
        self.stretch_s = 0.0
        self.startup = startup
        self.seam = seam or SeamClock()  # none given: nothing is taken out
        self._started: set[int] = set()  # blocks whose segment has cold-started
        self._lock = threading.Lock()
        self._records: list[tuple[InvocationRecord, dict[str, float]]] = []

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.seam.take()
        res, cpu = self.execute_on_one_thread(out)  # the shares are at most one vCPU
        cpu = max(0.0, cpu - self.seam.take())
        # the non-expert work stretched to the share (its own wall time ~ its CPU time)
        extra = hold_to_share(cpu, cpu, self.vcpus)
        total = out.num_tokens
        if total:
            shares = {str(r.seq_id): len(r.token_ids) / total for r in out.rows}
            extra += self._bill(cpu, shares)
        res.forward_s += extra
        self.stretch_s += extra
        return res

    def _bill(self, cpu_s: float, shares: dict[str, float]) -> float:
        """Record the step's invocations; returns the startup wait it slept."""
        per_block = cpu_s / len(self.segments)
        made = []
        warm_s = self.startup.warm_s if self.startup is not None else 0.0
        cold_s = self.startup.cold_s if self.startup is not None else 0.0
        wait = 0.0
        for seg, v in zip(self.segments, self.shares, strict=True):
            cold = self.startup is not None and seg.block not in self._started
            self._started.add(seg.block)
            calls = [per_block / v] + ([0.0] if seg.moe else [])
            for i, dur in enumerate(calls):
                first = cold and i == 0
                wait += warm_s + (cold_s if first else 0.0)
                made.append((InvocationRecord(
                    function=seg.function, kind="segment", memory_mb=seg.memory_mb,
                    start_s=0.0, end_s=dur, layer=seg.block, cold=first,
                    init_s=cold_s if first else 0.0), dict(shares)))
        with self._lock:
            self._records.extend(made)
        if wait > 0:
            time.sleep(wait)
        return wait

    def drain(self) -> list[tuple[InvocationRecord, dict[str, float]]]:
        with self._lock:
            got, self._records = self._records, []
        return got

    def store_requests(self) -> tuple[int, int]:
        return (0, 0)  # the played segments' scatter and gather are the runner's own
