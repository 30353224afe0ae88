"""Where moefleet finds shared data and keeps its cache.

Data directory, first match wins:
1. ``$MOEFLEET_DATA_DIR``;
2. a ``shared/data`` folder beside the checkout (``<repo>/../shared/data``) or beside
   the current directory;
3. the small embedded copies inside the package (``moefleet/embedded/data``), so the demo
   also runs from a bare checkout or an installed wheel.

Cache directory: ``$MOEFLEET_CACHE_DIR`` or the platform's user cache dir.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

PACKAGE_DIR = Path(__file__).resolve().parent
EMBEDDED_DATA_DIR = PACKAGE_DIR / "embedded" / "data"


def _candidate_data_dirs() -> list[Path]:
    out: list[Path] = []
    env = os.environ.get("MOEFLEET_DATA_DIR")
    if env:
        if not Path(env).expanduser().is_dir():
            # A typo here would silently fall back to other data: say so instead.
            from moefleet.errors import DataError

            raise DataError(f"MOEFLEET_DATA_DIR={env} is not a directory",
                            "point it at a data folder, or unset it")
        out.append(Path(env).expanduser())
    # src/moefleet -> src -> repo -> repo/../shared/data
    repo = PACKAGE_DIR.parent.parent
    out.append(repo.parent / "shared" / "data")
    cwd = Path.cwd()
    out.extend([cwd.parent / "shared" / "data", cwd / "shared" / "data"])
    return out


def shared_data_dirs() -> list[Path]:
    """Existing data directories, in priority order, embedded copies last."""
    seen: list[Path] = []
    for d in [*_candidate_data_dirs(), EMBEDDED_DATA_DIR]:
        d = d.resolve()
        if d.is_dir() and d not in seen:
            seen.append(d)
    return seen


def cache_dir() -> Path:
    env = os.environ.get("MOEFLEET_CACHE_DIR")
    base = Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("moefleet"))
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        from moefleet.errors import MoefleetError

        raise MoefleetError(
            f"cannot use cache directory {base}: {err.strerror}",
            "set MOEFLEET_CACHE_DIR to a folder you can write to") from None
    if not os.access(base, os.W_OK | os.X_OK):
        from moefleet.errors import MoefleetError

        raise MoefleetError(f"cache directory {base} is not writable",
                            "set MOEFLEET_CACHE_DIR to a folder you can write to")
    return base
