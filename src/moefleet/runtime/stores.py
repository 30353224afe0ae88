"""Object-store wrappers the runtime stacks around a real store.

    handler/executor -> RetryingStore -> CountingStore -> [LatencyStore] -> [FaultyStore] -> store

- :class:`CountingStore` counts one caller's requests (a function instance's invocation),
  so its PUT/GET counts go into that invocation's record (every attempt is a request);
- :class:`RetryingStore` retries transient failures (never a missing key) under a
  :class:`~moefleet.runtime.retry.RetryPolicy`, then re-raises naming the key: the one
  retrying store, in functions, callers and the fault experiments alike;
- :class:`LatencyStore` emulates a remote store on one machine: each request sleeps
  ``access_latency_s + bytes / bandwidth`` (the platform's storage numbers);
- :class:`FaultyStore` injects failures: the first N matching requests (tests) or a
  seeded fraction of them (the fault experiments; ``runtime.faults.store_faults``).

:func:`build_store` makes the stack from a JSON-able config, so worker processes (or remote
functions) can rebuild the same store from its URL.
"""

from __future__ import annotations

import builtins
import dataclasses
import importlib
import random
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

from moefleet.errors import MoefleetError
from moefleet.platform import ObjectStore, StorageError, open_store
from moefleet.runtime.retry import POLICIES, RetryPolicy, retry_call


class _Wrapper(ObjectStore):
    def __init__(self, inner: ObjectStore) -> None:
        super().__init__()
        self.inner = inner
        self.url = inner.url

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def list(self, prefix: str = "") -> builtins.list[str]:
        return self.inner.list(prefix)


class CountingStore(_Wrapper):
    """Counts requests made through this wrapper only (``stats()``), failed ones too."""

    def put(self, key: str, data: bytes) -> None:
        self._count(puts=1, bytes_written=len(data))
        self.inner.put(key, data)

    def get(self, key: str) -> bytes:
        self._count(gets=1)
        data = self.inner.get(key)
        self._count(bytes_read=len(data))
        return data

    def exists(self, key: str) -> bool:
        self._count(gets=1)
        return self.inner.exists(key)

    def delete(self, key: str) -> None:
        self._count(deletes=1)
        self.inner.delete(key)

    def list(self, prefix: str = "") -> builtins.list[str]:
        self._count(lists=1)
        return self.inner.list(prefix)


class RetryingStore(_Wrapper):
    """Retries transient failures of ``inner`` under ``policy`` (default: the ``store``
    entry of :data:`~moefleet.runtime.retry.POLICIES`: any ``StorageError`` but a missing
    object, dropped connections, timeouts; full-jitter backoff). ``attempts`` and
    ``backoff_s`` override the policy's attempts and base backoff (a function's store
    takes them from its config). Every operation is idempotent, so retrying is safe: a
    retried PUT writes the same bytes under the same key, never a second object.

    A ``StorageError`` still failing after every attempt is re-raised naming the
    operation, the key, the store and the count; ``retries`` counts failed attempts.
    """

    def __init__(self, inner: ObjectStore, attempts: int | None = None,
                 backoff_s: float | None = None, *, policy: RetryPolicy | None = None,
                 seed: int | None = None) -> None:
        super().__init__(inner)
        policy = policy or POLICIES["store"]
        if attempts is not None:
            if attempts < 1:
                raise StorageError(f"attempts must be >= 1, got {attempts}")
            policy = dataclasses.replace(policy, attempts=attempts)
        if backoff_s is not None:
            policy = dataclasses.replace(policy, base_s=backoff_s)
        self.policy = policy
        self._rng = random.Random(seed) if seed is not None else None
        self.retries = 0

    def _retry(self, what: str, key: str, fn: Callable[[], Any]) -> Any:
        failures = 0

        def failed(err: BaseException, attempt: int) -> None:
            nonlocal failures
            failures += 1
            self.retries += 1

        try:
            return retry_call(self.policy, fn, on_failure=failed, rng=self._rng)
        except StorageError as err:
            if failures < self.policy.attempts:
                raise  # not retried (a missing object): as it is
            raise StorageError(
                f"{what} {key!r} failed {failures} times on {self.url}: {err.message}",
                err.hint or "check the object store (space, permissions, network)",
            ) from err

    def put(self, key: str, data: bytes) -> None:
        self._retry("PUT", key, lambda: self.inner.put(key, data))

    def get(self, key: str) -> bytes:
        data: bytes = self._retry("GET", key, lambda: self.inner.get(key))
        return data

    def exists(self, key: str) -> bool:
        found: bool = self._retry("HEAD", key, lambda: self.inner.exists(key))
        return found

    def delete(self, key: str) -> None:
        self._retry("DELETE", key, lambda: self.inner.delete(key))

    def list(self, prefix: str = "") -> builtins.list[str]:
        keys: builtins.list[str] = self._retry("LIST", prefix, lambda: self.inner.list(prefix))
        return keys

    def stats(self) -> Any:
        return self.inner.stats()


class LatencyStore(_Wrapper):
    """Each request sleeps ``latency_s`` plus its bytes over ``bandwidth_bytes_per_s``
    (emulates S3 from a function on one machine; sleeping releases the GIL, so overlapped
    transfers in threads really overlap)."""

    def __init__(self, inner: ObjectStore, latency_s: float, bandwidth_bytes_per_s: float):
        super().__init__(inner)
        if latency_s < 0 or bandwidth_bytes_per_s <= 0:
            raise StorageError(
                f"latency_s must be >= 0 and bandwidth > 0, got {latency_s}, "
                f"{bandwidth_bytes_per_s}"
            )
        self.latency_s = latency_s
        self.bandwidth = bandwidth_bytes_per_s

    def _wait(self, nbytes: int) -> None:
        time.sleep(self.latency_s + nbytes / self.bandwidth)

    def put(self, key: str, data: bytes) -> None:
        self._wait(len(data))
        self.inner.put(key, data)

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        self._wait(len(data))
        return data

    def exists(self, key: str) -> bool:
        self._wait(0)
        return self.inner.exists(key)


class StoreUnavailableError(StorageError):
    """An object store refused a request for now (S3: 503 SlowDown)."""

    retry_after_s = 0.0


class Dice:
    """A seeded, thread-safe Bernoulli source (one draw per operation)."""

    def __init__(self, rate: float, seed: int) -> None:
        self.rate, self._rng, self._lock = rate, random.Random(seed), threading.Lock()
        self.injected = 0

    def roll(self) -> bool:
        with self._lock:
            hit = self._rng.random() < self.rate
            self.injected += int(hit)
            return hit


STORE_OPS = ("put", "get", "exists", "delete", "list")
StoreFailure = Literal["storage", "store-503", "store-drop", "store-mixed"]


class FaultyStore(_Wrapper):
    """Fails chosen requests before they reach ``inner`` (fault injection, any backend).

    A request is eligible when its operation is in ``ops`` and its key (a LIST's prefix)
    contains ``match``. Of the eligible ones, without ``rate``: the first ``fail_first``
    fail (per process; all of them when ``fail_first < 0``), deterministic for tests;
    with ``rate``: a seeded fraction ``rate`` fails (``Dice(rate, seed)``), as the fault
    experiments inject. What is raised is ``failure``: ``"storage"`` a ``StorageError``,
    ``"store-503"`` a :class:`StoreUnavailableError` (S3 503 SlowDown), ``"store-drop"``
    a ``ConnectionResetError``, ``"store-mixed"`` one of those two, seeded, each time.
    ``injected`` counts the failures raised.
    """

    def __init__(
        self, inner: ObjectStore, ops: tuple[str, ...] = ("get",), match: str = "",
        fail_first: int = 1, *, rate: float | None = None, seed: int = 0,
        failure: StoreFailure = "storage",
    ) -> None:
        super().__init__(inner)
        unknown = set(ops) - set(STORE_OPS)
        if unknown:
            raise StorageError(f"unknown store operations {sorted(unknown)}",
                               f"use some of: {', '.join(STORE_OPS)}")
        self.ops, self.match, self.fail_first = set(ops), match, fail_first
        self.failure = failure
        self._dice = Dice(rate, seed) if rate is not None else None
        self._pick = random.Random(seed + 1)  # which failure, for "store-mixed"
        self.failures = 0
        self._lock = threading.Lock()

    @property
    def injected(self) -> int:
        return self.failures

    def _maybe_fail(self, op: str, key: str) -> None:
        if op not in self.ops or self.match not in key:
            return
        if self._dice is not None:
            if not self._dice.roll():
                return
            with self._lock:
                self.failures += 1
        else:
            with self._lock:
                if 0 <= self.fail_first <= self.failures:
                    return
                self.failures += 1
        where = f"{op.upper()} {key}"
        failure = self.failure
        if failure == "store-mixed":
            with self._lock:
                failure = self._pick.choice(("store-503", "store-drop"))
        if failure == "store-503":
            raise StoreUnavailableError(f"{where}: 503 SlowDown (injected)")
        if failure == "store-drop":
            raise ConnectionResetError(f"{where}: connection reset (injected)")
        raise StorageError(f"injected {op.upper()} failure on {key!r}", "fault injection")

    def put(self, key: str, data: bytes) -> None:
        self._maybe_fail("put", key)
        self.inner.put(key, data)

    def get(self, key: str) -> bytes:
        self._maybe_fail("get", key)
        return self.inner.get(key)

    def exists(self, key: str) -> bool:
        self._maybe_fail("exists", key)
        return self.inner.exists(key)

    def delete(self, key: str) -> None:
        self._maybe_fail("delete", key)
        self.inner.delete(key)

    def list(self, prefix: str = "") -> builtins.list[str]:
        self._maybe_fail("list", prefix)
        return self.inner.list(prefix)

    def stats(self) -> Any:
        return self.inner.stats()


def faulty(inner: ObjectStore, **options: Any) -> ObjectStore:
    """Store-wrapper factory for ``build_store``'s ``wrap`` hook (fault tests)."""
    return FaultyStore(
        inner,
        ops=tuple(options.get("ops", ("get",))),
        match=str(options.get("match", "")),
        fail_first=int(options.get("fail_first", 1)),
    )


def import_callable(ref: str, error: type[MoefleetError] = StorageError) -> Callable[..., Any]:
    """``"package.module:attr"`` → the attribute; failures raise ``error`` naming ``ref``.

    Only moefleet's own modules may be named: a reference comes from a deployment file or
    a function's config, and importing an arbitrary module (or calling an arbitrary
    callable such as ``os:system``) from one would let that file run code."""
    module, _, attr = ref.partition(":")
    if module != "moefleet" and not module.startswith("moefleet."):
        raise error(f"cannot import {ref!r}: only moefleet's own modules may be named",
                    "e.g. moefleet.runtime.handlers:expert_handler")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise error(f"cannot import {ref!r}: {err}", "check the module:callable path") from None
    if not callable(obj):
        raise error(f"{ref!r} is not callable", "name a function or class")
    return obj


def build_store(config: dict[str, Any]) -> ObjectStore:
    """The raw store a function instance talks to, from a JSON-able config:
    ``{"url": ..., "latency_s": .., "bandwidth_bytes_per_s": .., "wrap": "mod:fn",
    "wrap_options": {...}}``. Counting and retrying are added per caller."""
    store: ObjectStore = open_store(config["url"])
    if config.get("wrap"):
        store = import_callable(config["wrap"])(store, **config.get("wrap_options", {}))
    if config.get("latency_s") is not None:
        store = LatencyStore(store, float(config["latency_s"]),
                             float(config["bandwidth_bytes_per_s"]))
    return store
