"""sMoE Fig. 7 in the simulator: cost normalised to the best baseline and per-window P95
vs SLO on the bursty pattern, one skewed-routing scenario per zoo model.

    python benchmarks/smoe_fig7.py \\
        --model tiny-moe-lm=out/smoe/smoe-skewed-pop.pt \\
        --model tiny-moe-lm-e32=out/smoe/smoe-e32-pop.pt \\
        --model minilm-moe-e8=out/smoe/smoe-minilm-pop.pt --windows 2

Each checkpoint (``moefleet autoscale train --scenario skewed --model ... --routing-trace
...``) names its scenario: a synthetic model of the zoo model's MoE shape driven by
that model's recorded routing trace, its SLO and interval. Every controller runs the
same held-out windows (``moefleet.autoscale.smoe.figs.compare``). Writes
benchmarks/results/smoe_fig7.json (per model: every controller's cost over the best
baseline's, median and per-window P95 / SLO, the per-interval P95 / SLO series, the
training record) and smoe_fig7.png. Simulated: nothing here ran on a real platform.
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
RESULTS = ROOT / "benchmarks" / "results" / "smoe_fig7.json"
COLOURS = {"smoe": "tab:red", "static-pop": "tab:blue", "static": "tab:gray",
           "hpa": "tab:green", "elasticmoe": "tab:purple", "faasconf": "tab:olive",
           "ref:one-pod-per-expert": "lightsteelblue", "ref:pop-experts512": "wheat",
           "ref:pop-experts512-seg2048": "lightgray"}


def reference_plans(sc: Any, setup: Any, space: Any) -> dict[str, Any]:
    """Fixed plans cheaper than ``static-pop`` inside sMoE's configuration space, to
    show what was reachable: its plan with one pod per expert (the cheapest at 1024 MB:
    replicas >= 1, pods are billed while alive), with every expert at 512 MB (half the
    price and half the vCPUs of 1024 MB; 512 MB passes the memory filter for these
    experts), and also with its segments at 2048 MB. Reference rows only: derived from the baseline
    by hand, never planned, never a baseline."""
    import dataclasses

    from moefleet.autoscale.smoe.evaluate import static_pop
    from moefleet.autoscale.smoe.popularity import PlanPolicy

    plan = static_pop(sc, setup, space)["plan"]
    if plan is None:
        return {}
    experts = {f.name for f in sc.plan.placement().functions if f.role == "expert"}
    half = {n: dataclasses.replace(c, memory_mb=512) if n in experts else c
            for n, c in plan.items()}
    both = {n: c if n in experts else dataclasses.replace(c, memory_mb=2048)
            for n, c in half.items()}
    one = {n: dataclasses.replace(c, replicas=1) if n in experts else c
           for n, c in plan.items()}
    return {"ref:one-pod-per-expert": lambda: PlanPolicy("ref:one-pod-per-expert", one),
            "ref:pop-experts512": lambda: PlanPolicy("ref:pop-experts512", half),
            "ref:pop-experts512-seg2048": lambda: PlanPolicy("ref:pop-experts512-seg2048",
                                                             both)}


def plot(res: dict[str, Any], path: Path) -> None:
    """Top: cost / best baseline per model x controller (bar labels: P95 / SLO).
    Bottom: per-interval P95 / SLO over the first held-out window, one panel per model."""
    from moefleet.report.figures import pyplot, save_png

    plt = pyplot()
    models = list(res["models"])
    fig = plt.figure(figsize=(4.6 * max(len(models), 2), 7.5))
    grid = fig.add_gridspec(2, len(models))
    top = fig.add_subplot(grid[0, :])
    names = list(res["models"][models[0]]["controllers"])
    width = 0.8 / len(names)
    for j, n in enumerate(names):
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(models))]
        rows = [res["models"][m]["controllers"][n] for m in models]
        bars = top.bar(xs, [r["cost_over_best"] for r in rows], width, label=n,
                       color=COLOURS.get(n), hatch="//" if n.startswith("ref:") else None)
        for b, r in zip(bars, rows, strict=True):
            top.annotate(f"{r['p95_over_slo']:.2f}", (b.get_x() + b.get_width() / 2,
                                                       b.get_height()),
                         ha="center", va="bottom", fontsize=6, rotation=90)
    top.axhline(1.0, color="k", lw=0.8)
    top.axhline(COST_BAR, color="k", lw=0.8, ls="--")
    top.set_xticks(range(len(models)))
    top.set_xticklabels([f"{m}\n(best: {res['models'][m]['best_baseline']})" for m in models])
    top.set_ylabel("cost / best baseline")
    top.set_title("bursty: cost normalised to the best baseline (labels: median window "
                  "P95 / SLO; dashed: the 0.75x bar)", fontsize=9)
    tallest = max(r["cost_over_best"] for m in models
                  for r in res["models"][m]["controllers"].values())
    top.set_ylim(0, 1.35 * tallest)  # room for the legend and the bar labels
    top.legend(fontsize=7, ncol=5, loc="upper left")
    for i, m in enumerate(models):
        ax = fig.add_subplot(grid[1, i])
        for n, r in res["models"][m]["controllers"].items():
            if n.startswith("ref:"):  # fixed reference plans: bars only
                continue
            s = r["interval_p95_over_slo"][0]
            ax.plot([t / 60 for t in s["t_s"]], s["p95_over_slo"], label=n, lw=0.8,
                    marker=".", ms=3, color=COLOURS.get(n))
        ax.axhline(SLO_SLACK, color="k", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_xlabel("minute of window 1")
        ax.set_ylabel("interval P95 / SLO")
        ax.set_title(f"{m} (SLO {res['models'][m]['slo_s']:g} s)", fontsize=9)
        ax.tick_params(labelsize=7)
    fig.suptitle("sMoE Fig. 7 (simulated, openfaas-k8s, skewed routing per zoo model)")
    fig.tight_layout()
    save_png(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", required=True, metavar="NAME=CKPT",
                    help="zoo model name and its sMoE checkpoint (repeatable)")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--pattern", default="bursty")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baselines", default=",".join(BASELINES))
    ap.add_argument("--references", action="store_true",
                    help="also run the fixed reference plans (reference_plans)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0, c0 = time.perf_counter(), time.process_time()
    pairs = []
    for item in args.model:
        name, sep, ckpt = item.partition("=")
        if not sep or not name or not ckpt:
            sys.exit(f"--model {item!r}: expected NAME=CHECKPOINT")
        pairs.append((name, Path(ckpt)))
    baselines = [b.strip() for b in args.baselines.split(",") if b.strip()]
    out: dict[str, Any] = {
        "benchmark": "smoe_fig7", "simulated": True, "pattern": args.pattern,
        "windows": args.windows, "seed": args.seed, "baselines": baselines,
        "bar": {"cost_ratio_le": COST_BAR, "p95_over_slo_le": SLO_SLACK},
        "best_baseline_rule": "cheapest baseline with median window P95 <= 1.02 x SLO "
                              "(else the lowest P95)",
        "command": " ".join(["python", *sys.argv]),
        "machine": {"python": platform.python_version(), "cpu": platform.processor(),
                    "cores": os.cpu_count()},
        "load_avg_start": os.getloadavg(), "models": {}}
    for name, ckpt in pairs:
        tm, cm = time.perf_counter(), time.process_time()
        res = compare(ckpt, pattern=args.pattern, windows=args.windows, seed=args.seed,
                      baselines=baselines,
                      extra=reference_plans if args.references else None,
                      progress=lambda s, n=name: print(f"{n}: {s}", file=sys.stderr,
                                                       flush=True))
        res["training"] = training_record(ckpt)
        res["eval_wall_s"], res["eval_cpu_s"] = (time.perf_counter() - tm,
                                                 time.process_time() - cm)
        out["models"][name] = res
        print(summary_line(name, res), flush=True)
    finish_run(out, args.out, (t0, c0), plot)


if __name__ == "__main__":
    main()
