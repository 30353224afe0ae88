"""call_with_retries: attempts, backoff, hooks and the error after the last attempt."""

from __future__ import annotations

import pytest

from moefleet.runtime import retry
from moefleet.runtime.retry import call_with_retries


class _Lost(Exception):
    pass


def test_retries_with_backoff_then_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps: list[float] = []
    monkeypatch.setattr(retry.time, "sleep", sleeps.append)
    events: list[str] = []

    def attempt() -> int:
        events.append("attempt")
        raise _Lost("gone")

    with pytest.raises(RuntimeError, match="gave up after gone"):
        call_with_retries(attempt, _Lost, max_retries=2, backoff_s=0.5,
                          on_retry=lambda: events.append("retry"),
                          on_failure=lambda err: events.append(f"failed {err}"),
                          exhausted=lambda last: RuntimeError(f"gave up after {last}"))
    assert events == ["attempt", "failed gone", "retry"] * 2 + ["attempt", "failed gone"]
    assert sleeps == [0.5, 1.0]


def test_returns_the_first_success_and_lets_other_errors_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(retry.time, "sleep", lambda s: None)
    results = iter([_Lost(), 7])

    def attempt() -> int:
        r = next(results)
        if isinstance(r, Exception):
            raise r
        return r

    assert call_with_retries(attempt, _Lost, max_retries=3, backoff_s=0.1,
                             on_retry=lambda: None, exhausted=lambda _: RuntimeError()) == 7

    def broken() -> int:
        raise ValueError("not retried")

    with pytest.raises(ValueError, match="not retried"):
        call_with_retries(broken, _Lost, max_retries=3, backoff_s=0.1,
                          on_retry=lambda: None, exhausted=lambda _: RuntimeError())
