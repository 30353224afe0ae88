"""An in-process main function held to its CPU share (emulated).

A Remoe main runs in the serving process, on whole threads; the platform would give a
main of ``memory_mb`` only ``vcpus`` of a core (aws-lambda: memory / 1,769 MB). Where a
run stands in for the platform (``compare --measure``; ``EngineOptions(hold_main_share=
True)``), :class:`ShareHeldRunner` stretches each step's forward to ``cpu_s / vcpus`` of
wall time, what a CPU quota of that share allows (the local backend's
:func:`~moefleet.runtime.local_limits.hold_to_share`, as for its functions), and reports
the stretched time as the step's ``forward_s``, which the main's bill is made of.
``cpu_s`` is this process's CPU time during the forward (every thread's: conservative,
it can only stretch more).
Scheduling and sampling around the forward are not stretched.
"""

from __future__ import annotations

import time

from moefleet.compose.wrapped_runner import WrappedRunner
from moefleet.engine.runner import ModelRunner, RunnerOutput
from moefleet.engine.scheduler import SchedulerOutput
from moefleet.runtime.local_limits import hold_to_share


class ShareHeldRunner(WrappedRunner):
    """``inner`` with each :meth:`execute` held to ``vcpus`` (< 1) of a core."""

    def __init__(self, inner: ModelRunner, vcpus: float) -> None:
        if not 0 < vcpus < 1:
            raise ValueError(f"a held share is in (0, 1) vCPU, got {vcpus!r}")
        super().__init__(inner)
        self.vcpus = vcpus
        self.stretch_s = 0.0  # total wall time added

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        cpu0, t0 = time.process_time(), time.perf_counter()
        res = self.inner.execute(out)
        extra = hold_to_share(time.process_time() - cpu0, time.perf_counter() - t0,
                              self.vcpus)
        res.forward_s += extra
        self.stretch_s += extra
        return res
