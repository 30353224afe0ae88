"""sMoE against its baselines and ablations in the simulator (sMoE Figs. 7, 9, 10, 11).

    python benchmarks/smoe_cost.py --full smoe.pt --ablations DIR [--windows 2]

Checkpoints come from ``moefleet autoscale train`` (DIR holds no-cc.pt, no-dagnn.pt,
no-pointer.pt, ddpg-only.pt; missing ones are skipped and listed). Every controller runs
the same held-out Azure Functions 2019 windows per pattern (slow, normal, bursty) in one
harness (``moefleet.autoscale.smoe.harness``): same scenario, arrivals and cost rule.

Writes benchmarks/results/smoe_cost.json (+ .png) for a checkpoint of the uniform
scenario and smoe_cost_<scenario>.json for another (the checkpoint names its
scenario): per pattern, per controller the cost,
median per-window P95 over the SLO, share of intervals within the SLO and the median
decision latency; for sMoE ``cost_ratio_vs_best_baseline`` (the best baseline is the
cheapest one whose P95 <= 1.02 x SLO; when none meets it, the one with the lowest P95)
and ``p95_over_slo``; the training record of each checkpoint (episodes, CPU seconds).
The baselines include ``static-pop`` (the popularity-aware static plan from predicted
popularity, :func:`moefleet.autoscale.smoe.evaluate.static_pop`); the ratio against the
best of the older set without it (``..._without_static_pop``) is written beside.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from moefleet.autoscale.smoe.evaluate import (
    BASELINES,
    baseline,
    evaluate,
    smoe_factory,
    static_pop,
)
from moefleet.autoscale.smoe.figs import SLO_SLACK, best_baseline, training_record
from moefleet.io import write_json_atomic

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "smoe_cost.json"
ABLATIONS = ("no-cc", "no-dagnn", "no-pointer", "ddpg-only")
OLD_BASELINES = tuple(b for b in BASELINES if b != "static-pop")


def plot(res: dict[str, Any], path: Path) -> None:
    from moefleet.report.figures import pyplot, save_png

    plt = pyplot()
    pats = list(res["patterns"])
    fig, axes = plt.subplots(2, len(pats), figsize=(4.2 * len(pats), 6), squeeze=False)
    for j, p in enumerate(pats):
        rows = res["patterns"][p]["controllers"]
        names = list(rows)
        ref = res["patterns"][p]["best_baseline"]
        cost = [rows[n]["cost_usd"] / rows[ref]["cost_usd"] for n in names]
        p95 = [rows[n]["p95_over_slo"] for n in names]
        axes[0][j].bar(names, cost, color="tab:blue")
        axes[0][j].set_title(f"{p}: cost / {ref}")
        axes[1][j].bar(names, p95, color="tab:orange")
        axes[1][j].axhline(1.0, color="k", lw=1)
        axes[1][j].set_title(f"{p}: P95 / SLO (median window)")
        for ax in (axes[0][j], axes[1][j]):
            ax.tick_params(axis="x", rotation=60, labelsize=7)
    fig.suptitle("sMoE vs baselines and ablations (simulated, openfaas-k8s)")
    fig.tight_layout()
    save_png(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", type=Path, required=True)
    ap.add_argument("--ablations", type=Path, default=None)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--patterns", default="slow,normal,bursty")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    sc, setup, make_full, space = smoe_factory(args.full)
    if args.out is None:
        args.out = (RESULTS if setup.scenario == "uniform"
                    else RESULTS.with_name(f"smoe_cost_{setup.scenario}.json"))
    ctls: dict[str, Any] = {"smoe": make_full}
    training: dict[str, Any] = {}
    missing = []
    ckpts = {"smoe": args.full}
    for v in ABLATIONS:
        p = (args.ablations / f"{v}.pt") if args.ablations else None
        if p is None or not p.is_file():
            missing.append(v)
            continue
        _, setup_v, make, _ = smoe_factory(p)
        if setup_v != setup:
            sys.exit(f"{p} was trained for another setup than {args.full}")
        ctls[f"smoe-{v}"] = make
        ckpts[f"smoe-{v}"] = p
    warm: dict[str, Any] = {}
    for name, p in ckpts.items():
        rec = training_record(p)
        warm[name] = rec["warm_start"]
        training[name] = {k: rec[k] for k in ("episodes", "wall_s", "sessions", "cpu_s")}
    for b in BASELINES:
        ctls[b] = (lambda b=b: baseline(b, sc, space, setup))
    pats = [p.strip() for p in args.patterns.split(",") if p.strip()]
    raw = evaluate(ctls, sc, setup, pats, args.windows, args.seed,
                   progress=lambda s: print(s, file=sys.stderr, flush=True))
    out: dict[str, Any] = {
        "benchmark": "smoe_cost", "simulated": True, "model": sc.model,
        "scenario": setup.scenario, "routing_trace": setup.routing_trace,
        "platform": sc.spec.name, "slo_s": sc.slo_s, "interval_s": sc.interval_s,
        "mean_rps": setup.mean_rps, "window_minutes": setup.window_minutes,
        "windows_per_pattern": args.windows, "training": training, "warm_start": warm,
        "static_pop": {k: v for k, v in static_pop(sc, setup, space).items() if k != "plan"},
        "ablations_missing": missing,
        "cost_rule": "sum over functions of alive-instance seconds x price per second of "
                     "the function's memory (openfaas-k8s prices)",
        "machine": {"python": platform.python_version(), "cpu": platform.processor()},
        "command": " ".join(["python", *sys.argv]), "patterns": {},
    }
    for p, rows in raw.items():
        ref, meets = best_baseline(rows)
        old, old_meets = best_baseline(rows, OLD_BASELINES)
        s = rows["smoe"]
        out["patterns"][p] = {
            "controllers": rows, "best_baseline": ref, "best_baseline_meets_slo": meets,
            "cost_ratio_vs_best_baseline": s["cost_usd"] / rows[ref]["cost_usd"],
            "best_baseline_without_static_pop": old,
            "best_baseline_without_static_pop_meets_slo": old_meets,
            "cost_ratio_vs_best_baseline_without_static_pop":
                s["cost_usd"] / rows[old]["cost_usd"],
            "p95_over_slo": s["p95_over_slo"],
            "decision_latency_over_interval": s["decision_latency_s"] / sc.interval_s,
        }
    b = out["patterns"].get("bursty")
    if b is not None:
        out["bars"] = {
            "bursty_cost_le_0.75_best_baseline": b["cost_ratio_vs_best_baseline"] <= 0.75,
            "bursty_p95_le_1.02_slo": b["p95_over_slo"] <= SLO_SLACK,
            "decision_latency_le_1pct_interval": b["decision_latency_over_interval"] <= 0.01,
        }
    out["wall_s"] = time.perf_counter() - t0
    write_json_atomic(args.out, out)
    plot(out, args.out.with_suffix(".png"))
    for p, r in out["patterns"].items():
        print(f"{p}: cost/best({r['best_baseline']}) = {r['cost_ratio_vs_best_baseline']:.3f}, "
              f"cost/best without static-pop ({r['best_baseline_without_static_pop']}) = "
              f"{r['cost_ratio_vs_best_baseline_without_static_pop']:.3f}, "
              f"P95/SLO = {r['p95_over_slo']:.3f}")


if __name__ == "__main__":
    main()
