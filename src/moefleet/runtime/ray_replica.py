"""The replica side of the ``ray`` backend: one Ray Serve replica is one function instance.

The backend deploys :class:`FunctionReplica` once per function (``serve.deployment``); a
replica's process plays the part of the platform's container. Wire format, both ways: a
JSON header (``str``) and the body (``bytes``, a safetensors packet); Ray moves the pair
as it moves any ``str``/``bytes``, nothing of ours is pickled.

Request header: ``generation`` (the function's deploy version), ``function``,
``request_id``, ``memory_mb``, ``threads`` (torch threads), ``handler``
(``{factory, config}``), ``timeout_s``, ``init_timeout_s``, ``keep_alive_s``,
``max_inline_bytes``. Reply header: ``status`` — ``ok``; ``error`` (the handler raised:
``phase``, ``type``, ``message``, ``hint``); ``timeout`` (the handler ran past its timeout;
``actor`` names this replica so the caller can stop it); ``stopping`` (this replica is
about to be stopped and took no work); ``too_large`` (the response is over
``max_inline_bytes``, ``nbytes`` says by how much, the body is not sent) — plus the record
fields ``cold``, ``init_s``, ``start``, ``end`` (``time.time()``), ``puts``, ``gets``.

Invariants: the handler is built by ``HandlerRef.factory`` on the first request of a
generation (a cold start, timed into ``init_s``); a request of another generation (the
function was redeployed) or after ``keep_alive_s`` idle rebuilds it (cold again); a replica
that timed out takes no further work (its handler thread cannot be interrupted, so the
caller kills the process, as a platform stops the instance). Ray is imported lazily: this
module is imported by the backend before it decides how to start Ray.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import time
from typing import Any

_REAPER_PERIOD_S = 1.0  # how often an idle handler is checked against keep_alive_s
_SELF_STOP_S = 30.0  # a timed-out replica exits by itself if the caller never kills it


class FunctionReplica:
    """One function instance. Constructed by Serve when a replica starts (process start:
    not billed); the handler itself is built on the first request (the cold start)."""

    def __init__(self, store: dict[str, Any] | None, store_retries: int = 3) -> None:
        # Imported here, once per process, so that ``init_s`` measures instance
        # construction and weight loading only, as on the local backend (forkserver
        # preload): process start and ``import torch`` are the platform's business.
        import moefleet.runtime.handlers  # noqa: F401

        self._store_config = store
        self._store_retries = store_retries
        self._store: Any = None
        self._handler: Any = None
        self._generation: int | None = None
        self._keep_alive_s = 600.0
        self._last_used = time.monotonic()
        self._in_flight = 0
        self._stopping = False
        self._init_lock: asyncio.Lock | None = None
        self._reaper: asyncio.Task[None] | None = None  # held: the loop keeps weak refs

    # -- object store ------------------------------------------------------------------
    def _caller_store(self) -> tuple[Any, Any]:
        """A per-call (counting, retrying) view of this process's store client."""
        if self._store_config is None:
            return None, None
        from moefleet.runtime.stores import CountingStore, RetryingStore, build_store

        if self._store is None:  # one client per process, like a reused boto3 client
            self._store = build_store(self._store_config)
        counter = CountingStore(self._store)
        return RetryingStore(counter, attempts=self._store_retries), counter

    # -- the instance --------------------------------------------------------------------
    def _build(self, h: dict[str, Any]) -> tuple[Any, int, int]:
        """Run the handler factory (in a thread); returns (handler, puts, gets)."""
        import torch

        from moefleet.runtime.base import HandlerRef
        from moefleet.runtime.handlers import InitContext, make_handler

        torch.set_num_threads(int(h["threads"]))
        store, counter = self._caller_store()
        init = InitContext(h["function"], int(h["memory_mb"]), int(h["threads"]), store)
        handler = make_handler(HandlerRef(**h["handler"]), init)
        if counter is None:
            return handler, 0, 0
        st = counter.stats()
        return handler, st.puts + st.lists, st.gets

    def _unload(self) -> None:
        if self._handler is not None:
            self._handler = None
            self._generation = None
            gc.collect()  # drop the weights now, not at some later allocation

    def _expired(self, mine: int = 0) -> bool:
        """Idle past keep-alive; ``mine`` = in-flight calls that are the caller's own."""
        return (self._handler is not None and self._in_flight == mine
                and time.monotonic() - self._last_used > self._keep_alive_s)

    async def _reap(self) -> None:
        # Frees an idle instance's memory after keep_alive_s, as the platform would;
        # a request arriving later is a cold start either way (see ``_expired``).
        while True:
            await asyncio.sleep(min(_REAPER_PERIOD_S, self._keep_alive_s))
            if self._expired():
                self._unload()

    def _stop_soon(self) -> None:
        """Refuse work from now on; the caller kills this process by its actor name."""
        self._stopping = True
        self._handler = None
        asyncio.get_running_loop().call_later(_SELF_STOP_S, os._exit, 0)

    @staticmethod
    def _actor_name() -> str | None:
        import ray

        return ray.get_runtime_context().get_actor_name()

    async def __call__(self, header: str, body: bytes) -> tuple[str, bytes]:
        h: dict[str, Any] = json.loads(header)
        if self._stopping:
            return json.dumps({"status": "stopping"}), b""
        if self._init_lock is None:  # created on the replica's own event loop
            self._init_lock = asyncio.Lock()
            self._reaper = asyncio.get_running_loop().create_task(self._reap())
        reply: dict[str, Any] = {"status": "ok", "cold": False, "init_s": 0.0,
                                 "puts": 0, "gets": 0, "pid": os.getpid()}
        self._in_flight += 1
        try:
            async with self._init_lock:
                if self._expired(mine=1) or self._generation != h["generation"]:
                    self._unload()
                if self._handler is None:
                    t0 = time.time()
                    try:
                        handler, puts, gets = await asyncio.wait_for(
                            asyncio.to_thread(self._build, h), float(h["init_timeout_s"]))
                    except TimeoutError:
                        self._stop_soon()
                        return json.dumps({"status": "timeout", "phase": "init",
                                           "actor": self._actor_name()}), b""
                    except Exception as err:  # reported to the caller: not retried
                        return json.dumps(_error("init", err)), b""
                    self._handler, self._generation = handler, h["generation"]
                    reply.update(cold=True, init_s=time.time() - t0, puts=puts, gets=gets)
            self._keep_alive_s = float(h["keep_alive_s"])
            return await self._run(h, body, reply)
        finally:
            self._in_flight -= 1
            self._last_used = time.monotonic()

    async def _run(self, h: dict[str, Any], body: bytes,
                   reply: dict[str, Any]) -> tuple[str, bytes]:
        from moefleet.runtime.handlers import CallContext

        store, counter = self._caller_store()
        ctx = CallContext(h["function"], h.get("request_id"), store,
                          int(h["max_inline_bytes"]))
        handler = self._handler

        def call() -> tuple[float, float, bytes]:
            start = time.time()
            out = bytes(handler(body, ctx))
            return start, time.time(), out

        try:
            start, end, out = await asyncio.wait_for(asyncio.to_thread(call),
                                                     float(h["timeout_s"]))
        except TimeoutError:
            self._stop_soon()
            return json.dumps({"status": "timeout", "phase": "run",
                               "actor": self._actor_name()}), b""
        except Exception as err:
            return json.dumps(_error("run", err)), b""
        if counter is not None:
            st = counter.stats()
            reply["puts"] += st.puts + st.lists
            reply["gets"] += st.gets
        reply.update(start=start, end=max(start, end))
        if len(out) > int(h["max_inline_bytes"]):  # not worth shipping: the caller refuses it
            reply.update(status="too_large", nbytes=len(out))
            return json.dumps(reply), b""
        return json.dumps(reply), out


def _error(phase: str, err: Exception) -> dict[str, Any]:
    return {"status": "error", "phase": phase, "type": type(err).__name__,
            "message": getattr(err, "message", None) or str(err) or repr(err),
            "hint": getattr(err, "hint", "") or ""}
