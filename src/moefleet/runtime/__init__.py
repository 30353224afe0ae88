"""Real execution: a model split into serverless functions, run on a backend.

- :mod:`~moefleet.runtime.base`: ``FunctionBackend`` (deploy / invoke / scale / records /
  teardown), ``FunctionSpec``, ``HandlerRef``, ``create_backend``;
- :mod:`~moefleet.runtime.local`: the ``local`` backend (worker processes, embedded default);
- :mod:`~moefleet.runtime.handlers`: segment, expert and diagnostic handlers;
- :mod:`~moefleet.runtime.segments`: the segment runner (non-experts in segment functions);
- :mod:`~moefleet.runtime.deploy`: plan → functions (+ weights in the object store);
- :mod:`~moefleet.runtime.lifecycle`: deploy -> use -> teardown as one context manager,
  under the composition root (``moefleet.compose.open_engine``).

Heavy modules (torch, transformers, multiprocessing pools) load only when used.
"""

from moefleet.runtime.base import (
    FunctionBackend,
    FunctionSpec,
    HandlerRef,
    InvokeResult,
    backend_names,
    create_backend,
    register_backend,
)
from moefleet.runtime.errors import (
    BackendClosedError,
    FunctionCrashedError,
    FunctionError,
    GatherError,
    HandlerError,
    InvalidFunctionSpecError,
    InvocationTimeoutError,
    PayloadError,
    PayloadTooLargeError,
    ThrottledError,
    UnknownFunctionError,
)

__all__ = [
    "BackendClosedError",
    "FunctionBackend",
    "FunctionCrashedError",
    "FunctionError",
    "FunctionSpec",
    "GatherError",
    "HandlerError",
    "HandlerRef",
    "InvalidFunctionSpecError",
    "InvocationTimeoutError",
    "InvokeResult",
    "PayloadError",
    "PayloadTooLargeError",
    "ThrottledError",
    "UnknownFunctionError",
    "backend_names",
    "create_backend",
    "register_backend",
]
