"""The Remoe simulator (``moefleet.sim.remoe``) against the Remoe runtime (``moefleet.remoe``
on the local backend): same plans, same requests, same routing.

    OMP_NUM_THREADS=1 python benchmarks/remoe_sim_vs_runtime.py [--requests 8] [--new-tokens 16]

- model ``tiny-moe-lm-e32`` (4 MoE layers x 32 experts, top-8), platform
  ``alibaba-fc-gpu`` (the main function's GPU share priced on its CPU-measured time:
  **GPU emulated**, on both sides);
- requests: ShareGPT test prompts (first 500 characters, <= 128 tokens), ``--new-tokens``
  greedy tokens each, every request alone in its own main invocation (batch 1: the
  simulator's unit is one request). Validated: prompts 0..N-1. Calibration: the next
  ``--calib-requests`` prompts, never the validated ones;
- calibration (:mod:`moefleet.calibration.remoe`): in process, the non-expert time per
  layer and token and a local expert's time per routed slot (decode, prefill); then one
  *calibration deployment* (every expert remote, one replica) on the calibration prompts
  gives a nested call's overhead (from its TPOT) and the handler's billed fixed time;
- plans: remote share b in ``--shares`` (the b·E least used experts of each layer remote,
  by the calibration prompts' routing), 2 replicas per remote function, the smallest
  memory that holds each part;
- routing: the validated prompts' per-step routing, recorded in process, replayed by the
  simulator (``passes``), with the runtime's dispatch: ``lpt`` when the plan's groups
  carry LPT's replica split (planner plans: each expert's slots to its replica), else
  ``split`` (each expert's slots cut over the replicas);
- compared per plan: median TTFT and TPOT, remote calls (total and per layer), remote
  token-slots (the runtime's from its replies' bytes), billed USD of the main function
  and of the remote functions (the platform's meter on the runtime's records; the
  simulator's billing, the meter's duration rule, at the meter's price per GB-s: the
  platform's default 2048 MB per vCPU, not the planner's 1 GB = 1 vCPU, see
  ``calibrate.metered_prices``). ``ratio`` = simulator / runtime; each round calibrates
  and then validates, ratios are medians over ``--rounds``.

Writes benchmarks/results/remoe_sim_vs_runtime.json.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from moefleet.io import write_json_atomic

RESULTS = Path(__file__).parent / "results"
MODEL = "tiny-moe-lm-e32"


def base_problem(adapter: Any, platform: Any, s_LE: np.ndarray, n_in: int,
                 n_out: int) -> Any:
    """A Remoe problem for the model on the platform; its times are all replaced by
    :func:`calibrated_problem`, so the FLOP rates given here are never used."""
    from moefleet.plan.remoe.shapes import Timing, problem_for
    from moefleet.remoe.dims import dims_from_adapter

    dims = dims_from_adapter(adapter)
    return problem_for(dims, Timing(1e9, 1e9, source="replaced by the calibration"),
                       platform, s_LE, n_in=n_in, n_out=n_out, ttft_slo_s=30.0,
                       tpot_slo_s=1.0, model=MODEL)


def layout_at(p: Any, share: float, replicas: int) -> Any:
    """The b·E least used experts of each layer remote, smallest memories that hold it."""
    from moefleet.plan.remoe.model import evaluate, main_need_mb, remote_need_mb
    from moefleet.plan.remoe.planner import RemoeResult
    from moefleet.plan.remoe.solve import build_layout, select_remote

    r = round(share * p.num_experts)
    x = select_remote(p, r)
    main_mb = p.round_main(main_need_mb(p, "remoe", x))
    remote_mb = tuple(
        next(m for m in p.remote_memory_mb if m >= remote_need_mb(p, x[li], li))
        if x[li].any() else 0 for li in range(p.num_layers))
    z = [replicas if x[li].any() else 0 for li in range(p.num_layers)]
    lay = build_layout(p, x, main_mb, remote_mb, z)
    return RemoeResult(f"remoe-b{share:g}", lay, evaluate(p, lay), 0.0)


def billed(records: list[Any], platform: Any, share: float) -> tuple[float, float]:
    """(compute USD, per-request USD) of ``records``: the simulator bills compute only."""
    from moefleet.platform import Meter

    meter = Meter(platform)
    for r in records:
        meter.add(replace(r, gpu_share=share) if r.kind == "main" else r)
    total = meter.bill().total
    return float(total.compute), float(total.request)


def compare(run: dict[str, Any], sim: Any, main_rate: float, hidden: int, platform: Any,
            moe_layers: list[int]) -> dict[str, Any]:
    from moefleet.calibration.remoe import record_slots

    res = run["results"]
    rec = run["remote_records"]
    calls_by_layer: dict[int, int] = {}
    slots_by_layer: dict[int, int] = {}
    for r in rec:
        li = moe_layers.index(r.layer)
        calls_by_layer[li] = calls_by_layer.get(li, 0) + 1
        slots_by_layer[li] = slots_by_layer.get(li, 0) + record_slots(r, hidden)
    real = {
        "ttft_s": statistics.median(r.ttft_s for r in res),
        "tpot_s": statistics.median(r.tpot_s for r in res),
        "remote_calls": len(rec),
        "remote_slots": sum(record_slots(r, hidden) for r in rec),
        "main_cost_usd": billed(run["main_records"], platform, run["gpu_share"])[0],
        "remote_cost_usd": billed(rec, platform, 0.0)[0],
        "request_fees_usd": sum(billed(rs, platform, 0.0)[1]
                                for rs in (run["main_records"], rec)),
        "main_billed_s": sum(platform.billed_duration_s(r.duration_s)
                             for r in run["main_records"]),
        "remote_billed_s": sum(platform.billed_duration_s(r.duration_s) for r in rec),
    }
    simd = {
        "ttft_s": statistics.median(sim.ttft_s), "tpot_s": statistics.median(sim.tpot_s),
        "remote_calls": sim.remote_calls, "remote_slots": sim.remote_slots,
        "main_cost_usd": sim.main_cost,
        "remote_cost_usd": sim.remote_prefill_cost + sim.remote_decode_cost,
        "main_billed_s": sim.main_billed_s, "remote_billed_s": sim.remote_billed_s,
    }
    ratio = {k: (simd[k] / real[k] if real[k] else (1.0 if simd[k] == 0 else None))
             for k in simd}
    # the price per second each side puts on the main function (GPU share + CPU memory)
    real["main_usd_per_billed_s"] = real["main_cost_usd"] / real["main_billed_s"]
    simd["main_usd_per_billed_s"] = main_rate
    return {"runtime": real, "simulator": simd, "ratio": ratio,
            "by_layer": {"runtime": {"calls": calls_by_layer, "slots": slots_by_layer},
                         "simulator": {"calls": sim.calls_by_layer,
                                       "slots": sim.slots_by_layer}},
            "by_layer_equal": (calls_by_layer == sim.calls_by_layer
                               and slots_by_layer == sim.slots_by_layer),
            "runtime_invocations_reported": sum(run["remote_invocations"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--calib-requests", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--shares", default="0,0.5,1")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3,
                    help="calibrate-then-validate rounds (ratios: median over rounds)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--platform", default="alibaba-fc-gpu")
    ap.add_argument("--out", default=str(RESULTS / "remoe_sim_vs_runtime.json"))
    args = ap.parse_args()
    t_wall, t_cpu = time.perf_counter(), time.process_time()
    load_before = os.getloadavg()

    from moefleet.calibration.remoe import (
        calibrate_runtime,
        calibrated_problem,
        measure_plan,
        metered_prices,
        record_passes,
    )
    from moefleet.data import load_prompts
    from moefleet.models import load_adapter
    from moefleet.platform import load_platform, open_store
    from moefleet.sim.remoe import RemoeSimulator

    adapter = load_adapter(MODEL)
    platform = load_platform(args.platform)
    texts = load_prompts("sharegpt", split="test")[: args.requests + args.calib_requests]
    prompts = [list(adapter.tokenizer(p.text[:500], truncation=True,
                                      max_length=128)["input_ids"]) for p in texts]
    valid, calib = prompts[: args.requests], prompts[args.requests:]
    shape = adapter.summary()
    hidden = int(shape.hidden_size)

    # the validated requests' routing, recorded in process once (greedy: every round's)
    passes, _, ref_tokens = record_passes(adapter, valid, args.new_tokens)
    n_in = round(statistics.mean(len(p) for p in valid))
    rounds = []
    for k in range(args.rounds):
        # calibration: in process, then a separate all-remote deployment; each round
        # again, so that calibration and validation see the same machine load
        cal_passes, _, _ = record_passes(adapter, calib, args.new_tokens)
        counts_LE = sum(ps.counts_LE for req in cal_passes for ps in req)
        s_LE = counts_LE / counts_LE.sum(axis=1, keepdims=True)
        p0 = base_problem(adapter, platform, s_LE, n_in, args.new_tokens)
        with tempfile.TemporaryDirectory(prefix="moefleet-remoe-cal-") as tmp:
            cal = calibrate_runtime(adapter, calib, platform=platform, store=open_store(tmp),
                                    max_tokens=args.new_tokens, workers=args.workers)
        p = replace(metered_prices(calibrated_problem(p0, cal), platform), cold_main_s=0.0,
                    cold_remote_s=0.0)
        print(f"round {k}: calibration {cal.to_dict()}", flush=True)
        plans: dict[str, Any] = {}
        for share in (float(s) for s in args.shares.split(",")):
            result = layout_at(p, share, args.replicas)
            plan = result.to_plan(p, list(shape.moe_layers))
            with tempfile.TemporaryDirectory(prefix="moefleet-remoe-val-") as tmp:
                run = measure_plan(plan, adapter, valid, platform=platform,
                                   store=open_store(tmp), max_tokens=args.new_tokens,
                                   workers=args.workers)
            # the runtime's dispatch: LPT's replica split when the plan's groups carry it
            lpt = any(g.replica_experts is not None for g in plan.groups)
            simulator = RemoeSimulator(p, result.layout, billing=platform.billing,
                                       dispatch="lpt" if lpt else "split",
                                       billed_overhead_s=cal.handler_fixed_s,
                                       keep_alive_s=1e9)
            sim = simulator.run([1e4 * i for i in range(len(valid))], passes=passes)
            row = compare(run, sim, simulator.m.rate_s, hidden, platform,
                          list(shape.moe_layers))
            row["tokens_match_in_process"] = ([list(r.tokens) for r in run["results"]]
                                              == ref_tokens)
            row["dispatch"] = "lpt" if lpt else "split"
            row["plan"] = {"b": share, "main_memory_mb": plan.main.memory_mb,
                           "gpu_gb": plan.main.gpu_gb,
                           "remote": [[g.layer, len(g.experts), g.memory_mb, g.replicas]
                                      for g in plan.groups]}
            plans[f"b={share:g}"] = row
            print(f"  b={share:g}: ratios {row['ratio']}", flush=True)
        rounds.append({"calibration": cal.to_dict(), "plans": plans})
    summary = {
        name: {q: {"median": statistics.median(r["plans"][name]["ratio"][q] for r in rounds),
                   "min": min(r["plans"][name]["ratio"][q] for r in rounds),
                   "max": max(r["plans"][name]["ratio"][q] for r in rounds)}
               for q in rounds[0]["plans"][name]["ratio"]}
        for name in rounds[0]["plans"]}

    usage = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    out = {
        "model": MODEL, "platform": args.platform, "requests": len(valid),
        "calibration_requests": len(calib), "new_tokens": args.new_tokens,
        "gpu": "GPU emulated: the main function ran on CPU, GPU price applied to its time",
        "command": "OMP_NUM_THREADS=1 python benchmarks/remoe_sim_vs_runtime.py "
                   f"--requests {args.requests} --new-tokens {args.new_tokens} "
                   f"--rounds {args.rounds}",
        "ratio_sim_over_runtime": summary, "rounds": rounds,
        "wall_s": time.perf_counter() - t_wall, "cpu_s_driver": time.process_time() - t_cpu,
        # reaped children only: the local backend's workers are the forkserver's children,
        # so their CPU time is not in here
        "cpu_s_driver_and_reaped_children": sum(u.ru_utime + u.ru_stime for u in usage),
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
    }
    write_json_atomic(args.out, out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
