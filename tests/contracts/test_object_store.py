"""Contract for every ``ObjectStore``: local directory and S3 (moto's HTTP server on
127.0.0.1, started by the ``moto_endpoint`` fixture in tests/conftest.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from moefleet.platform import (
    LocalObjectStore,
    ObjectNotFoundError,
    ObjectStore,
    StorageError,
    StoreStats,
)

BAD_KEYS = ["", "/abs", "../x", "a/../b", "a//b", "a/./b", "a\\b", ".", "a/", "x\x00y", "k" * 1025]


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.integration)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "local":
        yield LocalObjectStore(tmp_path / "store")
        return
    endpoint = request.getfixturevalue("moto_endpoint")
    request.getfixturevalue("aws_credentials")
    from moefleet.platform import S3ObjectStore

    # A fresh bucket per test, and a key prefix, so tests never see each other's objects.
    bucket = f"contract-{uuid.uuid4().hex[:12]}"
    yield S3ObjectStore(bucket, prefix="run1", endpoint_url=endpoint, create_bucket=True)


def test_put_get_roundtrip_binary_and_empty(store: ObjectStore) -> None:
    payload = bytes(range(256)) * 4
    store.put("layer0/expert3.bin", payload)
    store.put("empty", b"")
    assert store.get("layer0/expert3.bin") == payload
    assert store.get("empty") == b""


def test_overwrite_replaces(store: ObjectStore) -> None:
    store.put("k", b"old")
    store.put("k", b"new value")
    assert store.get("k") == b"new value"


def test_missing_key(store: ObjectStore) -> None:
    with pytest.raises(ObjectNotFoundError) as exc:
        store.get("nope/missing")
    assert "nope/missing" in str(exc.value)
    assert isinstance(exc.value, KeyError)
    assert not store.exists("nope/missing")


def test_exists_and_delete(store: ObjectStore) -> None:
    store.put("a/b", b"1")
    assert store.exists("a/b")
    store.delete("a/b")
    assert not store.exists("a/b")
    store.delete("a/b")  # deleting a missing key is a no-op
    with pytest.raises(ObjectNotFoundError):
        store.get("a/b")


def test_list_is_a_sorted_string_prefix_match(store: ObjectStore) -> None:
    for key in ["b", "a/2", "ab", "a/1", "a/sub/3"]:
        store.put(key, key.encode())
    assert store.list() == ["a/1", "a/2", "a/sub/3", "ab", "b"]
    assert store.list("a") == ["a/1", "a/2", "a/sub/3", "ab"]
    assert store.list("a/") == ["a/1", "a/2", "a/sub/3"]
    assert store.list("a/s") == ["a/sub/3"]
    assert store.list("zzz") == []
    assert store.list("zzz/") == []


@pytest.mark.parametrize("key", BAD_KEYS)
def test_invalid_keys_are_rejected(store: ObjectStore, key: str) -> None:
    with pytest.raises(StorageError):
        store.put(key, b"x")
    with pytest.raises(StorageError):
        store.get(key)


def test_stats_count_requests_and_bytes(store: ObjectStore) -> None:
    store.reset_stats()
    before = store.stats()
    store.put("x", b"0123456789")
    store.put("y", b"abc")
    assert store.get("x") == b"0123456789"
    store.exists("y")
    store.list("")
    store.delete("y")
    used = store.stats() - before
    assert used == StoreStats(puts=2, gets=2, lists=1, deletes=1, bytes_written=13, bytes_read=10)
    store.reset_stats()
    assert store.stats() == StoreStats()


def test_put_file_get_file(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(b"weights" * 1000)
    store.put_file("w/expert.bin", src)
    dst = tmp_path / "out" / "dst.bin"
    store.get_file("w/expert.bin", dst)
    assert dst.read_bytes() == src.read_bytes()
    assert store.stats().bytes_written >= 7000
    assert store.url  # every store says where it lives


def test_get_file_of_missing_key_leaves_no_file(store: ObjectStore, tmp_path: Path) -> None:
    dst = tmp_path / "dl" / "missing.bin"
    with pytest.raises(ObjectNotFoundError):
        store.get_file("missing", dst)
    assert not dst.exists()
    assert not dst.parent.exists() or list(dst.parent.iterdir()) == []  # no temp file left
