"""sMoE Fig. 8 in the simulator: one checkpoint across arrival patterns x input sizes.

    python benchmarks/smoe_fig8.py --checkpoint out/smoe/smoe-skewed-pop.pt \\
        --patterns slow,normal,bursty --prompt-tokens 32,64,128 --windows 1

The policy was trained at the checkpoint's input size (64 tokens for the skewed
scenario); other sizes test how it generalises. The SLO stays the checkpoint's (one
SLO per model, as in the paper); ``static-pop`` is re-planned for each input size (a
planner is given the input size). Per cell (``moefleet.autoscale.smoe.figs.compare``):
sMoE's cost over the best baseline's and its P95 / SLO, every controller's row.
Writes benchmarks/results/smoe_fig8.json and smoe_fig8.png. Simulated.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from moefleet.autoscale.smoe.evaluate import BASELINES
from moefleet.autoscale.smoe.figs import (
    COST_BAR,
    SLO_SLACK,
    compare,
    finish_run,
    summary_line,
    training_record,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "smoe_fig8.json"


def slim(cell: dict[str, Any]) -> dict[str, Any]:
    """The cell without per-interval P95 series (Fig. 8 reads per-window numbers; the
    series would make the JSON ~10x larger)."""
    rows = {n: {k: v for k, v in r.items() if k != "interval_p95_over_slo"}
            for n, r in cell["controllers"].items()}
    return {**cell, "controllers": rows}


def plot(res: dict[str, Any], path: Path) -> None:
    """Two heatmaps over pattern x input size: sMoE's cost / best baseline (cell text
    names the best baseline, and says when no baseline met the SLO) and sMoE's
    P95 / SLO."""
    from moefleet.report.figures import pyplot, save_png

    plt = pyplot()
    pats, toks = res["patterns"], res["prompt_tokens"]
    cells = res["cells"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, title, cmap in (
            (axes[0], "cost_ratio_vs_best_baseline", "sMoE cost / best baseline", "RdYlGn_r"),
            (axes[1], "p95_over_slo", "sMoE P95 / SLO (median window)", "RdYlGn_r")):
        grid = [[cells[p][str(t)][key] for t in toks] for p in pats]
        im = ax.imshow(grid, cmap=cmap, vmin=0.5, vmax=1.5, aspect="auto")
        for i, p in enumerate(pats):
            for j, t in enumerate(toks):
                c = cells[p][str(t)]
                miss = "" if c["best_baseline_meets_slo"] else ", all > SLO"
                extra = f"\n({c['best_baseline']}{miss})" if key.startswith("cost") else ""
                ax.text(j, i, f"{c[key]:.2f}{extra}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(toks)))
        ax.set_xticklabels([f"{t}{' (trained)' if t == res['trained_prompt_tokens'] else ''}"
                            for t in toks])
        ax.set_yticks(range(len(pats)))
        ax.set_yticklabels(pats)
        ax.set_xlabel("input tokens per request")
        ax.set_title(title, fontsize=9)
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.suptitle(f"sMoE Fig. 8 (simulated; {res['model_name']}, SLO {res['slo_s']:g} s, "
                 f"{res['windows']} held-out window(s) per cell)", fontsize=9)
    fig.tight_layout()
    save_png(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--name", default="tiny-moe-lm", help="zoo model of the checkpoint")
    ap.add_argument("--patterns", default="slow,normal,bursty")
    ap.add_argument("--prompt-tokens", default="32,64,128")
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baselines", default=",".join(BASELINES))
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0, c0 = time.perf_counter(), time.process_time()
    pats = [p.strip() for p in args.patterns.split(",") if p.strip()]
    try:
        toks = [int(t) for t in args.prompt_tokens.split(",") if t.strip()]
    except ValueError:
        sys.exit(f"--prompt-tokens {args.prompt_tokens!r}: expected integers, e.g. 32,64,128")
    baselines = [b.strip() for b in args.baselines.split(",") if b.strip()]
    rec = training_record(args.checkpoint)
    out: dict[str, Any] = {
        "benchmark": "smoe_fig8", "simulated": True, "model_name": args.name,
        "checkpoint": str(args.checkpoint), "patterns": pats, "prompt_tokens": toks,
        "windows": args.windows, "seed": args.seed, "baselines": baselines,
        "bar": {"cost_ratio_le": COST_BAR, "p95_over_slo_le": SLO_SLACK},
        "training": rec, "command": " ".join(["python", *sys.argv]),
        "machine": {"python": platform.python_version(), "cpu": platform.processor(),
                    "cores": os.cpu_count()},
        "load_avg_start": os.getloadavg(), "cells": {}}
    for p in pats:
        out["cells"][p] = {}
        for t in toks:
            res = compare(args.checkpoint, pattern=p, windows=args.windows, seed=args.seed,
                          prompt_tokens=t, baselines=baselines,
                          progress=lambda s, t=t: print(f"{t} tokens: {s}", file=sys.stderr,
                                                        flush=True))
            out["cells"][p][str(t)] = res = slim(res)
            out.setdefault("slo_s", res["slo_s"])
            out.setdefault("model", res["model"])
            out.setdefault("trained_prompt_tokens", res["trained_prompt_tokens"])
            print(summary_line(f"{p} {t} tokens", res), flush=True)
    finish_run(out, args.out, (t0, c0), plot)


if __name__ == "__main__":
    main()
