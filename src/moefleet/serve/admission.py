"""Admission control in front of the engine, decided before a request's body is read.

Why here and not after parsing: under overload most requests are turned away, and each
one turned away must cost the server almost nothing, or answering them takes the cores
the engine needs (goodput collapses). :class:`AdmissionGate` is an ASGI middleware that
looks only at the method, the path and the peer address, so a rejection reads no body,
parses no JSON and never reaches the engine thread.

Invariants:

- at most ``capacity`` generation requests (``/v1/completions``,
  ``/v1/chat/completions``) are in flight past the gate at any time; ``capacity`` is the
  engine's running slots plus the waiting queue;
- a request over capacity waits (parked, FIFO, without its body being read) for a slot
  that a finishing request hands over, for as long as the queue ahead is predicted to
  take to drain (``Retry-After``'s estimate), at least ``MIN_WAIT_S`` and at most
  ``wait_s``; then it gets 503 with ``Retry-After``. Every rejection is answered only
  after that wait, so a client that ignores ``Retry-After`` costs at most one rejection
  per wait per connection (the deeper the overload, the longer the wait, the fewer the
  rejections), and the work per rejection is bounded (no body read, one small reply);
- with ``per_client`` set, one peer address holds at most that many slots; more are 429;
- ``Retry-After`` is the time the queue ahead takes to drain at the completion rate
  measured over the last ``RATE_WINDOW_S`` seconds (1 s when nothing completed yet).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from moefleet.serve.errors import error_body

GATED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
RATE_WINDOW_S = 10.0
MAX_RETRY_AFTER_S = 60
DEFAULT_WAIT_S = 10.0
MIN_WAIT_S = 0.5
PARK_FACTOR = 8  # parked requests at most PARK_FACTOR x capacity (beyond: no slot chance)


def default_max_waiting(max_num_seqs: int, num_cache_blocks: int) -> int:
    """The waiting queue a server over this engine gets unless told otherwise: one
    batch's worth of the sequences the engine can hold at once (each running sequence
    holds at least one KV block). Enough to refill the batch as sequences finish; more
    would not raise throughput, only every admitted request's queueing delay."""
    return max(1, min(max_num_seqs, num_cache_blocks))


@dataclass
class Rejection:
    status: int  # 503 over capacity, 429 over the per-client cap
    message: str
    code: str
    retry_after_s: int


class Admission:
    """The gate's state. Runs on the event loop only (no locks needed)."""

    def __init__(self, running: int, max_waiting: int, *, per_client: int | None = None,
                 wait_s: float = DEFAULT_WAIT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if running < 1 or max_waiting < 0:
            raise ValueError(f"running slots must be >= 1 and max_waiting >= 0, got "
                             f"{running}, {max_waiting}")
        if per_client is not None and per_client < 1:
            raise ValueError(f"per_client must be >= 1, got {per_client}")
        if not 0 <= wait_s <= 600:
            raise ValueError(f"wait_s must be in [0, 600], got {wait_s}")
        self.running, self.max_waiting = running, max_waiting
        self.capacity = running + max_waiting
        self.per_client, self.wait_s, self.clock = per_client, wait_s, clock
        self.max_parked = PARK_FACTOR * self.capacity
        self.inflight = 0
        self.parked = 0
        self._queue: deque[asyncio.Future[None]] = deque()
        self._clients: dict[str, int] = {}
        self._done: deque[float] = deque(maxlen=4096)  # times slots were released

    # -- measurements --------------------------------------------------------------------
    def completion_rate(self) -> float | None:
        """Slots released per second over the last RATE_WINDOW_S seconds, or None."""
        now = self.clock()
        while self._done and now - self._done[0] > RATE_WINDOW_S:
            self._done.popleft()
        if len(self._done) < 2:
            return None
        span = max(now - self._done[0], 1e-3)
        return len(self._done) / span

    def drain_s(self) -> float | None:
        """Predicted seconds until the queue ahead of a newcomer has drained, or None
        while no completion rate has been measured."""
        ahead = self.parked + max(0, self.inflight - self.running) + 1
        rate = self.completion_rate()
        return None if rate is None else ahead / rate

    def retry_after(self) -> int:
        """Seconds until the queue ahead of a newcomer has drained, whole, in [1, 60]."""
        drain = self.drain_s()
        if drain is None:
            return 1
        return int(min(MAX_RETRY_AFTER_S, max(1, math.ceil(drain))))

    def park_s(self) -> float:
        """How long a request over capacity waits for a slot before its 503."""
        drain = self.drain_s()
        low = min(MIN_WAIT_S, self.wait_s)
        return self.wait_s if drain is None else min(self.wait_s, max(low, drain))

    # -- the gate -------------------------------------------------------------------------
    async def enter(self, client: str) -> Rejection | None:
        """Take a slot for ``client`` (None), or say why not after waiting for one."""
        if self.per_client is not None and self._clients.get(client, 0) >= self.per_client:
            await asyncio.sleep(self.wait_s)  # bounded: see the module's invariants
            return Rejection(429, f"too many requests in flight from {client} (limit "
                             f"{self.per_client} per client)", "too_many_requests",
                             self.retry_after())
        if self.inflight < self.capacity and not self.parked:
            self._take(client)
            return None
        if self.parked >= self.max_parked:
            await asyncio.sleep(self.wait_s)
            return self._overloaded()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        wait = self.park_s()
        self._queue.append(fut)
        self.parked += 1
        try:
            await asyncio.wait_for(asyncio.shield(fut), wait)
        except TimeoutError:
            pass
        except asyncio.CancelledError:  # server shutting down: never leak a handed slot
            if fut.done() and not fut.cancelled():
                self._pass_on()
            fut.cancel()
            raise
        finally:
            self.parked -= 1
        if fut.done() and not fut.cancelled():  # a leaving request handed its slot over
            self._clients[client] = self._clients.get(client, 0) + 1
            return None
        fut.cancel()  # leave() skips it from now on
        return self._overloaded()

    def leave(self, client: str) -> None:
        """Release ``client``'s slot: to the longest-parked request, else back to the pool."""
        self._done.append(self.clock())
        left = self._clients.get(client, 0) - 1
        if left > 0:
            self._clients[client] = left
        else:
            self._clients.pop(client, None)
        self._pass_on()

    def _pass_on(self) -> None:
        while self._queue:
            fut = self._queue.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes over: inflight stays the same
                return
        self.inflight -= 1

    def _take(self, client: str) -> None:
        self.inflight += 1
        self._clients[client] = self._clients.get(client, 0) + 1

    def _overloaded(self) -> Rejection:
        return Rejection(503, f"server overloaded: {self.inflight} requests in flight "
                         f"(limit {self.capacity}: {self.running} running + "
                         f"{self.max_waiting} waiting)", "overloaded", self.retry_after())


class AdmissionGate:
    """ASGI middleware: POSTs to the generation routes pass :class:`Admission` first."""

    def __init__(self, app: ASGIApp, admission: Admission,
                 on_reject: Callable[[Rejection], None] | None = None) -> None:
        self.app, self.admission, self.on_reject = app, admission, on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" \
                or scope["path"] not in GATED_PATHS:
            await self.app(scope, receive, send)
            return
        client = scope["client"][0] if scope.get("client") else "-"
        rejected = await self.admission.enter(client)
        if rejected is not None:
            if self.on_reject is not None:
                self.on_reject(rejected)
            resp = JSONResponse(error_body(rejected.status, rejected.message,
                                           code=rejected.code), status_code=rejected.status,
                                headers={"Retry-After": str(rejected.retry_after_s)})
            await resp(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.leave(client)
