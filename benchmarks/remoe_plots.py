"""Plots of benchmarks/remoe_cost.py's results (one PNG per figure)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from moefleet.report.figures import pyplot, save_png


def plot(e: dict[str, Any], stem: Path, kinds: tuple[str, ...], bar: float) -> None:
    """remoe_cost_fig9/10/11.png from one model's entry of remoe_cost.json."""
    plt = pyplot()
    if "fig9" in e:
        f9 = e["fig9"]
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = np.arange(len(kinds))
        ax.bar(xs - 0.2, [f9["ratio_vs_gpu"][k] for k in kinds], 0.4, label="analytical")
        ax.bar(xs + 0.2, [f9["simulator"]["ratio_vs_gpu"][k] for k in kinds], 0.4,
               label="simulator (real routing)")
        ax.axhline(bar, color="k", ls="--", lw=1, label=f"bar {bar}x")
        ax.set_xticks(xs, kinds)
        ax.set_yscale("log")
        ax.set_ylabel("cost / GPU-only cost")
        ax.set_title(f"Fig. 9(b) analogue: {f9['requests']} requests, DeepSeek-V2-Lite "
                     "shape (GPU emulated)", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        save_png(fig, f"{stem}_fig9.png")
    if "fig10_cost_vs_prefill_decode_ratio" in e:
        f10 = e["fig10_cost_vs_prefill_decode_ratio"]
        fig, ax = plt.subplots(figsize=(7, 4))
        ratios = list(f10["analytical"])
        for i, k in enumerate(kinds):
            c = f"C{i}"
            ax.plot([float(r) for r in ratios], [f10["analytical"][r][k] for r in ratios],
                    "o-", color=c, label=k)
            ax.plot([float(r) for r in ratios], [f10["simulator"][r][k] for r in ratios],
                    "x:", color=c)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("prefill / decode tokens (400 per request)")
        ax.set_ylabel("USD per request (o analytical, x simulator)")
        ax.set_title("Fig. 10 analogue (GPU emulated)", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        save_png(fig, f"{stem}_fig10.png")
    if "fig11" in e:
        f11 = e["fig11"]
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        a.bar(kinds, [f11["cold_start_s_median"][k] for k in kinds])
        a.set_ylabel("cold start, s (median)")
        a.set_title("weights loaded at the object store's rate", fontsize=9)
        b.bar(kinds, [f11["planning_cpu_s_median"][k] * 1e3 for k in kinds])
        b.axhline(f11["sps_predict_s_median"] * 1e3, color="k", ls="--", lw=1,
                  label="SPS prediction")
        b.set_ylabel("planning CPU time, ms (median)")
        b.set_yscale("log")
        b.legend(fontsize=8)
        for ax in (a, b):
            ax.tick_params(axis="x", labelsize=8)
        fig.suptitle("Fig. 11 analogue", fontsize=10)
        fig.tight_layout()
        save_png(fig, f"{stem}_fig11.png")
