"""Plot a measured compute profile (matplotlib, Agg backend: no display needed).

Left panel: per-call time per token (µs) vs batch size at one thread, measured medians as
markers and the fitted batch law ``(a + b·n)/n`` as a line, one colour per function.
Right panel: per-token time (µs) at the largest batch vs threads, measured points and
the fitted thread law ``θ1·exp(−θ2·v) + θ3``. Needs the ``raw`` evidence that
:func:`~moefleet.profiles.measure.measure_profile` stores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from moefleet.errors import DataError
from moefleet.profiles.model import ComputeProfile, FunctionProfile


def _series(profile: ComputeProfile) -> list[tuple[str, FunctionProfile, dict[str, Any]]]:
    raw = profile.raw
    if "experts" not in raw or "segments" not in raw:
        raise DataError(
            f"compute profile of {profile.model} has no measurements to plot",
            "plot a profile written by moefleet profile-compute",
        )
    out = [(f"expert L{k}", profile.experts[int(k)], r) for k, r in raw["experts"].items()]
    out += [(f"segment {i}", profile.segments[i], r) for i, r in enumerate(raw["segments"])]
    return out


def plot_profile(profile: ComputeProfile, path: str | Path) -> Path:
    """Write the two-panel PNG to ``path`` (atomically) and return the path."""
    from moefleet.report.figures import pyplot, save_png

    plt = pyplot()

    series = _series(profile)
    fig, (ax_n, ax_v) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = plt.get_cmap("tab20")(np.linspace(0, 1, max(len(series), 2)))
    for (label, law, raw), color in zip(series, colors, strict=False):
        tokens = np.asarray(raw["tokens"], dtype=float)
        measured = np.asarray(raw["median_s"]["1"], dtype=float)
        grid = np.geomspace(tokens.min(), tokens.max(), 100)
        fitted = law.batch.overhead_s + law.batch.per_token_s * grid
        ax_n.plot(tokens, measured / tokens * 1e6, "o", color=color, ms=3)
        ax_n.plot(grid, fitted / grid * 1e6, "-", color=color, lw=1, label=label)
        fit = raw["thread_fit"]
        v = np.asarray(raw["threads"], dtype=float)
        v_grid = np.linspace(1.0, max(4.0, v.max()), 100)
        ax_v.plot(v, np.asarray(fit["per_token_s"]) * 1e6, "o", color=color, ms=3)
        ax_v.plot(v_grid, [law.threads.per_token_s(x) * 1e6 for x in v_grid], "-",
                  color=color, lw=1, label=label)
    ax_n.set(xscale="log", yscale="log", xlabel="batch size (tokens)",
             ylabel="time per token at 1 thread (µs)", title="batch law a/n + b")
    ax_v.set(yscale="log", xlabel="threads (vCPUs)", ylabel="time per token (µs)",
             title="thread law θ1·exp(−θ2·v) + θ3 (largest batch)")
    ax_v.legend(fontsize=7, ncol=2)
    for ax in (ax_n, ax_v):
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"compute profile of {profile.model} (markers measured, lines fitted)")
    fig.tight_layout()
    return save_png(fig, path, dpi=110)
