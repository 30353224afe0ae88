"""Replay timed arrivals into an engine in real time (bounded, stops by itself)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from moefleet.engine.engine import Engine, merge_into
from moefleet.engine.request import EngineError, RequestOutput, SamplingParams


def replay(engine: Engine, arrivals: Sequence[tuple[float, list[int], SamplingParams]], *,
           max_wall_s: float = 3600.0,
           on_finish: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
    """Add each request when its arrival time (seconds after the start, sorted) comes;
    step while work is pending; return one merged output per arrival, in order.
    ``on_finish`` sees each merged output as its request finishes (progress, live counts).

    Arrival times are stamped on the engine's clock as the scheduled instant, so queueing
    behind a slow step counts in TTFT exactly as it would for a client."""
    start = engine.clock()
    ids: list[str] = []
    merged: dict[str, RequestOutput] = {}
    i = 0
    deadline = time.monotonic() + max_wall_s
    while i < len(arrivals) or engine.has_unfinished:
        if time.monotonic() > deadline:
            raise EngineError(f"replay did not finish within {max_wall_s:g} s",
                              "use fewer requests or a larger max_wall_s")
        now = engine.clock() - start
        while i < len(arrivals) and arrivals[i][0] <= now:
            t, prompt, params = arrivals[i]
            rid = engine.add_request(prompt, params, arrival=start + t)
            ids.append(rid)
            merged[rid] = RequestOutput(rid, [], "", False)
            i += 1
        if engine.has_unfinished:
            for o in engine.step():
                merge_into(merged[o.request_id], o)
                if o.finished and on_finish is not None:
                    on_finish(merged[o.request_id])
        elif i < len(arrivals):
            time.sleep(max(0.0, min(0.05, arrivals[i][0] - now)))
    return [merged[r] for r in ids]
