"""One call of a ray function, shared by the driver (``RayBackend``) and by replicas that
call other functions (``ctx.functions`` of a main function).

:func:`attempt` sends one request to a function's Serve application and turns the reply
into an :class:`InvokeResult` (or the runtime error); :class:`RayFunctions` is the invoker
a replica's handler gets: it reaches the other functions through their application
handles (``serve.get_app_handle``), with the retries, timeouts and payload limits of the
driver, from a table of the deployment's functions the driver puts in the request header
(``nested``: ``{"functions": {name: {app, generation, spec}}, "options": {...}}``, only for
functions of kind ``main``). The records of nested calls travel back in the main's reply
(``nested_records``) and the driver adds them to ``records()``: metered like top-level
calls.
"""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import asdict, dataclass
from typing import Any

from moefleet.platform import InvocationRecord
from moefleet.runtime.base import (
    FunctionSpec,
    InvokeResult,
    check_payload,
)
from moefleet.runtime.errors import FunctionError, UnknownFunctionError
from moefleet.runtime.replies import crashed_error, reply_handler_error, reply_record, timeout_error
from moefleet.runtime.retry import call_with_retries

SERVE_NAMESPACE = "serve"  # where Serve creates replica actors (named SERVE_REPLICA::...)


class Lost(Exception):
    """The replica died under an in-flight call (retryable)."""


class TimedOut(Exception):
    """The call ran past its timeout (its replica was stopped)."""


@dataclass(frozen=True)
class CallOptions:
    cores: int
    init_timeout_s: float
    admission_timeout_s: float
    max_inline_bytes: int
    limit: int
    max_retries: int = 2
    retry_backoff_s: float = 0.05


def kill_actor(actor: str | None) -> None:
    """Stop a timed-out replica (Serve replaces it: the next call is cold)."""
    import ray

    if not actor:
        return
    # ValueError: already gone (a timed-out replica also exits by itself, later).
    with contextlib.suppress(ValueError):
        ray.kill(ray.get_actor(actor, namespace=SERVE_NAMESPACE), no_restart=True)


def attempt(handle: Any, spec: FunctionSpec, generation: int, payload: bytes,
            request_id: str | None, opts: CallOptions, nested: dict[str, Any] | None = None,
            ) -> tuple[InvokeResult, list[InvocationRecord], int | None]:
    """One attempt; returns the result, the records of the nested calls it made and the
    replica's pid (None if it did not say). Raises :class:`Lost` (retry),
    :class:`TimedOut`, or the handler's error."""
    from ray import exceptions as rex

    header: dict[str, Any] = {
        "generation": generation, "function": spec.name, "request_id": request_id,
        "memory_mb": spec.memory_mb,
        "threads": max(1, min(opts.cores, round(spec.vcpus or 1.0))),
        "handler": {"factory": spec.handler.factory, "config": spec.handler.config},
        "timeout_s": spec.timeout_s, "init_timeout_s": opts.init_timeout_s,
        "keep_alive_s": spec.keep_alive_s, "max_inline_bytes": opts.max_inline_bytes}
    if nested is not None:
        header["nested"] = nested
    # The replica enforces the handler's timeout itself; this bound only guarantees
    # that no call waits forever (queueing, replica start, a lost reply).
    bound = spec.timeout_s + opts.init_timeout_s + opts.admission_timeout_s
    response = handle.remote(json.dumps(header), payload)
    try:
        raw, body = response.result(timeout_s=bound)
    except TimeoutError:  # GetTimeoutError is one
        response.cancel()
        raise TimedOut() from None
    except (rex.RayActorError, rex.ActorUnavailableError):
        raise Lost() from None
    except rex.RayError as err:
        raise FunctionError(f"{spec.name}: Ray Serve failed the call: {err}",
                            "see the Ray logs (/tmp/ray/session_latest/logs)") from err
    reply: dict[str, Any] = json.loads(raw)
    status = reply["status"]
    if status == "stopping":
        raise Lost()
    if status == "timeout":
        kill_actor(reply.get("actor"))
        raise TimedOut()
    nested_records = [InvocationRecord(**r) for r in reply.get("nested_records", [])]
    if status == "error":
        raise reply_handler_error(spec.name, reply)
    check_payload(spec.name, int(reply.get("nbytes", len(body))), opts.limit, "response")
    record = reply_record(spec, reply, request_id=request_id, bytes_in=len(payload),
                          bytes_out=len(body))
    pid = int(reply["pid"]) if "pid" in reply else None
    return InvokeResult(body, record), nested_records, pid


class RayFunctions:
    """``ctx.functions`` inside a ray replica (see the module docstring). Thread-safe."""

    def __init__(self, nested: dict[str, Any]) -> None:
        self._table: dict[str, dict[str, Any]] = dict(nested["functions"])
        self._opts = CallOptions(**nested["options"])
        self._handles: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.records: list[InvocationRecord] = []

    @property
    def max_inline_bytes(self) -> int:
        return self._opts.max_inline_bytes

    def _handle(self, app: str) -> Any:
        from ray import serve

        with self._lock:
            if app not in self._handles:
                self._handles[app] = serve.get_app_handle(app)
            return self._handles[app]

    def invoke(self, name: str, payload: bytes, *,
               request_id: str | None = None) -> InvokeResult:
        entry = self._table.get(name)
        if entry is None:
            raise UnknownFunctionError(
                f"no function named {name!r} is deployed on the ray backend",
                f"deployed: {', '.join(sorted(self._table)) or 'none'}")
        spec = FunctionSpec.from_dict(entry["spec"])
        check_payload(name, len(payload), self._opts.limit, "request")
        handle = self._handle(entry["app"])

        def once() -> InvokeResult:
            try:
                result, inner, _ = attempt(handle, spec, int(entry["generation"]), payload,
                                           request_id, self._opts)
            except TimedOut:
                raise timeout_error(name, spec.timeout_s) from None
            with self._lock:
                self.records.extend(inner)
                self.records.append(result.record)
            return result

        return call_with_retries(
            once, Lost, max_retries=self._opts.max_retries,
            backoff_s=self._opts.retry_backoff_s, on_retry=lambda: None,
            exhausted=lambda _: crashed_error(name, self._opts.max_retries + 1,
                                              "replica process"))

    def drain(self) -> list[dict[str, Any]]:
        with self._lock:
            out, self.records = self.records, []
        return [asdict(r) for r in out]
