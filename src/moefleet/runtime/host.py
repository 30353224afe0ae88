"""The function-instance host: what every backend runs inside one function instance.

A backend's instance (a local worker slot, a Ray Serve replica, a Lambda execution
environment) holds one :class:`Instance`. ``start()`` is the cold start: the handler
factory ``factory(config, InitContext) -> handler`` is imported and called once, timed
(``init_s``), with the object-store requests it made counted (billed to the cold call).
``call(body, ...)`` is one invocation: the handler runs as ``handler(body, CallContext)``
with the instance's thread budget, timed on the ``time.time()`` clock (``start``/``end``;
``end`` is taken even when the handler raises, since a failed call is billed too) and its
store requests counted. The backends keep only what is theirs: transport, admission,
timeouts, memory emulation (local), keep-alive.

Invariants: the factory runs at most once per ``Instance`` (a second ``start`` is a
no-op); an error is raised as :class:`HostError` with the phase it happened in
(``init``: the cold start, ``run``: the call) and the handler's own exception as its cause;
:func:`error_reply` turns it into the fields every backend's wire format carries
(``phase``, ``type``, ``message``, ``hint``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moefleet.platform import ObjectStore
from moefleet.runtime.base import HandlerRef, Invoker
from moefleet.runtime.errors import FunctionError
from moefleet.runtime.stores import import_callable

# A per-caller view of the instance's store and the counter behind it (None, None: none).
StoreView = Callable[[], tuple[ObjectStore | None, Any]]


@dataclass
class InitContext:
    """Cold-start context: the instance's function, memory and thread budget, and a store
    (requests made here are billed to the cold invocation)."""

    function: str
    memory_mb: int
    threads: int
    store: ObjectStore | None


@dataclass
class CallContext:
    """Per-invocation context; ``max_inline_bytes`` is the platform's payload limit;
    ``functions`` invokes other functions of the same backend (metered like top-level
    calls, see :mod:`moefleet.runtime.nested`); None where the host offers no channel."""

    function: str
    request_id: str | None
    store: ObjectStore | None
    max_inline_bytes: int
    functions: Invoker | None = None


Handler = Callable[[bytes, CallContext], bytes]


def make_handler(ref: HandlerRef, init: InitContext) -> Handler:
    """Import and call the factory named by ``ref``."""
    factory = import_callable(ref.factory, FunctionError)
    handler: Handler = factory(dict(ref.config), init)
    return handler


class HostError(Exception):
    """The handler failed in ``phase`` (``init`` or ``run``); the cause is its error."""

    def __init__(self, phase: str, err: BaseException) -> None:
        super().__init__(f"{phase}: {err!r}")
        self.phase, self.error = phase, err


def error_reply(phase: str, err: BaseException) -> dict[str, Any]:
    """The wire fields of a failed call (every backend sends these)."""
    return {"phase": phase, "type": type(err).__name__,
            "message": getattr(err, "message", None) or str(err) or repr(err),
            "hint": getattr(err, "hint", "") or ""}


def _requests(counter: Any) -> tuple[int, int]:
    if counter is None:
        return 0, 0
    st = counter.stats()
    return st.puts + st.lists, st.gets


@dataclass(frozen=True)
class ColdStart:
    init_s: float
    puts: int
    gets: int


@dataclass(frozen=True)
class CallResult:
    out: bytes
    start: float
    end: float
    puts: int
    gets: int


class Instance:
    """One function instance (see the module docstring). Not thread-safe for ``start``;
    ``call`` may run concurrently when the backend allows concurrency > 1."""

    def __init__(self, function: str, memory_mb: int, threads: int, ref: HandlerRef,
                 store: StoreView, max_inline_bytes: int, emulated_host_mb: float = 0.0
                 ) -> None:
        self.function, self.memory_mb, self.threads = function, memory_mb, max(1, threads)
        self.emulated_host_mb = emulated_host_mb  # declared by the backend (GPU share)
        self.ref, self._store, self.max_inline_bytes = ref, store, max_inline_bytes
        self.handler: Handler | None = None
        self.last_end = 0.0

    @property
    def loaded(self) -> bool:
        return self.handler is not None

    def _threads(self) -> None:
        import torch

        torch.set_num_threads(self.threads)

    def start(self) -> ColdStart:
        """Build the handler (the cold start); a no-op returning zeros when loaded."""
        if self.handler is not None:
            return ColdStart(0.0, 0, 0)
        t0 = time.time()
        try:
            self._threads()
            store, counter = self._store()
            self.handler = make_handler(
                self.ref, InitContext(self.function, self.memory_mb, self.threads, store))
        except Exception as err:
            raise HostError("init", err) from err
        puts, gets = _requests(counter)
        return ColdStart(time.time() - t0, puts, gets)

    @property
    def emulated_bytes(self) -> int:
        """Host memory the platform's instance would hold and this one does not: an
        emulated device's runtime (CUDA on a CPU-only machine), declared by the backend
        (a function's GPU share, ``emulated_host_mb``) or by a handler that chose its
        device itself (``emulated_host_bytes``, Remoe's main). One device per instance, so
        the larger declaration counts. The memory limit charges it, so a function that
        would not start on the platform fails here too."""
        declared = int(getattr(self.handler, "emulated_host_bytes", 0) or 0)
        return max(declared, int(self.emulated_host_mb * 2**20))

    def call(self, body: bytes, request_id: str | None,
             functions: Invoker | None = None) -> CallResult:
        """One invocation of the (started) handler."""
        if self.handler is None:
            raise HostError("run", FunctionError(f"{self.function}: not started",
                                                 "start() the instance first"))
        self._threads()
        store, counter = self._store()
        ctx = CallContext(self.function, request_id, store, self.max_inline_bytes, functions)
        start = time.time()
        try:
            out = bytes(self.handler(body, ctx))
        except Exception as err:
            raise HostError("run", err) from err
        finally:
            self.last_end = time.time()  # a failed call lasted too (billing)
        puts, gets = _requests(counter)
        return CallResult(out, start, self.last_end, puts, gets)
