"""Object storage: a local directory (default) or S3 (boto3), behind one small interface.

Keys are ``/``-separated relative names (``"layer3/expert5.pt"``): non-empty segments, no
``.``/``..``, no backslash or NUL, at most 1024 bytes of UTF-8. The same rules apply to every
store, so a key that works locally also works on S3 and can never escape a local root.

Every store counts its requests and bytes (:class:`StoreStats`) so that a function handler
can report ``storage_puts``/``storage_gets`` to the billing meter. LIST requests are counted
apart (S3 prices them like PUTs); deletes are free on S3 and only counted.
"""

from __future__ import annotations

import builtins
import os
import shutil
import tempfile
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

from moefleet.platform.errors import ObjectNotFoundError, StorageError

MAX_KEY_BYTES = 1024  # S3's key length limit, applied everywhere
_TMP_DIR = ".moefleet-tmp"  # local stores write here first; reserved, never listed


@dataclass(frozen=True)
class StoreStats:
    """Requests and bytes since the store was created (or ``reset_stats``)."""

    puts: int = 0
    gets: int = 0
    lists: int = 0
    deletes: int = 0
    bytes_written: int = 0
    bytes_read: int = 0

    def __sub__(self, other: StoreStats) -> StoreStats:
        """Usage between two snapshots: ``after - before``."""
        return StoreStats(
            self.puts - other.puts,
            self.gets - other.gets,
            self.lists - other.lists,
            self.deletes - other.deletes,
            self.bytes_written - other.bytes_written,
            self.bytes_read - other.bytes_read,
        )


def validate_key(key: str) -> str:
    """Return ``key`` if it is a valid object key, else raise ``StorageError``."""
    if not isinstance(key, str) or not key:
        raise StorageError(f"object key must be a non-empty string, got {key!r}")
    if len(key.encode("utf-8")) > MAX_KEY_BYTES:
        raise StorageError(f"object key longer than {MAX_KEY_BYTES} bytes: {key[:40]!r}...")
    if "\\" in key or "\x00" in key:
        raise StorageError(f"object key {key!r} contains a backslash or NUL", "use '/' only")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise StorageError(
            f"object key {key!r} has an empty, '.' or '..' segment",
            "keys are relative names like 'layer0/expert3.pt' (no leading '/', no '..')",
        )
    if parts[0] == _TMP_DIR:
        raise StorageError(f"object key {key!r} uses the reserved prefix '{_TMP_DIR}/'")
    return key


class ObjectStore(ABC):
    """Bytes under string keys. ``get`` of a missing key raises ``ObjectNotFoundError``;
    ``delete`` of a missing key is a no-op; ``list`` returns sorted keys that start with
    ``prefix`` (a plain string prefix, as on S3)."""

    url: str  # where the store lives, in ``open_store`` syntax

    def __init__(self) -> None:
        self._stats = StoreStats()
        self._stats_lock = threading.Lock()

    # -- accounting ------------------------------------------------------------------------
    def stats(self) -> StoreStats:
        with self._stats_lock:
            return self._stats

    def reset_stats(self) -> None:
        with self._stats_lock:
            self._stats = StoreStats()

    def _count(self, **delta: int) -> None:
        with self._stats_lock:
            s = self._stats
            self._stats = replace(s, **{k: getattr(s, k) + v for k, v in delta.items()})

    # -- interface -------------------------------------------------------------------------
    @abstractmethod
    def put(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def get(self, key: str) -> bytes: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def list(self, prefix: str = "") -> builtins.list[str]: ...

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Upload a local file (default: read it whole; subclasses stream)."""
        self.put(key, Path(path).read_bytes())

    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Download to a local file, atomically (temp file + rename)."""
        data = self.get(key)
        _atomic_write(Path(path), data)


def _atomic_write(target: Path, data: bytes, tmp_dir: Path | None = None) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    where = tmp_dir or target.parent
    fd, tmp = tempfile.mkstemp(prefix=".obj-", suffix=".tmp", dir=where)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class LocalObjectStore(ObjectStore):
    """Objects as files under ``root_dir`` (created if missing). Writes are atomic: a
    temp file in ``root_dir/.moefleet-tmp`` (same filesystem) is renamed over the target,
    so a reader sees the old or the new object, never half of one."""

    def __init__(self, root_dir: str | os.PathLike[str]) -> None:
        super().__init__()
        self.root = Path(root_dir).expanduser().resolve()
        try:
            (self.root / _TMP_DIR).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StorageError(f"cannot create object store directory {self.root}: {err}") from None
        self.url = self.root.as_uri()

    def _path(self, key: str) -> Path:
        path = (self.root / validate_key(key)).resolve()
        # Defence in depth against symlinks inside the root pointing outside it.
        if not path.is_relative_to(self.root):
            raise StorageError(f"object key {key!r} resolves outside the store root")
        return path

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            _atomic_write(path, bytes(data), tmp_dir=self.root / _TMP_DIR)
        except (NotADirectoryError, IsADirectoryError, FileExistsError) as err:
            raise StorageError(
                f"cannot store {key!r}: a key is both an object and a prefix of another ({err})",
                "a local store cannot hold both 'a' and 'a/b'",
            ) from None
        self._count(puts=1, bytes_written=len(data))

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            self._count(gets=1)  # a failed GET is still a request
            raise ObjectNotFoundError(f"no object {key!r} in {self.url}") from None
        self._count(gets=1, bytes_read=len(data))
        return data

    def exists(self, key: str) -> bool:
        self._count(gets=1)  # HEAD is priced like GET on S3
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        path = self._path(key)
        self._count(deletes=1)
        try:
            path.unlink()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return
        # Prune now-empty parent directories so list() and prefix reuse stay clean.
        parent = path.parent
        while parent != self.root:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def list(self, prefix: str = "") -> builtins.list[str]:
        self._count(lists=1)
        # Walk only the directory the prefix pins down, then filter by the string prefix.
        base_rel = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = self.root / base_rel if base_rel else self.root
        if base_rel:
            validate_key(base_rel)
        if not base.is_dir():
            return []
        keys: builtins.list[str] = []
        for dirpath, dirnames, filenames in os.walk(base):
            if Path(dirpath) == self.root and _TMP_DIR in dirnames:
                dirnames.remove(_TMP_DIR)
            rel_dir = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                key = name if rel_dir == "." else f"{rel_dir}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".obj-", suffix=".tmp", dir=self.root / _TMP_DIR)
        os.close(fd)
        try:
            shutil.copyfile(path, tmp)  # streams; no whole-file read into memory
            os.replace(tmp, target)
        finally:
            Path(tmp).unlink(missing_ok=True)
        self._count(puts=1, bytes_written=target.stat().st_size)

    def __repr__(self) -> str:
        return f"LocalObjectStore({str(self.root)!r})"


def open_store(url: str | os.PathLike[str]) -> ObjectStore:
    """A store from a URL: a path or ``file:///path`` → local directory;
    ``s3://bucket[/prefix][?endpoint=http://127.0.0.1:9000&region=us-east-1&create=1]`` → S3.
    """
    text = os.fspath(url)
    parsed = urlparse(text)
    if parsed.scheme in ("", "file") or (len(parsed.scheme) == 1 and os.name == "nt"):
        path = unquote(parsed.path) if parsed.scheme == "file" else text
        if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
            raise StorageError(
                f"file URL with a host is not supported: {text}", "use file:///abs/path"
            )
        return LocalObjectStore(path)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise StorageError(f"S3 URL without a bucket: {text}", "use s3://bucket/prefix")
        query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        unknown = set(query) - {"endpoint", "region", "create"}
        if unknown:
            raise StorageError(
                f"unknown S3 URL option(s) {sorted(unknown)} in {text}",
                "allowed: endpoint, region, create",
            )
        from moefleet.platform.s3 import S3ObjectStore  # lazy: keeps boto3 optional

        return S3ObjectStore(
            parsed.netloc,
            prefix=parsed.path.strip("/"),
            endpoint_url=query.get("endpoint"),
            region=query.get("region", "us-east-1"),
            create_bucket=query.get("create", "0").lower() in ("1", "true", "yes"),
        )
    raise StorageError(
        f"unsupported object store URL {text!r}", "use a path, file:///path or s3://bucket"
    )
