"""Timeline plot of a simulation run (matplotlib, Agg backend: no display needed).

Three panels over simulated time, one point per metrics interval: request rate and p95
latency; live instances and cumulative billed cost; per-expert utilisation (heatmap,
one row per ``layer:expert``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moefleet.errors import DataError
from moefleet.sim.result import SimResult


def plot_timeline(result: SimResult, path: str | Path) -> Path:
    """Write the PNG to ``path`` (atomically) and return the path."""
    rows = result.timeline
    if not rows:
        raise DataError("the run has no timeline to plot (no interval elapsed)",
                        "simulate for longer than one --interval")
    from moefleet.report.figures import pyplot, save_png

    plt = pyplot()

    t = np.array([r["t_s"] for r in rows])
    width = np.diff(np.concatenate([[0.0], t]))
    rate = np.array([r["arrivals"] for r in rows]) / np.maximum(width, 1e-12)
    p95 = np.array([r["p95_latency_s"] for r in rows])
    util = np.array([[u for layer in r["expert_utilisation"] for u in layer] for r in rows])
    fig, (ax_r, ax_i, ax_u) = plt.subplots(3, 1, figsize=(11, 9), sharex=True,
                                           layout="constrained",
                                           gridspec_kw={"height_ratios": [1, 1, 1.4]})
    # Each row covers the interval that ends at its t_s: draw steps over those intervals.
    edges = np.concatenate([[0.0], t])
    ax_r.stairs(rate, edges, color="tab:blue", lw=1)
    ax_r.set_ylabel("arrivals (req/s)", color="tab:blue")
    ax_l = ax_r.twinx()
    ax_l.stairs(p95, edges, color="tab:red", lw=1)
    ax_l.set_ylabel("p95 latency (s)", color="tab:red")
    slo = result.config.get("slo_s")
    if slo:
        ax_l.axhline(float(slo), color="tab:red", ls="--", lw=0.8)
    ax_r.set_title(f"{result.model} on {result.platform}, policy {result.policy}: "
                   f"${result.cost.total:.4g}, p95 {result.latency.get('p95') or 0:.3g} s")
    ax_i.plot(t, [r["instances"] for r in rows], ".-", color="tab:green", lw=1)
    ax_i.set_ylabel("live instances", color="tab:green")
    ax_c = ax_i.twinx()
    ax_c.plot(t, [r["cost_usd"] for r in rows], color="tab:purple", lw=1)
    ax_c.set_ylabel("cost so far (USD)", color="tab:purple")
    if util.size:
        img = ax_u.imshow(util.T, aspect="auto", origin="lower", cmap="viridis", vmin=0,
                          vmax=1, extent=(0.0, float(t[-1]), -0.5, util.shape[1] - 0.5),
                          interpolation="nearest")
        fig.colorbar(img, ax=[ax_r, ax_i, ax_u], label="expert utilisation", pad=0.08,
                     shrink=0.5, anchor=(0.0, 0.0))
    ax_u.set(xlabel="simulated time (s)", ylabel="expert (layer-major)",
             xlim=(0.0, float(t[-1])))
    return save_png(fig, path, dpi=110)
