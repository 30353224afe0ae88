"""The model zoo: named recipes that build a model once and cache it.

A :class:`ZooEntry` is a recipe (a JSON-able dict that fully determines the build), a
``build`` function that writes the model into a directory, and a ``load`` function.
Built models live in ``<cache>/models/<name>-<hash>`` where the hash covers the recipe
and the entry's ``code_version``, so changing either rebuilds instead of reusing stale
weights. A build writes into a temporary directory and renames it into place, so an
interrupted build never leaves a half-written model behind. ``build.json`` inside the
directory holds the build report (fidelity, timings ...) and a manifest of every file's
sha256; loading verifies the manifest and rebuilds an entry whose files were corrupted
or removed since the build.

Builds of one entry are serialised by a per-entry file lock (a second build waits and
is told who holds the lock, then reuses the finished build), and temporary directories
left by an interrupted build are removed by the next build of that entry.

Override the cache location with ``$MOEFLEET_CACHE_DIR``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moefleet.errors import UnknownNameError
from moefleet.io import atomic_dir, write_json_atomic
from moefleet.models.base import MoEModelAdapter
from moefleet.paths import cache_dir

# progress(done, total, description)
ProgressFn = Callable[[int, int, str], None]
# on_wait(message): another process holds the entry's build lock
WaitFn = Callable[[str], None]


@dataclass(frozen=True)
class ZooEntry:
    name: str
    description: str
    recipe: dict[str, Any]
    build: Callable[[Path, dict[str, Any], ProgressFn | None], dict[str, Any]]
    load: Callable[[Path, str], MoEModelAdapter]
    code_version: str = "1"
    tags: tuple[str, ...] = field(default_factory=tuple)

    def key(self) -> str:
        blob = json.dumps({"recipe": self.recipe, "code": self.code_version}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


_ENTRIES: dict[str, ZooEntry] = {}
_log = logging.getLogger(__name__)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _manifest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): _sha256(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "build.json"
    }


def register(entry: ZooEntry) -> None:
    if entry.name in _ENTRIES:
        raise ValueError(f"zoo entry {entry.name!r} is already registered")
    _ENTRIES[entry.name] = entry


def _ensure_registered() -> None:
    # Importing the entry modules registers them; kept lazy so `import moefleet` is cheap.
    from moefleet.models import zoo_entries  # noqa: F401


def names() -> list[str]:
    _ensure_registered()
    return sorted(_ENTRIES)


def has_entry(name: str) -> bool:
    _ensure_registered()
    return name in _ENTRIES


def get_entry(name: str) -> ZooEntry:
    _ensure_registered()
    if name not in _ENTRIES:
        raise UnknownNameError(
            f"unknown zoo model {name!r}", f"known models: {', '.join(sorted(_ENTRIES))}"
        )
    return _ENTRIES[name]


def model_dir(name: str) -> Path:
    entry = get_entry(name)
    return cache_dir() / "models" / f"{entry.name}-{entry.key()}"


def is_built(name: str) -> bool:
    return (model_dir(name) / "build.json").is_file()


def lock_path(name: str) -> Path:
    """The lock file that serialises builds of one entry (beside its directory)."""
    target = model_dir(name)
    return target.parent / f".{target.name}.lock"


@contextlib.contextmanager
def entry_lock(name: str, on_wait: WaitFn | None = None) -> Iterator[None]:
    """Hold the per-entry build lock (``fcntl.flock``; released by the kernel if the
    holder dies, so a killed build never blocks the next one). A second builder waits,
    and ``on_wait`` is told who holds the lock (pid, host, start time)."""
    path = lock_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            (on_wait or (lambda msg: _log.warning("%s", msg)))(
                f"{name} is being built by {holder}; waiting for it to finish")
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            fh.seek(0)
            fh.truncate()
            fh.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            fh.flush()
            yield
        finally:
            fh.seek(0)
            fh.truncate()
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _clean_stale(target: Path) -> list[Path]:
    """Remove temporary build directories of ``target`` left by interrupted builds.
    Only called under the entry lock: no live build owns one then."""
    stale = [p for p in target.parent.glob(f".{target.name}.*")
             if p.is_dir() and not p.name.endswith(".lock")]
    for p in stale:
        _log.warning("removing %s, left by an interrupted build", p)
        shutil.rmtree(p, ignore_errors=True)
    return stale


def build(name: str, *, force: bool = False, progress: ProgressFn | None = None,
          on_wait: WaitFn | None = None) -> Path:
    """Build ``name`` unless a finished build is cached; return its directory.

    Safe under concurrency: builds of one entry are serialised by :func:`entry_lock`; a
    builder that waited reuses the build the holder finished (unless ``force``)."""
    entry = get_entry(name)
    target = model_dir(name)
    if is_built(name) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with entry_lock(name, on_wait):
        if is_built(name) and not force:  # built by the process we waited for
            return target
        _clean_stale(target)
        with atomic_dir(target) as tmp:
            report = entry.build(tmp, dict(entry.recipe), progress)
            report = {"name": entry.name, "key": entry.key(), "recipe": entry.recipe, **report}
            report["manifest"] = _manifest(tmp)
            write_json_atomic(tmp / "build.json", report)
    return target


def build_report(name: str) -> dict[str, Any] | None:
    f = model_dir(name) / "build.json"
    return json.loads(f.read_text()) if f.is_file() else None


def verify(name: str) -> list[str]:
    """Files of a built entry that are missing or differ from the build's manifest."""
    report = build_report(name) or {}
    manifest: dict[str, str] = report.get("manifest", {})
    root = model_dir(name)
    return [rel for rel, digest in manifest.items()
            if not (root / rel).is_file() or _sha256(root / rel) != digest]


def load(name: str, *, progress: ProgressFn | None = None) -> MoEModelAdapter:
    entry = get_entry(name)
    if is_built(name):
        bad = verify(name)
        if bad:
            _log.warning("zoo entry %s is corrupted (%s); rebuilding", name, ", ".join(bad))
            build(name, force=True, progress=progress)
    return entry.load(build(name, progress=progress), entry.name)
