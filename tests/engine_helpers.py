"""Engines for tests, through the composition root (``compose.presets``), and the host
reads of their decode steps."""

from typing import Any

from moefleet.compose.presets import build_engine, opened_engine
from moefleet.engine import SamplingParams
from moefleet.engine.host_reads import HostReads

__all__ = ["build_engine", "decode_step_reads", "opened_engine"]


def decode_step_reads(engine: Any, requests: int, max_tokens: int) -> list[HostReads]:
    """``requests`` short prompts (2, 3, ... tokens: one prefill step), then every decode
    step under its own :class:`HostReads` (sites kept, for failure messages)."""
    for i in range(requests):
        engine.add_request([7 + i, 8, 9, 10, 11][: 2 + i],
                           SamplingParams(max_tokens=max_tokens, temperature=0,
                                          ignore_eos=True))
    engine.step()  # the prefill
    counters = []
    while engine.has_unfinished:
        with HostReads(keep_sites=True) as counter:
            engine.step()
        counters.append(counter)
    return counters
