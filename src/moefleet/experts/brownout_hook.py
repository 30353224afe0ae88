"""SALC inside the engine: a :class:`~moefleet.engine.StepHook` around BrownoutControl.

Before each engine step the step's kind (any prompt tokens -> prefill, else decode)
picks the controller whose threshold the step runs with; after it, every new token's
latency is a sample: a request's first token its TTFT, every later token its
inter-token gap (the TPOT sample). Everything runs on the engine's clock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from moefleet.engine.request import RequestOutput
from moefleet.engine.scheduler import SchedulerOutput
from moefleet.experts.brownout import BrownoutExperts
from moefleet.experts.brownout_control import BrownoutControl


class SALCHook:
    def __init__(self, control: BrownoutControl, keep_trace: bool = True) -> None:
        self.control = control
        self.keep_trace = keep_trace
        self.trace: list[tuple[float, str, float]] = []  # (now, kind, threshold)

    def before_step(self, out: SchedulerOutput, now: float) -> None:
        kind: Literal["prefill", "decode"] = "prefill" if out.has_prefill else "decode"
        threshold = self.control.before_step(kind, now)
        if self.keep_trace:
            self.trace.append((now, kind, threshold))

    def after_step(self, outputs: list[RequestOutput], now: float) -> None:
        for o in outputs:
            t = o.times
            if t is None or not t.token_times:
                continue
            if len(t.token_times) == 1:
                self.control.record("ttft", now, t.token_times[0] - t.arrival)
            else:
                self.control.record("tpot", now, t.token_times[-1] - t.token_times[-2])


class ThresholdReport:
    """Reports the threshold each step runs with, by step kind (e.g. to a Prometheus
    gauge); add it after the :class:`SALCHook` so it sees the step's setting."""

    def __init__(self, experts: BrownoutExperts, report: Callable[[str, float], None]) -> None:
        self.experts, self.report = experts, report

    def before_step(self, out: SchedulerOutput, now: float) -> None:
        self.report("prefill" if out.has_prefill else "decode", self.experts.threshold)

    def after_step(self, outputs: list[RequestOutput], now: float) -> None:
        return None
