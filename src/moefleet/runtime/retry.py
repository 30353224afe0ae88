"""Bounded retries with exponential backoff, shared by the function backends.

A backend retries an invocation whose instance was lost (crashed worker, dead replica,
throttled or crashed Lambda environment): up to ``max_retries`` more attempts, sleeping
``backoff_s`` x 1, 2, 4 ... between them, then it raises its own "gave up" error.
"""

from __future__ import annotations

import time
from collections.abc import Callable
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
