"""Functions invoking functions: ``CallContext.functions`` on every backend.

A handler that calls other functions (Remoe's main function calling its remote expert
functions) does it through ``ctx.functions``, an *invoker*: ``invoke(name, payload,
request_id=None) -> InvokeResult`` and ``max_inline_bytes``, the same surface as a
``FunctionBackend``. The instance never holds the backend object; each backend gives its
instances a *channel* back to the host that owns the backend (the local worker's pipe, the
aws sandbox's socket, a Ray actor handle), and the host runs the nested call with
``backend.invoke``. So a nested call is admitted, retried, timed out and metered (one
record in ``backend.records()``) exactly like a top-level one.

This module holds the two ends every backend shares:

- :class:`ChannelFunctions` — the instance side: sends ``{"op": "nested", "nested": id,
  "name", "request_id"}`` + the payload through a ``send`` callable and waits for the
  reply that the channel's reader hands to :meth:`ChannelFunctions.deliver`; thread-safe,
  so a handler may run many nested calls at once (RemoteExperts does);
- :func:`serve_nested` — the host side: one nested request in, ``({"op": "nested_reply",
  "nested": id, "ok", "record" | error fields}, body)`` out.

Errors cross as (type name, message, hint, phase) and are raised again in the instance as
the same runtime error class, so a nested throttle is a ``ThrottledError`` in the handler.
Invariant: every nested request gets exactly one reply; a reply that never comes (the host
went away) fails the call after ``timeout_s``, never hangs it.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from moefleet.platform import InvocationRecord
from moefleet.runtime import errors as rt_errors
from moefleet.runtime.base import FunctionBackend, InvokeResult

Send = Callable[[dict[str, Any], bytes], None]


# The runtime errors a nested call may raise again on the caller's side, by class name.
_ERRORS: dict[str, type[rt_errors.FunctionError]] = {
    cls.__name__: cls for cls in (
        rt_errors.FunctionError, rt_errors.UnknownFunctionError,
        rt_errors.InvalidFunctionSpecError, rt_errors.PayloadTooLargeError,
        rt_errors.InvocationTimeoutError, rt_errors.FunctionCrashedError,
        rt_errors.ThrottledError, rt_errors.BackendClosedError, rt_errors.PayloadError,
        rt_errors.GatherError)}


def record_to_json(record: InvocationRecord) -> dict[str, Any]:
    return asdict(record)


def record_from_json(data: dict[str, Any]) -> InvocationRecord:
    return InvocationRecord(**data)


def error_fields(err: BaseException) -> dict[str, Any]:
    """What crosses the channel for a failed nested call."""
    return {"type": type(err).__name__,
            "message": getattr(err, "message", None) or str(err) or repr(err),
            "hint": getattr(err, "hint", "") or "",
            "phase": getattr(err, "phase", "run"),
            "remote_type": getattr(err, "remote_type", "")}


def raise_error(reply: dict[str, Any]) -> None:
    """Raise the runtime error a failed nested reply describes."""
    kind, message, hint = reply["type"], reply["message"], reply.get("hint", "")
    if kind == "HandlerError":
        raise rt_errors.HandlerError(message, hint, remote_type=reply.get("remote_type", ""),
                                     phase=reply.get("phase", "run"))
    cls = _ERRORS.get(kind)
    if cls is not None:
        raise cls(message, hint)
    raise rt_errors.FunctionError(f"nested call failed: {kind}: {message}", hint)


def serve_nested(backend: FunctionBackend, header: dict[str, Any],
                 body: bytes) -> tuple[dict[str, Any], bytes]:
    """Run one nested request on ``backend``; never raises (errors go in the reply)."""
    reply: dict[str, Any] = {"op": "nested_reply", "nested": header["nested"]}
    try:
        result = backend.invoke(str(header["name"]), body, request_id=header.get("request_id"))
    except Exception as err:  # reported to the calling instance, which raises it again
        reply.update(ok=False, **error_fields(err))
        return reply, b""
    reply.update(ok=True, record=record_to_json(result.record))
    return reply, result.payload


def serve_in_thread(backend: FunctionBackend, header: dict[str, Any], body: bytes,
                    answer: Send) -> None:
    """:func:`serve_nested` on its own thread, the reply sent with ``answer``; a failed
    send is dropped (the instance died, and its own call fails on its own)."""
    def run() -> None:
        reply, out = serve_nested(backend, header, body)
        with contextlib.suppress(OSError, ValueError):
            answer(reply, out)

    threading.Thread(target=run, daemon=True, name="moefleet-nested").start()


@dataclass
class _Pending:
    done: threading.Event = field(default_factory=threading.Event)
    reply: dict[str, Any] | None = None
    body: bytes = b""


class ChannelFunctions:
    """The invoker a handler sees as ``ctx.functions`` (instance side; see module doc).

    ``send(header, body)`` writes one request to the host and must be thread-safe (the
    channel is shared with the instance's own replies); the channel's reader calls
    :meth:`deliver` with each
    ``nested_reply``; :meth:`fail_all` ends every waiting call when the channel closes."""

    def __init__(self, send: Send, max_inline_bytes: int, *, timeout_s: float = 900.0) -> None:
        self._send = send
        self._max_inline = int(max_inline_bytes)
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._closed = False

    @property
    def max_inline_bytes(self) -> int:
        return self._max_inline

    def invoke(self, name: str, payload: bytes, *,
               request_id: str | None = None) -> InvokeResult:
        with self._lock:
            if self._closed:
                raise rt_errors.BackendClosedError(
                    f"nested call of {name}: the channel to the host is closed",
                    "the backend was torn down")
            nid = next(self._ids)
            pending = self._pending[nid] = _Pending()
        try:
            self._send({"op": "nested", "nested": nid, "name": name,
                        "request_id": request_id}, bytes(payload))
            if not pending.done.wait(self._timeout_s):
                raise rt_errors.InvocationTimeoutError(
                    f"nested call of {name} got no reply within {self._timeout_s:g} s",
                    "the host backend stopped answering; see its log")
        finally:
            with self._lock:
                self._pending.pop(nid, None)
        reply = pending.reply
        if reply is None:
            raise rt_errors.BackendClosedError(
                f"nested call of {name}: the channel to the host closed",
                "the backend was torn down while the call ran")
        if not reply["ok"]:
            raise_error(reply)
        return InvokeResult(pending.body, record_from_json(reply["record"]))

    def deliver(self, header: dict[str, Any], body: bytes) -> None:
        """Hand a ``nested_reply`` to its waiting call (unknown ids are dropped: the call
        already gave up)."""
        with self._lock:
            pending = self._pending.get(int(header["nested"]))
        if pending is not None:
            pending.reply, pending.body = header, body
            pending.done.set()

    def fail_all(self) -> None:
        """The channel closed: wake every waiting call (they raise BackendClosedError)."""
        with self._lock:
            self._closed = True
            waiting = list(self._pending.values())
        for pending in waiting:
            pending.done.set()
