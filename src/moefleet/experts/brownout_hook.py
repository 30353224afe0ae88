"""SALC inside the engine: a :class:`~moefleet.engine.StepHook` that feeds it windows.

The hook holds no control logic: it keeps recent TTFT / TPOT samples (pruned to SALC's
windows), and before each engine step hands SALC a
:class:`~moefleet.brownout.salc.LatencyWindow` at the engine's ``now``, keeps the state
SALC returns and applies the decision: the step's kind (any prompt tokens -> prefill,
else decode) picks the threshold set on the
:class:`~moefleet.experts.brownout.BrownoutExperts`. After the step, every new token's
latency is a sample: a request's first token its TTFT, every later token its inter-token
gap (the TPOT sample). Everything runs on the engine's clock, so a fake clock drives it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Literal

from moefleet.brownout.salc import SALC, LatencyWindow, SALCDecisions
from moefleet.engine.request import RequestOutput
from moefleet.engine.scheduler import SchedulerOutput
from moefleet.experts.brownout import BrownoutExperts


class SALCHook:
    """Drive ``salc`` from the engine's steps and set ``experts.threshold``.

    ``state`` is SALC's latest state, ``last`` its latest decisions, ``trace`` (when
    ``keep_trace``) the (now, kind, threshold) of every step.
    """

    def __init__(self, salc: SALC, experts: BrownoutExperts, keep_trace: bool = True) -> None:
        self.salc, self.experts = salc, experts
        self.keep_trace = keep_trace
        self.state = salc.initial_state()
        self.last: SALCDecisions | None = None
        self.trace: list[tuple[float, str, float]] = []  # (now, kind, threshold)
        self._ttft: deque[tuple[float, float]] = deque()
        self._tpot: deque[tuple[float, float]] = deque()

    def record(self, kind: Literal["ttft", "tpot"], finish_s: float, latency_s: float) -> None:
        """One latency sample that finished at ``finish_s``."""
        (self._ttft if kind == "ttft" else self._tpot).append((finish_s, latency_s))

    def window(self, now: float) -> LatencyWindow:
        """The samples SALC may still use at ``now`` (older ones are dropped for good)."""
        for samples, width in ((self._ttft, self.salc.prefill.window_s),
                               (self._tpot, self.salc.decode.window_s)):
            while samples and samples[0][0] <= now - width:
                samples.popleft()
        return LatencyWindow(now, tuple(self._ttft), tuple(self._tpot))

    def set_threshold(self, kind: Literal["prefill", "decode"], now: float) -> float:
        """Run SALC at ``now``; set and return the threshold a ``kind`` step runs with."""
        self.last, self.state = self.salc.decide(self.window(now), self.state)
        threshold = self.last.threshold(kind)
        self.experts.threshold = threshold
        return threshold

    def before_step(self, out: SchedulerOutput, now: float) -> None:
        kind: Literal["prefill", "decode"] = "prefill" if out.has_prefill else "decode"
        threshold = self.set_threshold(kind, now)
        if self.keep_trace:
            self.trace.append((now, kind, threshold))

    def after_step(self, outputs: list[RequestOutput], now: float) -> None:
        for o in outputs:
            t = o.times
            if t is None or not t.token_times:
                continue
            if len(t.token_times) == 1:
                self.record("ttft", now, t.token_times[0] - t.arrival)
            else:
                self.record("tpot", now, t.token_times[-1] - t.token_times[-2])


class ThresholdReport:
    """Reports the threshold each step runs with, by step kind (e.g. to a Prometheus
    gauge); add it after the :class:`SALCHook` so it sees the step's setting."""

    def __init__(self, experts: BrownoutExperts, report: Callable[[str, float], None]) -> None:
        self.experts, self.report = experts, report

    def before_step(self, out: SchedulerOutput, now: float) -> None:
        self.report("prefill" if out.has_prefill else "decode", self.experts.threshold)

    def after_step(self, outputs: list[RequestOutput], now: float) -> None:
        return None
