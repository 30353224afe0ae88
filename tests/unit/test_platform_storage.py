"""LocalObjectStore specifics (atomicity, root confinement) and the open_store factory."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from moefleet.errors import MissingExtraError
from moefleet.platform import LocalObjectStore, StorageError, open_store


def test_keys_cannot_escape_the_root_even_through_symlinks(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    store = LocalObjectStore(tmp_path / "root")
    (store.root / "link").symlink_to(outside, target_is_directory=True)
    with pytest.raises(StorageError, match="outside the store root"):
        store.put("link/x", b"data")
    assert list(outside.iterdir()) == []
    with pytest.raises(StorageError):
        store.put("../outside/x", b"data")


def test_writes_leave_no_temp_files_and_tmp_dir_is_hidden(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "root")
    store.put("a/b", b"1")
    store.put_file("c", _file(tmp_path / "src", b"2"))
    assert store.list() == ["a/b", "c"]
    assert list((store.root / ".moefleet-tmp").iterdir()) == []
    with pytest.raises(StorageError, match="reserved"):
        store.put(".moefleet-tmp/x", b"")


def test_object_and_prefix_conflict_is_a_clear_error(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    store.put("a", b"1")
    with pytest.raises(StorageError, match="both an object and a prefix"):
        store.put("a/b", b"2")
    assert store.get("a") == b"1"


def test_delete_prunes_empty_directories(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    store.put("x/y/z", b"1")
    store.delete("x/y/z")
    assert not (tmp_path / "x").exists()
    store.put("x", b"now a file")  # the old prefix no longer blocks the key
    assert store.get("x") == b"now a file"


def test_concurrent_writers_never_expose_a_partial_object(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    size = 1 << 18
    store.put("k", b"\x00" * size)
    seen: list[bytes] = []

    def writer(v: int) -> None:
        for _ in range(5):
            store.put("k", bytes([v]) * size)

    def reader() -> None:
        for _ in range(20):
            seen.append(store.get("k"))

    threads = [threading.Thread(target=writer, args=(v,)) for v in (1, 2, 3)]
    threads.append(threading.Thread(target=reader))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Every read is one complete version: full length, a single repeated byte.
    assert all(len(b) == size and len(set(b)) == 1 for b in seen)


def test_open_store_local_forms(tmp_path: Path) -> None:
    a = open_store(tmp_path / "plain")
    b = open_store((tmp_path / "uri").as_uri())
    assert isinstance(a, LocalObjectStore) and a.root == (tmp_path / "plain").resolve()
    assert isinstance(b, LocalObjectStore) and b.root == (tmp_path / "uri").resolve()
    b.put("k", b"v")
    assert open_store(b.url).get("k") == b"v"


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("gs://bucket", "unsupported"),
        ("s3://", "without a bucket"),
        ("s3://b/p?endpint=http://x", "unknown S3 URL option"),
        ("file://host/path", "with a host"),
    ],
)
def test_open_store_bad_urls(url: str, words: str) -> None:
    with pytest.raises(StorageError, match=words):
        open_store(url)


def test_missing_boto3_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)  # makes `import boto3` raise ImportError
    with pytest.raises(MissingExtraError) as exc:
        open_store("s3://bucket/prefix")
    assert "boto3" in exc.value.message
    assert "moefleet[aws]" in exc.value.hint


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
