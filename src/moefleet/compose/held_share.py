"""An in-process main function held to its CPU share (emulated).

A Remoe main runs in the serving process, on whole threads; the platform would give a
main of ``memory_mb`` only ``vcpus`` of a core (aws-lambda: memory / 1,769 MB). Where a
run stands in for the platform (``compare --measure``; ``EngineOptions(hold_main_share=
True)``), :class:`ShareHeldRunner` stretches each step's forward to ``cpu_s / vcpus`` of
wall time, what a CPU quota of that share allows (the local backend's
:func:`~moefleet.runtime.local_limits.hold_to_share`, as for its functions), and reports
the stretched time as the step's ``forward_s``, which the main's bill is made of.
The forward runs on one torch thread and ``cpu_s`` is that thread's CPU time during it
(:meth:`~moefleet.compose.wrapped_runner.WrappedRunner.execute_on_one_thread`). It used
to be the whole process's at the process's thread count, which counted torch's spinning
second thread and the local backend's own threads as the main's work: stretched, that
made the held main's P95 TPOT 2.6-4.1x the simulated one (tiny random Mixtral, this
2-core machine).
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
        t0 = time.perf_counter()
        res, cpu = self.execute_on_one_thread(out)
        extra = hold_to_share(cpu, time.perf_counter() - t0, self.vcpus)
        res.forward_s += extra
        self.stretch_s += extra
        return res
