"""Bounded retries with exponential backoff, shared by the function backends.

A backend retries an invocation whose instance was lost (crashed worker, dead replica,
throttled or crashed Lambda environment): up to ``max_retries`` more attempts, sleeping
``backoff_s`` x 1, 2, 4 ... between them, then it raises its own "gave up" error.

:class:`RetryPolicy` states a policy explicitly (attempts, backoff with full jitter, a
cap, which error types retry, and a server's ``retry_after_s`` honoured as a floor);
:data:`POLICIES` holds each backend's and the object stores'.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
E = TypeVar("E", bound=Exception)


def call_with_retries(
    attempt: Callable[[], T],
    retryable: type[E],
    *,
    max_retries: int,
    backoff_s: float,
    on_retry: Callable[[], None],
    exhausted: Callable[[E | None], Exception],
    on_failure: Callable[[E], None] | None = None,
) -> T:
    """``attempt()``'s result, calling it again while it raises ``retryable``.

    After each retryable failure ``on_failure(err)`` runs (it may raise instead, e.g.
    when the backend was closed meanwhile); then, if attempts are left, ``on_retry()``
    (count the retry) and the backoff sleep. After ``max_retries + 1`` failed attempts
    the error ``exhausted(last)`` is raised (``last`` is None only if no attempt ran).
    Any other exception from ``attempt`` propagates at once.
    """
    last: E | None = None
    for i in range(max_retries + 1):
        try:
            return attempt()
        except retryable as err:
            last = err
            if on_failure is not None:
                on_failure(err)
            if i == max_retries:
                break
            on_retry()
            time.sleep(backoff_s * 2**i)
    raise exhausted(last)


@dataclass(frozen=True)
class RetryPolicy:
    """How one layer retries transient failures.

    Attempt ``i`` (0-based) that fails with a retryable error is followed by a sleep drawn
    uniformly from ``[0, min(cap_s, base_s * 2**i)]`` ("full jitter": concurrent retriers
    spread out instead of retrying in lockstep), but never less than the error's
    ``retry_after_s`` when it carries one (a throttling platform's Retry-After). After
    ``attempts`` failed attempts the last error is raised. Only errors whose class name
    is in ``retry_on`` (or a subclass of one), and neither in ``never`` nor a subclass of
    one there, are retried; anything else propagates at once — a handler bug is not
    retried, it would fail the same way again, nor is a missing object.
    """

    attempts: int = 4
    base_s: float = 0.02
    cap_s: float = 1.0
    retry_on: tuple[str, ...] = ("FunctionCrashedError", "InvocationTimeoutError",
                                 "ThrottledError", "StoreUnavailableError",
                                 "ConnectionError", "TimeoutError")
    never: tuple[str, ...] = ()

    def retryable(self, err: BaseException) -> bool:
        names = [c.__name__ for c in type(err).__mro__]
        return (any(n in self.retry_on for n in names)
                and not any(n in self.never for n in names))

    def delay_s(self, attempt: int, err: BaseException, rng: random.Random) -> float:
        backoff = rng.uniform(0.0, min(self.cap_s, self.base_s * 2**attempt))
        return max(backoff, float(getattr(err, "retry_after_s", 0.0) or 0.0))

    def to_dict(self) -> dict[str, object]:
        return {"attempts": self.attempts, "base_s": self.base_s, "cap_s": self.cap_s,
                "jitter": "full", "retry_on": list(self.retry_on), "never": list(self.never)}


#: Explicit policies. Function backends retry a lost instance inside ``invoke``
#: (``max_retries`` = attempts - 1 there); the harness-level policy below also retries
#: throttling (honouring retry-after) and timeouts; stores retry any storage failure but
#: a missing object (503 SlowDown included) and dropped connections. Object writes are
#: idempotent (same key, same bytes).
POLICIES: dict[str, RetryPolicy] = {
    "local": RetryPolicy(attempts=4, base_s=0.02, cap_s=0.5),
    "ray": RetryPolicy(attempts=4, base_s=0.05, cap_s=1.0),
    "aws": RetryPolicy(attempts=5, base_s=0.1, cap_s=2.0),
    # The engine retries one expert call (a pure function: idempotent), briefly: every
    # request of the step waits on it.
    "engine": RetryPolicy(attempts=4, base_s=0.01, cap_s=0.2),
    # Every object store wrapper (``runtime.stores.RetryingStore``): any storage failure
    # but a missing object, a dropped connection, a timeout.
    "store": RetryPolicy(attempts=5, base_s=0.01, cap_s=0.5,
                         retry_on=("StorageError", "ConnectionError", "TimeoutError"),
                         never=("ObjectNotFoundError",)),
}

_rng_lock = threading.Lock()
_rng = random.Random(0)


def retry_call(policy: RetryPolicy, attempt: Callable[[], T],
               on_failure: Callable[[BaseException, int], None] | None = None,
               rng: random.Random | None = None) -> T:
    """``attempt()`` under ``policy``; ``on_failure(err, i)`` sees every failed attempt
    (e.g. to bill it or count it) before the backoff sleep."""
    for i in range(policy.attempts):
        try:
            return attempt()
        except Exception as err:
            if not policy.retryable(err):
                raise
            if on_failure is not None:
                on_failure(err, i)
            if i == policy.attempts - 1:
                raise
            if rng is None:
                with _rng_lock:
                    delay = policy.delay_s(i, err, _rng)
            else:
                delay = policy.delay_s(i, err, rng)
            time.sleep(delay)
    raise AssertionError("unreachable: attempts >= 1")
