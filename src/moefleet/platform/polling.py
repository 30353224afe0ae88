"""Polling with exponential backoff, shared by the runtime and the cost model (torch-free).

A poller asks, sleeps ``first_s``, asks again, doubling the sleep up to ``cap_s``. Every
ask is a billed object-store request (a GET or HEAD on S3), so the cost model counts the
asks a wait of ``wait_s`` costs with the same schedule the runtime sleeps by.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np

ROUTE_POLL = (0.002, 0.02)  # the coordinator waiting for a pipelined gate's routing
MINIBATCH_POLL = (0.002, 0.05)  # a pipelined expert waiting for its next minibatch
STORE_IO_THREADS = 8  # parallel object-store requests of one function (S3 clients do too)


def delays(first_s: float, cap_s: float) -> Iterator[float]:
    """The sleeps between asks: first_s, 2·first_s, ... capped at cap_s, forever."""
    d = first_s
    while True:
        yield d
        d = min(2 * d, cap_s)


def failed_asks(wait_s: float, first_s: float, cap_s: float, limit: int = 100_000) -> int:
    """Asks that find nothing while the awaited object appears ``wait_s`` after the first
    ask (the successful ask not included); bounded by ``limit``."""
    if wait_s <= 0:
        return 0
    slept = 0.0
    for n, d in enumerate(itertools.islice(delays(first_s, cap_s), limit), start=1):
        slept += d
        if slept >= wait_s:
            return n
    return limit


def failed_asks_array(wait_s: Any, first_s: float, cap_s: float, limit: int = 100_000) -> Any:
    """:func:`failed_asks` over an array of waits (same numbers, vectorised)."""
    w = np.asarray(wait_s, dtype=float)
    top = float(w.max(initial=0.0))
    if top <= 0:
        return np.zeros(w.shape, dtype=np.int64)
    n_steps = 1
    while first_s * 2 ** (n_steps - 1) < cap_s:
        n_steps += 1
    n = min(limit, n_steps + int(np.ceil(top / cap_s)) + 1)
    cum = np.cumsum(list(itertools.islice(delays(first_s, cap_s), n)))
    out = np.searchsorted(cum, w, side="left") + 1
    return np.where(w > 0, np.minimum(out, limit), 0).astype(np.int64)
