"""An in-process main function held to its CPU share (emulated).

A Remoe main runs in the serving process, on whole threads; the platform would give a
main of ``memory_mb`` only ``vcpus`` of a core (aws-lambda: memory / 1,769 MB). Where a
run stands in for the platform (``compare --measure``; ``EngineOptions(hold_main_share=
True)``), :class:`ShareHeldRunner` stretches each step's forward to ``cpu_s / vcpus`` of
wall time, what a CPU quota of that share allows (the local backend's
:func:`~moefleet.runtime.local_limits.hold_to_share`, as for its functions), and reports
the stretched time as the step's ``forward_s``, which the main's bill is made of.
The forward runs on one torch thread, the rule the local backend gives its functions
(threads = round(vCPUs), at least 1), and ``cpu_s`` is that thread's CPU time during
the forward. It used to be the whole process's at the process's thread count (2 here),
which counted what is not the main's work: torch's second thread spinning between the
small ops of a decode step (and, after a step at two threads, into the next), and the
local backend's own threads. Stretched as the main's work, that made the held main's
P95 TPOT 2.6-4.1x the simulated one (tiny random Mixtral on this 2-core machine; median
step 14.3 ms of CPU against 7.2 ms at one thread).
Scheduling and sampling around the forward are not stretched.
"""

from __future__ import annotations

import time

from moefleet.compose.wrapped_runner import WrappedRunner
from moefleet.engine.runner import ModelRunner, RunnerOutput
from moefleet.engine.scheduler import SchedulerOutput
from moefleet.profiles.timing import torch_threads
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
        with torch_threads(1):
            cpu0, t0 = time.thread_time(), time.perf_counter()
            res = self.inner.execute(out)
            cpu = time.thread_time() - cpu0
        extra = hold_to_share(cpu, time.perf_counter() - t0, self.vcpus)
        res.forward_s += extra
        self.stretch_s += extra
        return res
