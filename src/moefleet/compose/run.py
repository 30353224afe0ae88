"""Run requests to completion on an opened engine and bill each one, as the server does
(``serve/worker.py``) but in one thread: register -> step (bill the step) -> finish.

Invariants: every request added ends with one output and one :class:`RequestCost`; the
costs, plus what no request owned (``unattributed_usd``: work of aborted requests), add up
to what the biller charged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import IO, Any

from moefleet.compose.billing import RequestCost
from moefleet.compose.root import OpenedEngine
from moefleet.engine import RequestOutput, SamplingParams, merge_into

MAX_STEPS = 10_000_000


@dataclass
class BilledRun:
    outputs: list[RequestOutput]
    costs: list[RequestCost]
    wall_s: float
    basis: str
    steps: int = 0
    by_function: dict[str, float] = field(default_factory=dict)

    @property
    def total_usd(self) -> float:
        return sum(c.total for c in self.costs)


def run_billed(opened: OpenedEngine, prompts: Sequence[str | list[int]],
               params: SamplingParams | Sequence[SamplingParams], *,
               stream: IO[str] | None = None,
               progress: Callable[[], AbstractContextManager[Any]] | None = None,
               request_ids: Sequence[str] | None = None) -> BilledRun:
    """Add every prompt, step until all are done, bill as it goes; outputs in order.
    ``stream``: write each delta's text there (one request). ``progress``: a context
    manager factory giving a rich-style progress bar (``add_task`` / ``advance``)."""
    engine, biller = opened.engine, opened.biller
    plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    ids = [engine.add_request(p, sp, request_id=None if request_ids is None
                              else request_ids[i])
           for i, (p, sp) in enumerate(zip(prompts, plist, strict=True))]
    for rid in ids:
        biller.register(rid)
    merged = {rid: RequestOutput(rid, [], "", False) for rid in ids}
    costs: dict[str, RequestCost] = {}
    by_fn: dict[str, float] = {}
    steps = 0
    t0 = time.perf_counter()
    bar_cm = progress() if progress is not None else None
    bar = bar_cm.__enter__() if bar_cm is not None else None
    try:
        task = bar.add_task("requests", total=len(ids)) if bar is not None else None
        while engine.has_unfinished:
            steps += 1
            if steps > MAX_STEPS:
                raise RuntimeError(f"requests did not finish in {MAX_STEPS} steps")
            prev = engine.stats.steps[-1] if engine.stats.steps else None
            outs = engine.step()
            st = engine.stats.steps[-1] if engine.stats.steps else None
            if st is not None and st is not prev:
                served = {o.request_id for o in outs} | {
                    s.request_id for s in engine.scheduler.running}
                _add(by_fn, biller.step(served, st.forward_s))
            for o in outs:
                merge_into(merged[o.request_id], o)
                if stream is not None:
                    stream.write(o.new_text)
                    stream.flush()
                if o.finished:
                    costs[o.request_id], billed = biller.finish(o.request_id)
                    _add(by_fn, billed)
                    if bar is not None and task is not None:
                        bar.advance(task)
    finally:
        if bar_cm is not None:
            bar_cm.__exit__(None, None, None)
    if stream is not None:
        stream.write("\n")
    return BilledRun([merged[r] for r in ids], [costs[r] for r in ids],
                     time.perf_counter() - t0, biller.basis, steps, by_fn)


def _add(acc: dict[str, float], billed: dict[str, Any]) -> None:
    for fn, parts in billed.items():
        acc[fn] = acc.get(fn, 0.0) + parts.total
