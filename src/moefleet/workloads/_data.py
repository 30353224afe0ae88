"""Locate the trace files under ``moefleet.paths.shared_data_dirs()`` or an explicit path."""

from __future__ import annotations

import os
from pathlib import Path

from moefleet.errors import DataError
from moefleet.paths import shared_data_dirs


def find_trace_file(folder: str, filename: str, path: str | os.PathLike[str] | None) -> Path:
    """The CSV ``filename`` of dataset ``folder``.

    ``path`` may name the CSV itself or a directory holding it; without ``path`` the
    shared data directories are searched for ``<dir>/<folder>/<filename>``.
    Raises :class:`DataError` naming what was searched when it is missing.
    """
    if path is not None:
        p = Path(path).expanduser()
        candidate = p / filename if p.is_dir() else p
        if candidate.is_file():
            return candidate
        raise DataError(f"trace file not found: {candidate}",
                        f"pass path= to the {filename} file or to the folder holding it")
    searched = shared_data_dirs()
    for d in searched:
        candidate = d / folder / filename
        if candidate.is_file():
            return candidate
    where = ", ".join(str(d) for d in searched) or "no data directory exists"
    raise DataError(
        f"dataset folder '{folder}' with {filename} not found (searched: {where})",
        f"set MOEFLEET_DATA_DIR to a directory that contains {folder}/, or pass path=",
    )


def portable(path: Path) -> str:
    """``path`` as results should record it: ``data:<folder>/<file>`` when it lies in a
    shared data directory (the same on every machine with the data), else as given (a
    file the user pointed at). Keeps this machine's layout out of committed results."""
    resolved = path.resolve()
    for d in shared_data_dirs():
        if resolved.is_relative_to(d):
            return f"data:{resolved.relative_to(d).as_posix()}"
    return str(path)


def file_key(path: Path) -> tuple[str, int, int]:
    """A cache key that changes when the file does (resolved path, mtime, size)."""
    st = path.stat()
    return (str(path.resolve()), st.st_mtime_ns, st.st_size)
