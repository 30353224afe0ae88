"""Shared plumbing for every PNG moefleet writes: headless pyplot, atomic save.

Plots are made on machines without a display (CI, servers), and a half-written PNG
must never replace a good one, so every figure goes through these two calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moefleet.io import atomic_path


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (imported lazily: matplotlib is slow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, path: str | Path, dpi: int = 110) -> Path:
    """Write ``fig`` to ``path`` atomically as PNG and close it; returns the path."""
    target = Path(path)
    with atomic_path(target) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    pyplot().close(fig)
    return target
