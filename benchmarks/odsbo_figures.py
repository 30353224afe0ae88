"""ODS/BO Figs. 10, 12, 13 and 14, one command each (Fig. 11: benchmarks/odsbo_fig11.py).

    python benchmarks/odsbo_figures.py --figure 10|12|13|14 [--quick] [--out DIR]

Each writes ``DIR/odsbo_fig<N>.json`` and ``.png`` (DIR: benchmarks/results) and is
bounded (minutes on a loaded 2-core machine). Every number is measured here; the figures'
settings are the paper's where the zoo allows and say so where they differ:

- **10** prediction error: the Bayesian predictor (and the lina / ef baselines) fitted on
  ``wikitext2:train``, scored on 2,048-token batches of wikitext2 / c4 / sharegpt
  (``predict.harness.evaluate``: mean per-expert |predicted - real| count, and that over
  the mean real count), over every built zoo model among tiny-moe-lm (8 experts, top-2),
  tiny-moe-lm-e32 (32 experts), minilm-moe-e8 and its top-1 routing (top-1 vs top-2);
- **12** deployment solvers under throughput targets: ODS, the MIQCP (SCIP, time limit),
  and the random method choice (median of 5 seeds) on tiny-moe-lm's profile with one
  profiled 2,048-token batch's real counts; targets = tokens / SLO for SLOs from the
  fastest plan's latency to LambdaML's / (1 - 0.1876);
- **13** BO samplers: ``benchmarks/bo_convergence.py`` in the setting where they differ
  (``--fig13-args``; default tiny-moe-lm with 12,288-token BO batches, where a count
  error moves replicas and billing steps; at 2,048 tokens, with a tighter SLO, fewer
  profiled tokens or 32 experts every sampler's objective stayed flat);
- **14** the overall comparison: ``moefleet demo`` (``--quick`` sizes unless ``--full``)
  on minilm-moe-e8 when built, else tiny-moe-lm: BO plan vs oracle, unadjusted, LambdaML
  and the CPU cluster, measured on the local backend.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from moefleet.errors import MoefleetError
from moefleet.io import write_json_atomic

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
THROUGHPUT_LOSS = 0.1876
FIG10_MODELS = ("tiny-moe-lm", "tiny-moe-lm-e32", "minilm-moe-e8", "minilm-moe-e8-top1")
FIG10_DATASETS = ("wikitext2:test", "c4", "sharegpt")
FIG13_ARGS = ("--model tiny-moe-lm --quick --batch-tokens 12288 --seeds 2 --iters 15 "
              "--samplers eps-gp,eps,single-eps,random")


def _machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "load": os.getloadavg(),
            "python": platform.python_version()}


def _profile(adapter: Any, dataset: str, tokens: int) -> Any:
    from moefleet.data import load_prompts, split_dataset
    from moefleet.traces import profile

    name, split = split_dataset(dataset)
    prompts = load_prompts(name, split=split)
    return profile(adapter, [p.request_id for p in prompts], [p.text for p in prompts],
                   max_tokens=tokens, max_length=128, attention_ids=True, dataset=dataset)


def figure10(quick: bool) -> tuple[dict[str, Any], Any]:
    from moefleet.models import load_adapter, zoo
    from moefleet.predict.harness import PREDICTORS, PredictorContext, evaluate

    fit_tokens, test_tokens = (4096, 2048) if quick else (16384, 4096)
    rows: list[dict[str, Any]] = []
    skipped = [m for m in FIG10_MODELS if not zoo.is_built(m)]
    for model in [m for m in FIG10_MODELS if zoo.is_built(m)]:
        adapter = load_adapter(model)
        train = _profile(adapter, "wikitext2:train", fit_tokens)
        for dataset in FIG10_DATASETS:
            test = _profile(adapter, dataset, test_tokens)
            preds = {n: PREDICTORS[n][1](PredictorContext()) for n in ("bayes", "lina", "ef")}
            res = evaluate(preds, train, test, batch_tokens=2048)
            s = adapter.summary()
            for name, r in res["predictors"].items():
                rows.append({"model": model, "experts": max(s.num_experts), "top_k": s.top_k,
                             "dataset": dataset, "predictor": name, "abs_diff": r["abs_diff"],
                             "abs_diff_rel": r["abs_diff_rel"], "batches": r["batches"]})
                print(rows[-1], flush=True)
    out = {"figure": 10, "fit_tokens": fit_tokens, "test_tokens": test_tokens,
           "batch_tokens": 2048, "rows": rows, "models_not_built": skipped}

    def draw(ax: Any) -> None:
        keys = sorted({(r["model"], r["dataset"]) for r in rows})
        x = np.arange(len(keys))
        for k, name in enumerate(("bayes", "lina", "ef")):
            vals = [next(r["abs_diff_rel"] for r in rows if (r["model"], r["dataset"]) == key
                         and r["predictor"] == name) for key in keys]
            ax.bar(x + (k - 1) * 0.27, vals, 0.27, label=name)
        ax.set_xticks(x, [f"{m}\n{d}" for m, d in keys], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("mean |pred - real| / mean real count")
        ax.set_title("Fig. 10 analogue: expert-count prediction error")
        ax.legend()
    return out, draw


def figure12(quick: bool) -> tuple[dict[str, Any], Any]:
    from moefleet.models import load_adapter
    from moefleet.plan import LambdaMLPlanner, PlanningProblem, get_planner
    from moefleet.plan.bo_eval import counts_for_plan
    from moefleet.platform import load_platform
    from moefleet.predict.base import ModelShape
    from moefleet.profiles.cache import profile_for

    model = "tiny-moe-lm"
    adapter = load_adapter(model)
    trace = _profile(adapter, "wikitext2:test", 2048)
    shape = ModelShape.from_trace(trace)
    counts = _real_counts(trace, shape)
    base = PlanningProblem.from_summary(adapter.summary(), profile_for(model),
                                        load_platform("aws-lambda-2020"),
                                        counts_for_plan(counts.astype(float)), 1e4,
                                        tokens=trace.num_tokens)
    lam = LambdaMLPlanner().plan(base).predicted["latency_s"] / (1 - THROUGHPUT_LOSS)
    fastest = _fastest(base)
    slos = np.linspace(fastest * 1.02, lam, 3 if quick else 5).tolist()
    rows = []
    limit = 60.0 if quick else 180.0
    for slo in slos:
        p = base.with_slo(slo)
        row: dict[str, Any] = {"slo_s": slo, "throughput_tokens_per_s": p.tokens / slo}
        for name in ("ods", "miqcp"):
            kw = {"time_limit_s": limit} if name == "miqcp" else {}
            t0 = time.perf_counter()
            try:
                plan = get_planner(name, **kw).plan(p)
            except MoefleetError as err:  # the MIQCP may find nothing within its limit
                row[name] = {"cost_usd": None, "wall_s": time.perf_counter() - t0,
                             "status": err.message}
                continue
            row[name] = {"cost_usd": plan.predicted["cost_usd"], "wall_s":
                         time.perf_counter() - t0, "status": plan.meta.get("status")}
        rnd = []
        for seed in range(5):
            try:
                rnd.append(get_planner("random").plan(p, seed=seed).predicted["cost_usd"])
            except MoefleetError:  # 20 method draws, none meets the SLO
                rnd.append(None)
        ok = [c for c in rnd if c is not None]
        row["random"] = {"cost_usd": statistics.median(ok) if ok else None, "all": rnd}
        rows.append(row)
        print(row, flush=True)
    out = {"figure": 12, "model": model, "tokens": base.tokens, "miqcp_time_limit_s": limit,
           "rows": rows}

    def draw(ax: Any) -> None:
        x = [r["throughput_tokens_per_s"] for r in rows]
        for name, mark in (("ods", "o-"), ("miqcp", "s--"), ("random", "^:")):
            pts = [(t, r[name]["cost_usd"]) for t, r in zip(x, rows, strict=True)
                   if r[name]["cost_usd"] is not None]
            ax.plot([a for a, _ in pts], [b for _, b in pts], mark, label=name)
        ax.set_xlabel("throughput target (tokens/s = tokens / SLO)")
        ax.set_ylabel("billed MoE cost per batch (USD, model)")
        ax.set_title("Fig. 12 analogue: ODS vs MIQCP vs random (tiny-moe-lm)")
        ax.legend()
    return out, draw


def _real_counts(trace: Any, shape: Any) -> np.ndarray:
    from moefleet.plan.bo_eval import batches_from_trace

    (batch,) = batches_from_trace(trace, shape, trace.num_tokens, 1)
    return np.asarray(batch.real_LE)


def _fastest(p: Any) -> float:
    from moefleet.plan.base import Frontiers

    fr = Frontiers(p)
    return p.fixed_latency_s + sum(
        min(float(fr.get(li, a).latency_s[0]) for a in (1, 2, 3) if len(fr.get(li, a)))
        for li in range(p.num_moe_layers))


def figure13(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    path = args.out / "odsbo_fig13_runs.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bo_convergence.py"),
           *shlex.split(args.fig13_args), "--out", str(path)]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    import json

    res = json.loads(path.read_text())
    out = {"figure": 13, "command": " ".join(shlex.quote(c) for c in cmd[1:]),
           "setting": args.fig13_args, "summary": res["summary"], "slo_s": res["slo_s"],
           "unadjusted_held_out": res["unadjusted_held_out"]}

    def draw(ax: Any) -> None:
        for name, s in res["summary"].items():
            ax.plot(range(len(s["median_curve"])), s["median_curve"], label=name)
        ax.set_xlabel("BO iteration")
        ax.set_ylabel("best objective (USD, median over seeds)")
        ax.set_title(f"Fig. 13 analogue: BO samplers ({args.fig13_args})", fontsize=7)
        ax.legend()
    return out, draw


def figure14(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    from moefleet.demo.pipeline import DemoConfig, run_demo
    from moefleet.models import zoo
    from moefleet.report.demo import demo_png

    model = "minilm-moe-e8" if zoo.is_built("minilm-moe-e8") else "tiny-moe-lm"
    cfg = DemoConfig(model=model) if args.full else DemoConfig.quick(model=model)
    with tempfile.TemporaryDirectory(prefix="moefleet-fig14-") as work:  # plans, trace
        report = run_demo(cfg, Path(work), say=lambda m: print(m, flush=True))
    out = {"figure": 14, "model": model, "full": args.full, "report": report}

    def draw(_ax: Any) -> None:
        demo_png(report, args.out / "odsbo_fig14.png")
    return out, draw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--figure", type=int, choices=(10, 12, 13, 14), required=True)
    ap.add_argument("--quick", action="store_true", help="smaller traces / fewer targets")
    ap.add_argument("--full", action="store_true", help="Fig. 14: the demo's full sizes")
    ap.add_argument("--fig13-args", default=FIG13_ARGS,
                    help="bo_convergence.py arguments of the Fig. 13 setting")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.figure == 10:
        out, draw = figure10(args.quick)
    elif args.figure == 12:
        out, draw = figure12(args.quick)
    elif args.figure == 13:
        out, draw = figure13(args)
    else:
        out, draw = figure14(args)
    out.update(wall_s=time.perf_counter() - t0, machine=_machine(),
               command=" ".join(sys.argv))
    path = args.out / f"odsbo_fig{args.figure}.json"
    write_json_atomic(path, out)
    if args.figure == 14:
        draw(None)
    else:
        from moefleet.report.figures import pyplot, save_png

        plt = pyplot()
        fig, ax = plt.subplots(figsize=(8, 4.5))
        draw(ax)
        fig.tight_layout()
        save_png(fig, path.with_suffix(".png"), dpi=110)
    print(f"wrote {path} and {path.with_suffix('.png')} in {out['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
