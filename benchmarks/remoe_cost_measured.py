"""Remoe's Fig. 9(a) analogue, measured: the cost of N requests on the local runtime for
Remoe vs the CPU / GPU / MIX / Fetch plans, and the cold start of each layout.

    OMP_NUM_THREADS=1 python benchmarks/remoe_cost_measured.py [--requests 8] [--new-tokens 16]
        [--calibrate]

- model: the zoo's many-expert decoder ``tiny-moe-lm-e32`` (4 MoE layers x 32 experts,
  top-8); requests: the first ``--requests`` ShareGPT test prompts, first 500 characters
  (truncated to 128 tokens), ``--new-tokens`` greedy output tokens each. The issue asks
  for 50 requests x 200 tokens; this 2-core machine, shared with other jobs, runs the
  scaled-down default (8 x 16) in a few minutes per method;
- activation matrix for the planner: the measured routing of these requests in the
  monolithic model (prompt and generated tokens; an oracle, not an SPS prediction);
- plans: ``moefleet.plan.remoe`` on ``--platform`` (Alibaba FC GPU by default) with the
  SLOs below; each is deployed on the local backend (worker processes, main functions on
  their own worker) and run by :func:`moefleet.remoe.run.run_remoe_plan`: overlapped cold
  start, then one main invocation per batch of ``--batch-size`` requests;
- cold start: ``--cold-repeats`` more times per layout (every function redeployed, so
  cold again), medians; ``parallel_bound_s`` is the slowest single instance start (what
  a platform running every instance on its own CPUs would see), ``overlapped_wall_s`` the
  wall time here, where the 2 cores serialise the instances' starts;
- cost: the platform's meter over every invocation record (main and nested remote calls);
  the main function's records carry the plan's GPU share although it ran on this CPU:
  **GPU emulated** (the GPU price applied to the measured CPU time; the GPU, MIX and Fetch
  layouts therefore differ here only in memory and GPU share, not in speed).

- ``--calibrate``: the planner gets this runtime's measured times instead of the FLOP-rate
  model and the platform's assumed 20 ms invocation overhead: before planning, the next
  ``--calib-requests`` test prompts (never the measured ones) calibrate
  (:func:`moefleet.calibration.remoe.calibrate_runtime`: in process, the non-expert time
  per layer and token and an expert's time per routed slot; on an all-remote deployment,
  a nested call's round trip, the handler's fixed and per-slot time), and its CPU price
  per GB-s is the one the meter bills (the platform's default vCPUs per GB, not 1 GB =
  1 vCPU). ``mmp_by_tpot_slo`` then records what MMP chooses at tighter TPOT SLOs
  (planner only, nothing run);
- ``--max-threads 1``: every function runs one torch thread whatever its vCPUs (the
  calibrated planner's assumption: T(y) flat). Without it a main of 5120 MB (2.5 vCPUs on
  ``alibaba-fc-gpu``) runs 2 threads, and on 2 cores shared with other jobs the same such
  plan measured 0.50 s billed in one run and 8.8 and 10.9 s in two others.

``ratio_vs_gpu``: a method's generation cost / the GPU plan's (cold-start phase excluded;
``ratio_vs_gpu_with_cold_start`` includes it). Cold start: Remoe's overlapped cold start
(main and remote functions started together) vs the CPU plan's, which is one monolithic
function holding every weight.

Writes benchmarks/results/remoe_cost_measured.json and remoe_cost_measured.png.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from moefleet.io import write_json_atomic

RESULTS = Path(__file__).parent / "results"
METHODS = ("remoe", "cpu", "gpu", "mix", "fetch")
MODEL = "tiny-moe-lm-e32"


def activation(adapter: Any, prompts: list[list[int]], new_tokens: int
               ) -> tuple[np.ndarray, list[list[int]]]:
    """Measured routing frequencies s_LE of the requests, and the monolithic greedy tokens."""
    from moefleet.engine.engine import Engine
    from moefleet.engine.request import SamplingParams
    from moefleet.engine.runner import InProcessRunner
    from moefleet.experts.kernels import in_process_experts

    inner = in_process_experts(adapter)
    layers = list(adapter.moe_layers)
    counts = np.zeros((len(layers), adapter.num_experts(layers[0])))

    def counting(layer: int, x_ND: Any, ids_NK: Any, w_NK: Any) -> Any:
        counts[layers.index(layer)] += np.bincount(ids_NK.reshape(-1).numpy(),
                                                   minlength=counts.shape[1])
        return inner(layer, x_ND, ids_NK, w_NK)

    outs = Engine(InProcessRunner(adapter, experts=counting), eos_token_id=None).generate(
        prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    return counts / counts.sum(axis=1, keepdims=True), [o.new_token_ids for o in outs]


def problem_of(method: str, adapter: Any, s_LE: np.ndarray, n_in: int, n_out: int,
               args: argparse.Namespace, cal: Any = None) -> Any:
    """The planner's problem: FLOP-rate times and the platform's assumed overheads, or,
    with ``cal``, this runtime's measured times and the meter's CPU price."""
    from moefleet.calibration.remoe import calibrated_problem, metered_prices
    from moefleet.plan.remoe.shapes import Timing, measure_cpu, problem_for
    from moefleet.platform import load_platform
    from moefleet.remoe.dims import dims_from_adapter

    dims = dims_from_adapter(adapter)
    platform = load_platform(args.platform)
    timing = measure_cpu(dims) if cal is None else Timing(1e9, 1e9, source="calibrated")
    problem = problem_for(dims, timing, platform, s_LE, n_in=n_in, n_out=n_out,
                          ttft_slo_s=args.ttft, tpot_slo_s=args.tpot, gpu=method != "cpu",
                          model=MODEL)
    if cal is not None:
        problem = metered_prices(calibrated_problem(problem, cal), platform)
    return problem


def plan_for(method: str, adapter: Any, s_LE: np.ndarray, n_in: int, n_out: int,
             args: argparse.Namespace, cal: Any = None) -> Any:
    from moefleet.plan.remoe import plan_policy

    problem = problem_of(method, adapter, s_LE, n_in, n_out, args, cal)
    result = plan_policy(problem, method, check_slo=False)
    return result.to_plan(problem, list(adapter.moe_layers))


def mmp_by_tpot_slo(problem: Any, slos: tuple[float, ...]) -> list[dict[str, Any]]:
    """What the paper's planner (MMP) chooses as the TPOT SLO tightens (nothing run)."""
    from dataclasses import replace

    from moefleet.plan.remoe import plan_policy
    from moefleet.plan.remoe.problem import InfeasibleError

    rows = []
    for slo in slos:
        try:
            r = plan_policy(replace(problem, tpot_slo_s=slo), "remoe", check_slo=False)
        except InfeasibleError as exc:
            rows.append({"tpot_slo_s": slo, "infeasible": str(exc)})
            continue
        rows.append({"tpot_slo_s": slo, "b": r.meta["chosen_b"],
                     "main_memory_mb": r.layout.main_mb,
                     "predicted_tpot_s": r.estimate.tpot_s,
                     "predicted_cost_usd": r.estimate.cost})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--platform", default="alibaba-fc-gpu")
    ap.add_argument("--ttft", type=float, default=30.0)
    ap.add_argument("--tpot", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--cold-repeats", type=int, default=4,
                    help="extra cold starts per layout (medians are reported)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--calibrate", action="store_true",
                    help="plan with this runtime's measured times (see the docstring)")
    ap.add_argument("--calib-requests", type=int, default=4)
    ap.add_argument("--max-threads", type=int, default=None,
                    help="cap every function's torch threads (local backend)")
    ap.add_argument("--out", default=str(RESULTS / "remoe_cost_measured.json"))
    args = ap.parse_args()

    from moefleet.data import load_prompts
    from moefleet.models import load_adapter
    from moefleet.platform import load_platform, open_store
    from moefleet.remoe.run import run_remoe_plan

    adapter = load_adapter(MODEL)
    test = load_prompts("sharegpt", split="test")[: args.requests + args.calib_requests]
    encoded = [list(adapter.tokenizer(p.text[:500], truncation=True,
                                      max_length=128)["input_ids"]) for p in test]
    prompts, calib = encoded[: args.requests], encoded[args.requests:]
    s_LE, reference = activation(adapter, prompts, args.new_tokens)
    n_in = round(statistics.mean(len(p) for p in prompts))
    platform = load_platform(args.platform)
    cal = None
    if args.calibrate:
        from moefleet.calibration.remoe import calibrate_runtime

        with tempfile.TemporaryDirectory(prefix="moefleet-remoe-cal-") as tmp:
            cal = calibrate_runtime(adapter, calib, platform=platform, store=open_store(tmp),
                                    max_tokens=args.new_tokens, workers=args.workers)
        print(f"calibration: {cal.to_dict()}", flush=True)
    runs: dict[str, Any] = {}
    for method in args.methods.split(","):
        plan = plan_for(method, adapter, s_LE, n_in, args.new_tokens, args, cal)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="moefleet-remoe-") as tmp:
            summary = run_remoe_plan(
                plan, prompts, platform=platform, store=open_store(tmp), adapter=adapter,
                backend_options={"workers": args.workers, "main_workers": 1,
                                 "max_threads": args.max_threads},
                max_tokens=args.new_tokens, batch_size=args.batch_size, check=False,
                cold_repeats=args.cold_repeats)
        tokens = list(summary.pop("tokens").values())
        summary["tokens_match_monolithic"] = tokens == reference
        summary["run_wall_s"] = time.perf_counter() - t0
        summary["plan"] = {"main_memory_mb": plan.main.memory_mb, "gpu_gb": plan.main.gpu_gb,
                           "remote_groups": [[g.layer, len(g.experts), g.memory_mb,
                                              g.replicas] for g in plan.groups],
                           "predicted": plan.predicted,
                           "chosen_b": plan.meta.get("chosen_b"),
                           "mmp_b": (plan.meta.get("mmp") or {}).get("b")}
        runs[method] = summary
        print(f"{method}: ${summary['cost_usd']['total']:.4g} (generation "
              f"${summary['cost_usd']['generation']['main']['cost_usd']:.3g} main + "
              f"${summary['cost_usd']['generation']['remote']['cost_usd']:.3g} remote), "
              f"cold start {summary['cold_start']['wall_s']:.2f} s, "
              f"equal tokens {summary['tokens_match_monolithic']}", flush=True)

    def gen_cost(s: dict[str, Any]) -> float:
        g = s["cost_usd"]["generation"]
        return float(g["main"]["cost_usd"] + g["remote"]["cost_usd"])

    gpu = runs.get("gpu")
    for s in runs.values():
        if gpu is not None:
            s["ratio_vs_gpu"] = gen_cost(s) / gen_cost(gpu)
            s["ratio_vs_gpu_with_cold_start"] = s["cost_usd"]["total"] / gpu["cost_usd"]["total"]
    def med(s: dict[str, Any], key: str) -> float:
        return float(statistics.median(c[key] for c in s["cold_start_repeats"]))

    cold: dict[str, Any] = {
        m: {"runs": len(s["cold_start_repeats"]),
            "overlapped_wall_s": med(s, "wall_s"), "main_init_s": med(s, "main_init_s"),
            "remote_init_s": med(s, "remote_init_s"),
            # one instance per core, as on a platform: the slowest of the parallel starts
            "parallel_bound_s": float(statistics.median(
                max(c["main_init_s"], c["remote_init_s"]) for c in s["cold_start_repeats"]))}
        for m, s in runs.items()}
    if "remoe" in runs and "cpu" in runs:
        for key in ("overlapped_wall_s", "parallel_bound_s", "main_init_s"):
            cold[f"remoe_vs_monolithic_{key}"] = cold["remoe"][key] / cold["cpu"][key]
    out = {"model": MODEL, "platform": args.platform, "requests": len(prompts),
           "new_tokens": args.new_tokens, "prompt_chars": 500, "mean_prompt_tokens": n_in,
           "slo": {"ttft_s": args.ttft, "tpot_s": args.tpot},
           # per method: "GPU emulated ..." where the main ran on this CPU, else the device
           "gpu": {m: s.get("gpu") for m, s in runs.items()},
           "command": "OMP_NUM_THREADS=1 python benchmarks/remoe_cost_measured.py "
                      f"--requests {args.requests} --new-tokens {args.new_tokens} "
                      f"--methods {args.methods}" + (" --calibrate" if cal else "")
                      + (f" --max-threads {args.max_threads}" if args.max_threads else ""),
           "planner_inputs": ("calibrated on this runtime (calibration.remoe), meter's CPU "
                              "price" if cal else "FLOP-rate model, platform's assumed "
                              "invocation overhead, 1 GB = 1 vCPU"),
           "calibration": cal.to_dict() if cal else None,
           "mmp_by_tpot_slo": mmp_by_tpot_slo(
               problem_of("remoe", adapter, s_LE, n_in, args.new_tokens, args, cal),
               (1.0, 0.1, 0.05, 0.04, 0.03, 0.02, 0.01)) if cal else None,
           "methods": runs, "cold_start": cold}
    write_json_atomic(args.out, out)
    _plot(runs, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out}")


def _plot(runs: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(runs)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    main = [runs[m]["cost_usd"]["generation"]["main"]["cost_usd"] for m in names]
    remote = [runs[m]["cost_usd"]["generation"]["remote"]["cost_usd"] for m in names]
    a.bar(names, main, label="main function (GPU emulated)")
    a.bar(names, remote, bottom=main, label="remote expert functions")
    a.set_ylabel("billed USD, generation")
    a.set_title("cost of the requests (measured, local runtime)")
    a.legend(fontsize=8)
    b.bar(names, [statistics.median(c["wall_s"] for c in runs[m]["cold_start_repeats"])
                  for m in names])
    b.set_ylabel("seconds (median)")
    b.set_title("cold start, all functions started together")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
