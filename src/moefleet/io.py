"""File boundaries: atomic writes, output paths checked before work, safe text reads.

Writes go to a temporary file in the destination directory, are flushed and fsynced,
then ``os.replace``-d over the target (atomic on POSIX within one filesystem). On any
exception the temporary file is removed and the target is left untouched. Files get the
mode a plain ``open()`` would give them (``0o666`` minus the umask), not ``mkstemp``'s 0600.

Outputs are regular files only: an existing device, FIFO, socket or directory at the
path, or a symlink to one (or a dangling one), is refused, never replaced; a symlink to
a regular file is written through (its target is replaced, the link stays). ``-`` is
stdout only where a command says so (``stdout_ok``).

Every command checks all of its output paths with :func:`check_output_paths` *before* it
starts work, so a bad ``--png`` never leaves a half-done set of outputs behind; every
problem here is an :class:`~moefleet.errors.OutputPathError` or
:class:`~moefleet.errors.DataError` naming the path, never a raw ``OSError``.

Torch files (``torch.load``, safetensors) have their boundary in :mod:`moefleet.torch_io`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moefleet.errors import DataError, OutputPathError

#: The output path that means stdout, where a command prints data (``-o -``).
STDOUT = "-"
#: Largest text/YAML/JSON input file read whole (plans, platforms, profiles, CSVs).
MAX_TEXT_INPUT_BYTES = 256 * 1024 * 1024


def _umask() -> int:
    # os.umask can only be read by setting it; restore at once.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def is_stdout(target: str | os.PathLike[str] | None) -> bool:
    """Whether ``target`` is ``-``, which names stdout where a command prints data."""
    return target is not None and os.fspath(target) == STDOUT


def _kind(mode: int) -> str:
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a directory" if stat.S_ISDIR(mode) else "not a regular file"


def _not_regular(what: str, p: Path, mode: int, via: str, stdout_ok: bool) -> OutputPathError:
    if stat.S_ISDIR(mode):
        return OutputPathError(f"{what} {p} is {via}a directory",
                               f"name a file, e.g. {p / 'out'}")
    return OutputPathError(
        f"{what} {p} is {via}{_kind(mode)}; moefleet writes only regular files",
        "name a regular file" + (", or - for stdout" if stdout_ok else
                                 "; to write nothing, leave the option out"))


def check_output_path(target: str | os.PathLike[str] | None, what: str = "output", *,
                      stdout_ok: bool = False) -> Path | None:
    """The path to write ``target`` at, or ``OutputPathError`` unless it can be written
    as a regular file. Creates nothing.

    Refused: an existing entry that is not a regular file (directory, character or block
    device, FIFO, socket), a symlink that dangles, loops or leads to anything but a
    regular file, a parent that is not a writable directory (or under /proc, /sys), and
    ``-`` unless ``stdout_ok`` (then ``-`` is stdout and None is returned). A symlink to
    a regular file is followed: the result is the resolved target, so the link stays and
    the file it points at is replaced (a writer renames over the link's target, never
    over the link)."""
    if target is None:
        return None
    raw = os.fspath(target)
    if raw == "":
        raise OutputPathError(f"{what}: empty path", "name a file, e.g. -o out.json")
    if raw == STDOUT:
        if stdout_ok:
            return None
        raise OutputPathError(f"{what} - (stdout) is not supported for this output",
                              "name a file, e.g. out.json")
    p = Path(raw).expanduser()
    try:
        st: os.stat_result | None = os.lstat(p)
    except FileNotFoundError:
        st = None
    except OSError as err:  # ENOTDIR, EACCES, ELOOP on a parent
        raise OutputPathError(f"{what} {p}: {err.strerror}", "choose another path") from None
    if st is not None and stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(p)
        except FileNotFoundError:
            raise OutputPathError(f"{what} {p} is a dangling symlink (to {os.readlink(p)})",
                                  "remove the link or name a regular file") from None
        except OSError as err:
            raise OutputPathError(f"{what} {p} is a symlink that cannot be followed "
                                  f"({err.strerror})", "name a regular file") from None
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(what, p, st.st_mode, "a symlink to ", stdout_ok)
        resolved = p.resolve()
        if _through_pseudo_fs(p) or not _same_file(resolved, st):
            # e.g. /proc/self/fd/1: "following" it names another process's view of a file
            raise OutputPathError(
                f"{what} {p} is a symlink through /proc or /sys (to {os.readlink(p)}); "
                "moefleet writes only regular files",
                "name a regular file" + (", or - for stdout" if stdout_ok else ""))
        p = resolved
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise _not_regular(what, p, st.st_mode, "", stdout_ok)
    if st is not None and not os.access(p, os.W_OK):
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
    return p


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


def check_output_paths(*targets: tuple[str, str | os.PathLike[str] | None],
                       stdout: tuple[str, ...] = ()) -> None:
    """Check every ``(what, path)`` pair (``-`` allowed for the ``what``s in ``stdout``),
    and that no two outputs are the same file."""
    seen: dict[str, str] = {}
    for what, t in targets:
        resolved = check_output_path(t, what, stdout_ok=what in stdout)
        if resolved is not None:
            key = os.path.abspath(resolved)
            if key in seen:
                raise OutputPathError(f"{what} and {seen[key]} are the same file {t}",
                                      "give each output its own path")
            seen[key] = what


def _through_pseudo_fs(link: Path) -> bool:
    """Whether the chain of symlinks from ``link`` names a path under /proc or /sys."""
    cur = link
    for _ in range(40):  # the kernel's own limit on a chain
        if not cur.is_symlink():
            return False
        nxt = Path(os.readlink(cur))
        cur = Path(os.path.abspath(nxt if nxt.is_absolute() else cur.parent / nxt))
        if any(str(cur) == r or str(cur).startswith(r + "/") for r in ("/proc", "/sys")):
            return True
    return True


def _same_file(path: Path, st: os.stat_result) -> bool:
    try:
        there = os.stat(path)
    except OSError:
        return False
    return (there.st_dev, there.st_ino) == (st.st_dev, st.st_ino)


def _is_pseudo_fs(path: Path) -> bool:
    # /proc and /sys accept access() checks as root but refuse new files.
    resolved = str(path.resolve())
    return any(resolved == r or resolved.startswith(r + "/") for r in ("/proc", "/sys"))


#: errno values that mean "the output could not be written", whoever wrote it.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EACCES,
                          errno.EROFS})


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``target`` (next to the file a symlink points at);
    rename it over that file on success. ``target`` must pass :func:`check_output_path`,
    and is checked again just before the rename (a FIFO or device put there meanwhile
    is refused, not replaced)."""
    checked = check_output_path(target)
    assert checked is not None  # "-" is refused without stdout_ok
    target = checked
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as err:
        raise OutputPathError(f"cannot write {target}: {err.strerror}",
                              "choose a path you can write to") from None
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        try:
            yield tmp_path
            with open(tmp_path, "rb") as fh:
                os.fsync(fh.fileno())
        except OSError as err:
            # A full disk or quota (ENOSPC, EDQUOT, EFBIG) or an I/O error while the
            # output was being written: the partial file is removed below.
            if err.errno not in WRITE_ERRNOS:
                raise
            raise OutputPathError(f"cannot write {target}: {os.strerror(err.errno or 0)}",
                                  "free space on that disk, or write elsewhere") from None
        os.chmod(tmp_path, 0o666 & ~_umask())
        check_output_path(target)
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
