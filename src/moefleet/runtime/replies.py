"""What every backend builds from a call's outcome: the errors of a timed-out, crashed or
failed call, and the invocation record of a reply (local workers' and Ray replicas'
reply header) or of an attempt that never replied (billed, ``failed=True``); and, on the
caller's side, :class:`AttributedCalls`: every record a caller's invocations produced,
failed attempts included, with the shares of the owners it made them for."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from moefleet.platform import InvocationRecord
from moefleet.runtime.base import FunctionSpec, Invoker, InvokeResult
from moefleet.runtime.errors import FunctionCrashedError, HandlerError, InvocationTimeoutError


def timeout_error(name: str, timeout_s: float) -> InvocationTimeoutError:
    """A call of ``name`` ran past ``timeout_s`` and its instance was stopped."""
    return InvocationTimeoutError(
        f"{name}: invocation ran past timeout_s={timeout_s:g} s; its instance was stopped",
        "raise timeout_s or send less work per call")


def crashed_error(name: str, attempts: int, process: str) -> FunctionCrashedError:
    """Every one of ``attempts`` calls of ``name`` lost its instance (``process`` died)."""
    return FunctionCrashedError(
        f"{name}: the instance crashed during {attempts} attempts ({process} died)",
        "check the handler for hard crashes (segfault, os._exit, out of memory)")


def reply_handler_error(name: str, reply: Mapping[str, Any]) -> HandlerError:
    """The :class:`HandlerError` of a failed reply (``phase``, ``type``, ``message``, ``hint``)."""
    return HandlerError(
        f"{name}: {reply['phase']} failed: {reply['type']}: {reply['message']}",
        reply.get("hint") or "see the handler's error above",
        remote_type=reply["type"], phase=reply["phase"])


def reply_record(spec: FunctionSpec, reply: Mapping[str, Any], *, request_id: str | None,
                 bytes_in: int, bytes_out: int) -> InvocationRecord:
    """The record of a successful call from its reply (``start``, ``end``, ``init_s``,
    ``cold``, ``puts``, ``gets``); ``end`` is clamped to be no earlier than ``start``."""
    return InvocationRecord(
        function=spec.name, kind=spec.kind, memory_mb=spec.memory_mb,
        start_s=reply["start"], end_s=max(reply["end"], reply["start"]),
        layer=spec.layer, expert=spec.expert, request_id=request_id, vcpus=spec.vcpus,
        gpu_share=spec.gpu_share, init_s=reply["init_s"], cold=reply["cold"], bytes_in=bytes_in,
        bytes_out=bytes_out, storage_puts=reply["puts"], storage_gets=reply["gets"])


_collecting = threading.local()


@contextlib.contextmanager
def failed_attempts() -> Iterator[list[InvocationRecord]]:
    """Collect the failed attempts billed while this thread invokes inside the block (a
    backend retries a crashed or timed-out attempt before it returns or raises): the
    caller attributes them to whoever the call was for, as the successful record."""
    stack: list[list[InvocationRecord]] = getattr(_collecting, "stack", [])
    _collecting.stack = stack
    mine: list[InvocationRecord] = []
    stack.append(mine)
    try:
        yield mine
    finally:
        stack.pop()


def failed_record(spec: FunctionSpec, start_s: float, end_s: float, request_id: str | None,
                  bytes_in: int) -> InvocationRecord:
    """The billed record of an attempt that crashed or timed out (``failed=True``); also
    handed to the innermost :func:`failed_attempts` block of this thread, if any."""
    record = InvocationRecord(
        function=spec.name, kind=spec.kind, memory_mb=spec.memory_mb, start_s=start_s,
        end_s=max(end_s, start_s), layer=spec.layer, expert=spec.expert,
        request_id=request_id, vcpus=spec.vcpus, gpu_share=spec.gpu_share, bytes_in=bytes_in,
        failed=True)
    stack = getattr(_collecting, "stack", None)
    if stack:
        stack[-1].append(record)
    return record


Attribution = tuple[InvocationRecord, dict[str, float]]  # a record, {owner: share}


class AttributedCalls:
    """The invocation records one caller (remote experts, the segment runner) produced,
    each with ``{owner: share of its tokens}``, kept until :meth:`drain`. Thread-safe.

    Invariant: every attempt a call cost is kept exactly once with the call's shares: the
    successful reply's record, and each failed attempt the backend retried (billed, as on
    a platform) whether the call then succeeded or gave up.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[Attribution] = []

    def invoke(self, invoker: Invoker, name: str, payload: bytes,
               shares: dict[str, float]) -> InvokeResult:
        """``invoker.invoke(name, payload)``, its records kept with ``shares``."""
        with failed_attempts() as failed:
            try:
                res = invoker.invoke(name, payload)
            finally:
                with self._lock:
                    self._records.extend((r, shares) for r in failed)
        with self._lock:
            self._records.append((res.record, shares))
        return res

    def drain(self) -> list[Attribution]:
        """Records since the last drain, each with its owners' shares."""
        with self._lock:
            out, self._records = self._records, []
        return out
