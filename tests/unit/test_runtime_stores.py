"""Store wrappers: counting, bounded retries, fault injection, emulated latency."""

from __future__ import annotations

from pathlib import Path

import pytest

from moefleet.platform import LocalObjectStore, ObjectNotFoundError, StorageError
from moefleet.runtime.stores import (
    CountingStore,
    FaultyStore,
    LatencyStore,
    RetryingStore,
    build_store,
)


def test_retry_recovers_from_transient_failures(tmp_path: Path) -> None:
    base = LocalObjectStore(tmp_path)
    base.put("a/b", b"hello")
    faulty = FaultyStore(base, ops=("get",), fail_first=2)
    counter = CountingStore(faulty)
    store = RetryingStore(counter, attempts=3, backoff_s=0.001)
    assert store.get("a/b") == b"hello"
    assert counter.stats().gets == 3  # two failed attempts are billed requests too


def test_retry_gives_up_with_the_key_in_the_message(tmp_path: Path) -> None:
    store = RetryingStore(FaultyStore(LocalObjectStore(tmp_path), ops=("put",), fail_first=-1),
                          attempts=2, backoff_s=0.001)
    with pytest.raises(StorageError, match="PUT 'k/x' failed 2 times"):
        store.put("k/x", b"1")


def test_missing_keys_are_not_retried(tmp_path: Path) -> None:
    counter = CountingStore(LocalObjectStore(tmp_path))
    with pytest.raises(ObjectNotFoundError):
        RetryingStore(counter, attempts=5, backoff_s=0.001).get("nope")
    assert counter.stats().gets == 1


def test_build_store_stacks_wrappers(tmp_path: Path) -> None:
    store = build_store({"url": str(tmp_path), "latency_s": 0.0,
                         "bandwidth_bytes_per_s": 1e12,
                         "wrap": "moefleet.runtime.stores:faulty",
                         "wrap_options": {"ops": ["get"], "match": "x", "fail_first": 1}})
    assert isinstance(store, LatencyStore) and isinstance(store.inner, FaultyStore)
    store.put("x/1", b"v")
    with pytest.raises(StorageError, match="injected GET"):
        store.get("x/1")
    assert store.get("x/1") == b"v"
    with pytest.raises(StorageError, match="cannot import"):
        build_store({"url": str(tmp_path), "wrap": "nowhere.at_all:thing"})
    with pytest.raises(StorageError):
        LatencyStore(LocalObjectStore(tmp_path), -1.0, 1.0)


def test_one_retrying_store_for_injected_503s_and_dropped_connections(tmp_path: Path) -> None:
    from moefleet.runtime.stores import StoreUnavailableError

    for failure in ("store-503", "store-drop"):
        inner = LocalObjectStore(tmp_path / failure)
        store = RetryingStore(FaultyStore(inner, ("put", "get"), fail_first=2,
                                          failure=failure), seed=0)  # type: ignore[arg-type]
        store.put("k", b"v")  # two injected failures, then through
        assert store.retries == 2 and inner.get("k") == b"v"
    # a 503 on every attempt: the policy's attempts, then the key and the count
    always = RetryingStore(FaultyStore(LocalObjectStore(tmp_path / "x"), ("get",),
                                       fail_first=-1, failure="store-503"),
                           attempts=3, backoff_s=0.0)
    with pytest.raises(StorageError, match="GET 'k' failed 3 times") as info:
        always.get("k")
    assert isinstance(info.value.__cause__, StoreUnavailableError)
