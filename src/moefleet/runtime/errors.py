"""Errors raised by function backends, handlers and the executor.

All are :class:`~moefleet.errors.MoefleetError`: the message names the function (and the
bad value), the hint names the fix, so the CLI prints them without a traceback.
"""

from __future__ import annotations

from moefleet.errors import MoefleetError, UnknownNameError


class FunctionError(MoefleetError):
    """Base class: something went wrong deploying or invoking a function."""


class UnknownFunctionError(FunctionError, UnknownNameError):
    """``invoke``/``scale`` of a name that was never deployed."""


class InvalidFunctionSpecError(FunctionError):
    """A ``FunctionSpec`` the platform cannot run (memory, replicas, timeout ...)."""


class PayloadTooLargeError(FunctionError):
    """A request or response larger than the platform's synchronous payload limit."""


class InvocationTimeoutError(FunctionError):
    """The handler ran past the function's ``timeout_s`` (its instance was stopped)."""


class FunctionCrashedError(FunctionError):
    """The instance died mid-invocation more often than the retry limit allows."""


class ThrottledError(FunctionError):
    """No instance slot became free in time (replicas x concurrency all busy)."""


class BackendClosedError(FunctionError):
    """The backend was torn down (or is being torn down)."""


class HandlerError(FunctionError):
    """The handler raised. ``remote_type`` is the exception's class name; ``phase`` is
    ``"init"`` (cold start: loading weights) or ``"run"`` (the invocation itself)."""

    def __init__(self, message: str, hint: str = "", remote_type: str = "", phase: str = "run"):
        super().__init__(message, hint)
        self.remote_type = remote_type
        self.phase = phase


class PayloadError(FunctionError):
    """Bytes that are not a valid moefleet payload (safetensors + JSON metadata)."""


class GatherError(FunctionError):
    """A token's expert output was gathered zero times or more than once."""
