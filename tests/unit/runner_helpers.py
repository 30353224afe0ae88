"""A runner stand-in shared by the tests of runner wrappers (held share, played
segments): its forward burns a given CPU time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from moefleet.engine.runner import RunnerOutput


class Busy:
    """A runner whose forward burns ``cpu_s`` of CPU."""

    vocab_size = 7
    num_cache_blocks, block_size, max_model_len = 4, 16, 64

    def __init__(self, cpu_s: float) -> None:
        self.cpu_s = cpu_s
        self.freed: list[int] = []

    def execute(self, out: object) -> RunnerOutput:
        t0 = time.process_time()
        while time.process_time() - t0 < self.cpu_s:
            pass
        return RunnerOutput([], None, forward_s=self.cpu_s)

    def free(self, seq_ids: list[int]) -> None:
        self.freed += seq_ids


def threads_seen_by(wrap: Callable[[Busy], Any], out: object) -> tuple[list[int], int]:
    """Run ``wrap(runner).execute(out)`` with torch at two threads: the thread counts the
    inner forward saw, and the count after the step (restored?)."""
    import torch

    seen: list[int] = []

    class Counting(Busy):
        def execute(self, out: object) -> RunnerOutput:
            seen.append(torch.get_num_threads())
            return super().execute(out)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        wrap(Counting(0.0)).execute(out)
        return seen, torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
