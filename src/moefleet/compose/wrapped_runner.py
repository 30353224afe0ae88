"""A runner that wraps another (emulations around the engine's forward): everything but
``execute`` is the inner runner's (sizes, cache, adapter, ``free``)."""

from __future__ import annotations

import time
from typing import Any

from moefleet.engine.runner import ModelRunner, RunnerOutput
from moefleet.engine.scheduler import SchedulerOutput
from moefleet.profiles.timing import torch_threads


class WrappedRunner:
    """Delegates to ``inner``; subclasses override :meth:`execute`."""

    def __init__(self, inner: ModelRunner) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:  # sizes, cache, adapter: the inner runner's
        return getattr(self.inner, name)

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def free(self, seq_ids: list[int]) -> None:
        self.inner.free(seq_ids)

    def execute_on_one_thread(self, out: SchedulerOutput) -> tuple[RunnerOutput, float]:
        """The inner forward on one torch thread, and the stepping thread's CPU seconds
        during it. The emulations stand in for functions of one vCPU or less, which the
        local backend runs on one thread (threads = round(vCPUs), at least 1). At two
        threads the second spins between a decode step's small ops: the played ODS/BO
        segments' P95 TPOT read 1.29-1.38x the simulated one (1.15-1.23x on one), and a
        held Remoe main counted as its own CPU that spin and the local backend's threads
        (median step 14.3 ms of CPU against 7.2 ms; tiny random Mixtral, 2-core machine)."""
        with torch_threads(1):
            cpu0 = time.thread_time()
            res = self.inner.execute(out)
            return res, time.thread_time() - cpu0
