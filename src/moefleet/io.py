"""File boundaries: atomic writes, output paths checked before work, safe text reads.

Writes go to a temporary file in the destination directory, are flushed and fsynced,
then ``os.replace``-d over the target (atomic on POSIX within one filesystem). On any
exception the temporary file is removed and the target is left untouched. Files get the
mode a plain ``open()`` would give them (``0o666`` minus the umask), not ``mkstemp``'s 0600.

Every command checks all of its output paths with :func:`check_output_paths` *before* it
starts work, so a bad ``--png`` never leaves a half-done set of outputs behind; every
problem here is an :class:`~moefleet.errors.OutputPathError` or
:class:`~moefleet.errors.DataError` naming the path, never a raw ``OSError``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moefleet.errors import DataError, OutputPathError

#: Largest text/YAML/JSON input file read whole (plans, platforms, profiles, CSVs).
MAX_TEXT_INPUT_BYTES = 256 * 1024 * 1024


def _umask() -> int:
    # os.umask can only be read by setting it; restore at once.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_output_path(target: str | os.PathLike[str] | None, what: str = "output") -> None:
    """Raise ``OutputPathError`` unless ``target`` can be written as a regular file.

    Checks: not an existing directory; the nearest existing parent is a writable
    directory (we create missing parents later). Creates nothing."""
    if target is None:
        return
    p = Path(os.fspath(target)).expanduser()
    if os.fspath(target) == "":
        raise OutputPathError(f"{what}: empty path", "name a file, e.g. -o out.json")
    if p.is_dir():
        raise OutputPathError(f"{what} {p} is a directory", f"name a file, e.g. {p / 'out'}")
    if p.exists() and not os.access(p, os.W_OK):
        raise OutputPathError(f"{what} {p} is not writable", "choose another path")
    parent = p.parent if str(p.parent) else Path(".")
    while not parent.exists():
        if parent == parent.parent:
            break
        parent = parent.parent
    if not parent.is_dir():
        raise OutputPathError(
            f"{what} {p}: {parent} is not a directory", "choose a path inside a directory")
    if not os.access(parent, os.W_OK | os.X_OK) or _is_pseudo_fs(parent):
        raise OutputPathError(
            f"{what} {p}: cannot write into {parent} (permission denied)",
            "choose a directory you can write to")


def check_output_dir(target: str | os.PathLike[str] | None, what: str = "output folder") -> None:
    """Like :func:`check_output_path` for a directory that is created (or reused)."""
    if target is None:
        return
    p = Path(os.fspath(target)).expanduser()
    if p.exists() and not p.is_dir():
        raise OutputPathError(f"{what} {p} exists and is not a directory",
                              "name a new or existing folder")
    probe = p
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK) or _is_pseudo_fs(probe):
        raise OutputPathError(f"{what} {p}: cannot create or write into it",
                              "choose a folder you can write to")


def check_output_paths(*targets: tuple[str, str | os.PathLike[str] | None]) -> None:
    """Check every ``(what, path)`` pair, and that no two outputs are the same file."""
    seen: dict[str, str] = {}
    for what, t in targets:
        check_output_path(t, what)
        if t is not None:
            key = os.path.abspath(os.fspath(t))
            if key in seen:
                raise OutputPathError(f"{what} and {seen[key]} are the same file {t}",
                                      "give each output its own path")
            seen[key] = what


def _is_pseudo_fs(path: Path) -> bool:
    # /proc and /sys accept access() checks as root but refuse new files.
    resolved = str(path.resolve())
    return any(resolved == r or resolved.startswith(r + "/") for r in ("/proc", "/sys"))


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``target``; rename it over ``target`` on success."""
    target = Path(target)
    check_output_path(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as err:
        raise OutputPathError(f"cannot write {target}: {err.strerror}",
                              "choose a path you can write to") from None
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp_path, 0o666 & ~_umask())
        try:
            os.replace(tmp_path, target)
        except OSError as err:
            raise OutputPathError(f"cannot write {target}: {err.strerror}",
                                  "choose another path") from None
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


@contextlib.contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield a fresh hidden directory next to ``target`` (prefix ``.<name>.``); when the
    block succeeds it replaces ``target`` (rename), and it is always removed otherwise,
    so a reader sees the old entry or the whole new one, never a half-written one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_text_atomic(target: str | os.PathLike[str], text: str) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(text, encoding="utf-8")


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by ``None`` (RFC 8259 has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def dumps_json(obj: Any) -> str:
    """Strict JSON text (NaN/inf become null), sorted keys, indented."""
    return json.dumps(json_safe(obj), indent=2, sort_keys=True, allow_nan=False, default=str)


def write_json_atomic(target: str | os.PathLike[str], obj: Any) -> None:
    write_text_atomic(target, dumps_json(obj) + "\n")


def check_input_file(path: str | os.PathLike[str], what: str, hint: str = "") -> Path:
    """``path`` as a Path if it is an existing, readable regular file; else ``DataError``."""
    p = Path(os.fspath(path)).expanduser()
    if not p.exists():
        raise DataError(f"{what} {p} does not exist", hint)
    if not p.is_file():
        raise DataError(f"{what} {p} is not a regular file", hint or "pass a file path")
    if not os.access(p, os.R_OK):
        raise DataError(f"{what} {p} is not readable (permission denied)", hint)
    return p


def read_text_input(path: str | os.PathLike[str], what: str, hint: str = "",
                    max_bytes: int = MAX_TEXT_INPUT_BYTES) -> str:
    """The UTF-8 text of an input file; a binary, huge or unreadable file is a ``DataError``."""
    p = check_input_file(path, what, hint)
    size = p.stat().st_size
    if size > max_bytes:
        raise DataError(f"{what} {p} is {size / 2**20:.0f} MiB; the limit is "
                        f"{max_bytes / 2**20:.0f} MiB", hint or "is this the right file?")
    try:
        raw = p.read_bytes()
    except OSError as err:
        raise DataError(f"cannot read {what} {p}: {err.strerror}", hint) from None
    if b"\x00" in raw:
        raise DataError(f"{what} {p} is a binary file, not text", hint or "pass a text file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{what} {p} is not UTF-8 text (byte {err.start})",
                        hint or "pass a text file") from None


def load_json_input(path: str | os.PathLike[str], what: str, hint: str = "") -> Any:
    """Strict JSON (no NaN/Infinity constants) from an input file; errors name the file."""
    text = read_text_input(path, what, hint)

    def _no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        return json.loads(text, parse_constant=_no_constants)
    except (json.JSONDecodeError, ValueError) as err:
        raise DataError(f"{what} {path} is not valid JSON: {err}", hint) from None


def yaml_error_line(err: Exception) -> str:
    """A YAML parse error as one line: problem and 1-based line/column."""
    problem = getattr(err, "problem", None) or type(err).__name__
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}"
