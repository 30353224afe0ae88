"""Fault injection: a reusable harness that wraps a function backend and an object store.

:class:`FaultyBackend` wraps any :class:`~moefleet.runtime.base.FunctionBackend` and, for a
seeded fraction ``rate`` of invocations, injects one fault of a :class:`FaultPlan`'s kind:

``crash``      the worker process the wrapped local backend dispatches the call to is
               SIGKILLed as the call is sent (its ``dispatch_hook``), so the attempt is
               certainly lost (real: the backend sees the lost call, bills the attempt,
               retries); other backends: a random worker after ``crash_after_s``;
``timeout``    the attempt is abandoned at the function's timeout (emulated: the wrapper
               raises ``InvocationTimeoutError`` after ``timeout_s`` and bills the full
               timeout, as Lambda bills a timed-out attempt);
``throttle``   the platform refuses the call with ``retry_after_s`` (emulated 429 /
               TooManyRequestsException: not run, not billed);
``straggler``  the call is delayed by ``straggle_s`` before it reaches the function
               (emulated slow start: added latency; the delay is outside the handler, so
               it is not billed — a real slow instance would also bill it);
``mixed``      each injected fault is one of the four above, drawn (seeded) per fault;
               the store then fails with 503 or a dropped connection, drawn per failure.

:class:`FaultyExperts` wraps an in-process ``ExpertFn`` (the engine's expert seam) and,
for a seeded fraction of expert calls, injects ``crash`` (the call raises
``FunctionCrashedError``, as a remote expert function whose instance died), ``timeout``
(sleeps ``timeout_s``, then raises ``InvocationTimeoutError``), ``throttle``
(``InjectedThrottle`` with retry-after), ``straggler`` (sleeps ``straggle_s``, then
answers), ``stall`` (sleeps ``stall_s``: a call that hangs far past any SLO) or
``error`` (a ``RuntimeError``: a handler bug, which no policy retries). All of them are
emulated: the experts run in process and the wrapper stands in for the remote call.

:func:`store_faults` wraps an :class:`~moefleet.platform.ObjectStore` in the one
:class:`~moefleet.runtime.stores.FaultyStore`: ``store-503`` raises
:class:`StoreUnavailableError` (S3 503 SlowDown) and ``store-drop`` a
``ConnectionResetError`` before the operation reaches the store, at rate ``rate``.
:class:`~moefleet.runtime.stores.RetryingStore` retries store operations under the
``store`` retry policy; a retried ``put`` writes the same bytes under the same key
(idempotent: never a second object).

Every retry above the backend goes through :func:`~moefleet.runtime.retry.retry_call`
with the backend's explicit :data:`~moefleet.runtime.retry.POLICIES` entry; a retried
expert call returns exactly one result to the executor, so nothing is gathered twice.
Everything marked "emulated" says so in the benchmark's JSON.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from dataclasses import dataclass

from moefleet.errors import MoefleetError
from moefleet.platform import InvocationRecord, ObjectStore
from moefleet.runtime.base import FunctionBackend, FunctionSpec, InvokeResult
from moefleet.runtime.errors import (
    InvocationTimeoutError,
    ThrottledError,
)
from moefleet.runtime.replies import failed_record
from moefleet.runtime.retry import POLICIES, RetryPolicy, retry_call
from moefleet.runtime.stores import (
    STORE_OPS,
    Dice,
    FaultyStore,
    StoreFailure,
)

BACKEND_FAULTS = ("crash", "timeout", "throttle", "straggler")
STORE_FAULTS = ("store-503", "store-drop")
EXPERT_FAULTS = ("crash", "timeout", "throttle", "straggler", "stall", "error")
FAULT_KINDS = BACKEND_FAULTS + STORE_FAULTS
MIXED = "mixed"  # every backend and store fault, drawn per injected fault
EMULATED = {"timeout", "throttle", "straggler", "stall", "error", MIXED}


class InjectedThrottle(ThrottledError):
    """A 429 / TooManyRequestsException carrying the platform's Retry-After."""

    def __init__(self, name: str, retry_after_s: float) -> None:
        super().__init__(f"{name}: throttled (429 TooManyRequests, injected)",
                         f"retry after {retry_after_s:g} s")
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class FaultPlan:
    """Which fault, how often (fraction of invocations / store operations), seeded."""

    kind: str
    rate: float
    seed: int = 0
    straggle_s: float = 0.2
    retry_after_s: float = 0.05
    timeout_s: float = 0.2
    crash_after_s: float = 0.005
    stall_s: float = 30.0

    def __post_init__(self) -> None:
        kinds = sorted({*FAULT_KINDS, *EXPERT_FAULTS, MIXED})
        if self.kind not in kinds and self.kind != "none":
            raise MoefleetError(f"unknown fault kind {self.kind!r}",
                                f"use one of: {', '.join(kinds)}")
        if not 0.0 <= self.rate <= 1.0:
            raise MoefleetError(f"fault rate must be in [0, 1], got {self.rate}")

    @property
    def hits_backend(self) -> bool:
        """Injected at the function backend (:class:`FaultyBackend`)."""
        return self.kind in BACKEND_FAULTS or self.kind == MIXED

    @property
    def hits_store(self) -> bool:
        """Injected at the object store (:func:`store_faults`)."""
        return self.kind in STORE_FAULTS or self.kind == MIXED


class FaultyBackend(FunctionBackend):
    """Wraps ``inner`` and injects backend faults; retries with ``policy`` above it."""

    def __init__(self, inner: FunctionBackend, plan: FaultPlan,
                 policy: RetryPolicy | None = None) -> None:
        self.inner, self.plan = inner, plan
        self.name = f"faulty-{inner.name}"
        self.platform = inner.platform
        self.policy = policy or POLICIES.get(inner.name, POLICIES["local"])
        self._dice = Dice(plan.rate if plan.hits_backend else 0.0, plan.seed)
        self._rng = random.Random(plan.seed + 1)
        self._pick = random.Random(plan.seed + 2)  # which fault, for "mixed"
        self._lock = threading.Lock()
        self._failed: list[InvocationRecord] = []
        self.retries = 0
        # crash on a backend with a dispatch hook (local): the hook kills the very worker
        # an armed attempt is dispatched to, so every injected crash loses that attempt.
        self._armed = threading.local()
        self._hooked = plan.kind in ("crash", MIXED) and hasattr(inner, "dispatch_hook")
        if self._hooked:
            inner.dispatch_hook = self._kill_dispatched  # type: ignore[attr-defined]

    @property
    def injected(self) -> int:
        return self._dice.injected

    # -- the contract, delegated -------------------------------------------------------
    def deploy(self, spec: FunctionSpec) -> FunctionSpec:
        return self.inner.deploy(spec)

    def scale(self, name: str, *, replicas: int | None = None,
              concurrency: int | None = None) -> FunctionSpec:
        return self.inner.scale(name, replicas=replicas, concurrency=concurrency)

    def records(self) -> list[InvocationRecord]:
        with self._lock:
            return self.inner.records() + list(self._failed)

    def failed_records(self) -> list[InvocationRecord]:
        """The attempts this wrapper billed itself (injected timeouts), not the inner's."""
        with self._lock:
            return list(self._failed)

    def teardown(self) -> None:
        self.inner.teardown()

    def functions(self) -> dict[str, FunctionSpec]:
        return self.inner.functions()

    @property
    def max_inline_bytes(self) -> int:
        return self.inner.max_inline_bytes

    # -- faults ------------------------------------------------------------------------
    def invoke(self, name: str, payload: bytes, *, request_id: str | None = None) -> InvokeResult:
        def failed(err: BaseException, attempt: int) -> None:
            with self._lock:
                self.retries += 1

        return retry_call(self.policy, lambda: self._attempt(name, payload, request_id),
                          on_failure=failed, rng=self._rng)

    def _attempt(self, name: str, payload: bytes, request_id: str | None) -> InvokeResult:
        if not self._dice.roll():
            return self.inner.invoke(name, payload, request_id=request_id)
        kind, spec = self.plan.kind, self.inner.spec(name)
        if kind == MIXED:
            with self._lock:
                kind = self._pick.choice(BACKEND_FAULTS)
        if kind == "throttle":
            raise InjectedThrottle(name, self.plan.retry_after_s)
        if kind == "timeout":
            start = time.time()
            time.sleep(self.plan.timeout_s)
            with self._lock:  # billed for the whole timeout, like a timed-out Lambda
                self._failed.append(failed_record(spec, start, start + spec.timeout_s,
                                                  request_id, len(payload)))
            raise InvocationTimeoutError(f"{name}: timed out (injected)", "retried")
        if kind == "straggler":
            time.sleep(self.plan.straggle_s)
            return self.inner.invoke(name, payload, request_id=request_id)
        # crash: SIGKILL the worker this call is dispatched to; the backend bills the lost
        # attempt and retries it. The hook fires once, on this thread's first dispatch.
        if self._hooked:
            self._armed.on = True
            try:
                return self.inner.invoke(name, payload, request_id=request_id)
            finally:
                self._armed.on = False
        # Backends without the hook: a random worker after crash_after_s (may miss).
        killer = threading.Timer(self.plan.crash_after_s, self._kill_a_worker)
        killer.start()
        try:
            return self.inner.invoke(name, payload, request_id=request_id)
        finally:
            killer.cancel()

    def _kill_dispatched(self, name: str, pid: int) -> None:
        if getattr(self._armed, "on", False):
            self._armed.on = False
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # a worker process of the wrapped backend

    def _kill_a_worker(self) -> None:
        pids: list[int] = getattr(self.inner, "worker_pids", lambda: [])()
        if pids:
            pid = self._rng.choice(pids)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def parse_fault(text: str) -> FaultPlan:
    """``KIND:RATE[:SEED[:SECONDS]]`` (e.g. ``crash:0.05``) -> a plan for
    :class:`FaultyExperts`; SECONDS sets how long a timeout, straggler or stall waits."""
    parts = text.split(":")
    if not 2 <= len(parts) <= 4 or parts[0] not in EXPERT_FAULTS:
        raise MoefleetError(f"bad fault spec {text!r}",
                            f"use KIND:RATE[:SEED[:SECONDS]] with KIND one of "
                            f"{', '.join(EXPERT_FAULTS)}, e.g. crash:0.05")
    try:
        rate = float(parts[1])
        seed = int(parts[2]) if len(parts) >= 3 else 0
        secs = float(parts[3]) if len(parts) == 4 else None
    except ValueError:
        raise MoefleetError(f"bad fault spec {text!r}: rate and seconds must be numbers, "
                            "seed an integer", "e.g. stall:0.01:1:5") from None
    if not 0.0 <= rate <= 1.0:  # also refuses nan
        raise MoefleetError(f"fault rate must be in [0, 1], got {parts[1]!r}", "e.g. 0.05")
    if secs is None:
        return FaultPlan(parts[0], rate, seed=seed)
    if not 0.0 <= secs <= 3600.0:
        raise MoefleetError(f"fault seconds must be in [0, 3600], got {parts[3]!r}", "e.g. 5")
    return FaultPlan(parts[0], rate, seed=seed, timeout_s=secs, straggle_s=secs, stall_s=secs)


def store_faults(inner: ObjectStore, plan: FaultPlan) -> FaultyStore:
    """``inner`` failing a seeded fraction ``plan.rate`` of every operation with the plan's
    store fault (none for a backend or expert fault kind)."""
    failure: StoreFailure = ("store-mixed" if plan.kind == MIXED else
                             "store-503" if plan.kind == "store-503" else "store-drop")
    rate = plan.rate if plan.hits_store else 0.0
    return FaultyStore(inner, STORE_OPS, rate=rate, seed=plan.seed + 7, failure=failure)
