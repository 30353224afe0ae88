"""BO samplers compared (ODS/BO Fig. 13 analogue) and the BO-vs-oracle bar.

    python benchmarks/bo_convergence.py [--model minilm-moe-e8] [--seeds 3] [--iters 30]
        [--quick] [--traffic c4] [--slo-scale 0.9] [--fit-tokens 2048] [--out PATH]

Profiles the model once (the demo's stages 1-4: wikitext2:train for the predictor and the
BO batches, wikitext2:test as a held-out workload), then runs the BO loop with every
sampler (eps-gp = the paper's multi-dimensional decaying epsilon-greedy search with a GP
surrogate, eps without the GP, single-eps, random, tpe) for ``--seeds`` seeds. Evaluator:
the analytical model on the BO batches' real routing (rules (i)-(iii) applied).

Writes benchmarks/results/bo_convergence.json (+ .png): per sampler the median best
objective after each iteration, iterations to convergence, wall seconds per run; and
the BO/oracle ratios in-sample (BO batches) and held out (the workload), with the
unadjusted plan's ratios beside them.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

from moefleet.demo.pipeline import DemoConfig, Prepared, prepare
from moefleet.io import write_json_atomic
from moefleet.plan import OdsPlanner
from moefleet.plan.bo import BayesOpt, BOConfig, BOResult
from moefleet.plan.bo_eval import apply_rules, counts_for_plan
from moefleet.plan.bo_samplers import SAMPLERS

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "bo_convergence.json"


def held_out(prep: Prepared, res: BOResult | None, margin: float) -> dict[str, float]:
    """Cost of the plan from (BO-adjusted or unadjusted) predictions on the workload,
    relative to the plan from its real counts; both billed on the real counts."""
    w = prep.workload
    real = prep.problem(w.real_LE, w.tokens)
    oracle = OdsPlanner().plan(real).predicted["cost_usd"]
    if res is None:
        pred = prep.predicted_LE
    else:
        with res.applied() as p:
            pred = p.predict_counts(w.requests)
    plan = OdsPlanner().plan(real.with_counts(counts_for_plan(pred)))
    out = apply_rules(real, plan, pred, margin)
    return {"cost_usd": out.estimate.cost_usd, "oracle_usd": oracle,
            "ratio": out.estimate.cost_usd / oracle, "feasible": out.feasible}


def in_sample_oracle(prep: Prepared) -> float:
    t = prep.template()
    return float(np.mean([OdsPlanner().plan(t.with_counts(b.real_LE)).predicted["cost_usd"]
                          for b in prep.bo_batches]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="minilm-moe-e8")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--pairs", type=int, default=1000)
    ap.add_argument("--samplers", default=",".join(SAMPLERS))
    ap.add_argument("--quick", action="store_true", help="the demo's --quick sizes")
    ap.add_argument("--batch-tokens", type=int, default=None, help="BO batch size")
    ap.add_argument("--bo-batches", type=int, default=None, help="number of BO batches")
    ap.add_argument("--fit-tokens", type=int, default=None,
                    help="tokens the predictor is fitted on (fewer: a worse predictor)")
    ap.add_argument("--traffic", default=None,
                    help="dataset of the BO batches and the workload (domain shift), e.g. c4")
    ap.add_argument("--slo-scale", type=float, default=1.0,
                    help="multiply the default SLO (LambdaML latency / (1 - 0.1876))")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    sizes: dict[str, Any] = {"model": args.model, "traffic": args.traffic}
    if args.batch_tokens:
        sizes.update(batch_tokens=args.batch_tokens, workload_tokens=args.batch_tokens)
    if args.bo_batches:
        sizes["bo_batches"] = args.bo_batches
    if args.fit_tokens:
        sizes["fit_tokens"] = args.fit_tokens
    cfg = DemoConfig.quick(**sizes) if args.quick else DemoConfig(**sizes)
    prep = prepare(cfg, say=lambda m: print(m, file=sys.stderr))
    prep.slo_s *= args.slo_scale
    oracle_in = in_sample_oracle(prep)
    runs: dict[str, list[dict[str, Any]]] = {}
    for name in args.samplers.split(","):
        for seed in range(args.seeds):
            bo_cfg = BOConfig(pairs=args.pairs, max_iters=args.iters, sampler=name, seed=seed)
            res = BayesOpt(prep.predictor, prep.template(), prep.bo_batches, bo_cfg).run()
            row = {"seed": seed, **res.summary(),
                   "best_curve": [h["best_cost_usd"] for h in res.history],
                   "in_sample_ratio_billed": res.best.billed / oracle_in,
                   "held_out": held_out(prep, res, bo_cfg.margin)}
            runs.setdefault(name, []).append(row)
            print(f"{name} seed {seed}: {res.iterations} it, {res.wall_s:.1f} s, "
                  f"objective {res.baseline.cost:.4g} -> {res.best.cost:.4g}, held-out "
                  f"ratio {row['held_out']['ratio']:.3f}", file=sys.stderr)
    summary = {}
    for name, rows in runs.items():
        n = max(len(r["best_curve"]) for r in rows)
        curves = np.array([r["best_curve"] + [r["best_curve"][-1]] * (n - len(r["best_curve"]))
                           for r in rows])
        summary[name] = {
            "median_curve": np.median(curves, axis=0).tolist(),
            "iterations_median": statistics.median(r["iterations"] for r in rows),
            "wall_s_median": statistics.median(r["wall_s"] for r in rows),
            "improvement_median": statistics.median(r["improvement"] for r in rows),
            "held_out_ratio_median": statistics.median(r["held_out"]["ratio"] for r in rows),
            "in_sample_ratio_median": statistics.median(r["in_sample_ratio_billed"]
                                                        for r in rows),
        }
    result = {
        "model": args.model, "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
        "pairs": args.pairs, "iters": args.iters, "seeds": args.seeds,
        "slo_scale": args.slo_scale, "traffic": args.traffic,
        "evaluator": "analytical", "slo_s": prep.slo_s, "oracle_in_sample_usd": oracle_in,
        "unadjusted_held_out": held_out(prep, None, BOConfig().margin),
        "summary": summary, "runs": runs,
        "machine": {"cpus": os.cpu_count(), "load": os.getloadavg(),
                    "python": platform.python_version()},
    }
    write_json_atomic(args.out, result)
    plot(summary, args.out.with_suffix(".png"))
    for name, s in summary.items():
        print(f"{name:10s} iterations {s['iterations_median']:>4} wall {s['wall_s_median']:6.1f} s"
              f"  improvement {s['improvement_median']:.3f}  held-out BO/oracle "
              f"{s['held_out_ratio_median']:.3f}")
    print(f"unadjusted held-out/oracle {result['unadjusted_held_out']['ratio']:.3f}")


def plot(summary: dict[str, Any], path: Path) -> None:
    from moefleet.report.figures import pyplot, save_png

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, s in summary.items():
        ax.plot(range(len(s["median_curve"])), s["median_curve"], label=name)
    ax.set_xlabel("BO iteration")
    ax.set_ylabel("best objective (USD, median over seeds)")
    ax.set_title("BO samplers (analytical evaluator)")
    ax.legend()
    fig.tight_layout()
    save_png(fig, path, dpi=110)


if __name__ == "__main__":
    main()
