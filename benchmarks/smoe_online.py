"""The online run of sMoE (issue #15): the trained policy scales a real local deployment
of tiny-moe-lm under a replayed bursty Azure Functions 2019 window; measured billed cost
and P95 next to the simulator's prediction of the same run.

    python benchmarks/smoe_online.py --checkpoint out/smoe/smoe-skewed.pt

The checkpoint must be a skewed-scenario one (``moefleet autoscale train --scenario
skewed``: the synthetic 4 x 8 top-2 model whose routing is tiny-moe-lm's trace). Without
one, ``--train-budget S`` trains one for S seconds first; otherwise it is an error.

Replay: the harness's window selection (the first held-out window of ``--pattern``,
arrivals rescaled to the checkpoint's mean rate, seed 0), thinned to ``--keep`` of the
arrivals (seeded) and compressed ``--compress`` x in time (defaults 1/24 and 6: a
10-minute window in 100 s, 95 requests). Controllers (``--controllers``):
``smoe`` (the best-validated actor: what ``autoscale eval`` uses), ``smoe-latest`` (the
last actor, which moves), ``static`` (the starting plan: the reference). Each runs on a
fresh deployment: 12 serial warm-up requests (which calibrate the simulator), then the
replay under ``runtime.control.ControlLoop``. The simulator then predicts each run from
the compute profile, the recorded routing of the same requests and the warm-up's
calibration. Writes benchmarks/results/smoe_online.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "smoe_online.json"
MODEL = "tiny-moe-lm"
BAR = 0.20


def summary(records: list[Any], log: Any, spec: Any) -> dict[str, Any]:
    """Billed cost (the platform's meter over the replay's records) and the rest."""
    from moefleet.platform import Meter

    lats = sorted(log.latencies.values())
    by_kind: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    init = 0.0
    for r in records:
        by_kind[r.kind] += r.duration_s
        calls[r.kind] += 1
        init += r.init_s
    return {
        "billed_usd": Meter(spec, records).bill().total.total if records else 0.0,
        "provisioned_usd": log.provisioned_usd,
        "p95_s": log.p95_s(), "p50_s": statistics.median(lats) if lats else 0.0,
        "mean_s": statistics.fmean(lats) if lats else 0.0,
        "requests": len(lats), "failed": len(log.failed),
        "invocations": len(records), "cold_starts": sum(r.cold for r in records),
        "init_s": init, "handler_s_by_kind": dict(by_kind),
        "handler_per_call_s": {k: by_kind[k] / calls[k] for k in by_kind},
        "interval_p95_s": log.interval_p95_s,
    }


def per_call(records: list[Any]) -> dict[str, float]:
    out: dict[str, list[float]] = defaultdict(list)
    for r in records:
        out[r.kind].append(r.duration_s)
    return {k: statistics.fmean(v) for k, v in out.items()}


def load_controllers(ckpt: Path, names: list[str]
                     ) -> tuple[Any, Any, tuple[int, ...], dict[str, Any]]:
    """The checkpoint's scenario, setup, memory options and a factory per controller."""
    from moefleet.autoscale.smoe.train import controller_from_checkpoint

    sc, best, setup = controller_from_checkpoint(ckpt)
    out: dict[str, Any] = {}
    for n in names:
        if n == "smoe":
            out[n] = lambda: controller_from_checkpoint(ckpt)[1]
        elif n == "smoe-latest":
            out[n] = lambda: controller_from_checkpoint(ckpt, best=False)[1]
        elif n == "static":
            out[n] = lambda: None
        else:
            sys.exit(f"error: unknown controller {n!r} (use smoe, smoe-latest, static)")
    return sc, setup, tuple(best.agent.space.memory_mb), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=Path("out/smoe/smoe-skewed.pt"))
    ap.add_argument("--train-budget", type=float, default=0.0,
                    help="train a checkpoint for this many seconds when it is missing")
    ap.add_argument("--pattern", default="bursty", choices=("slow", "normal", "bursty"))
    ap.add_argument("--window", type=int, default=0, help="held-out window index")
    ap.add_argument("--compress", type=float, default=6.0)
    ap.add_argument("--keep", type=float, default=1 / 24)
    ap.add_argument("--warmup", type=int, default=12)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--controllers", default="smoe,static,smoe-latest")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from moefleet.autoscale.smoe.evaluate import eval_windows
    from moefleet.autoscale.smoe.harness import window_arrivals
    from moefleet.calibration.smoe_online import OnlineSetup, calibrate_local
    from moefleet.control import Replayed
    from moefleet.experiments.smoe_online import (
        EMULATED,
        memory_floor,
        pod_plans,
        replay,
        requests_for,
        run_measured,
        run_simulated,
        token_counts,
    )
    from moefleet.io import write_json_atomic
    from moefleet.models import load_adapter
    from moefleet.profiles.cache import profile_for

    t_all, cpu_all, load0 = time.perf_counter(), time.process_time(), os.getloadavg()
    if not args.checkpoint.is_file():
        if args.train_budget <= 0:
            sys.exit(f"error: no sMoE checkpoint at {args.checkpoint}; train one with "
                     f"`moefleet autoscale train --scenario skewed --out {args.checkpoint} "
                     "--time-budget 300` or pass --train-budget 300")
        from moefleet.autoscale.smoe.train import scenario_setup, train

        train(args.checkpoint, episodes=200, setup=scenario_setup("skewed"),
              time_budget_s=args.train_budget)
    sc, tsetup, memory_options, makers = load_controllers(args.checkpoint,
                                                          args.controllers.split(","))
    setup = OnlineSetup(compress=args.compress, keep=args.keep, warmup=args.warmup,
                        workers=args.workers, prompt_tokens=tsetup.prompt_tokens)
    adapter = load_adapter(MODEL)
    shape = adapter.summary()
    want = ([len(lp.experts) for lp in sc.plan.layers], sc.top_k)
    if (shape.num_experts, shape.top_k) != want or len(sc.plan.segment_memory_mb) != \
            shape.num_layers:
        sys.exit(f"error: the checkpoint's scenario ({want}) is not {MODEL}'s shape "
                 f"({shape.num_experts}, top-{shape.top_k}); train a skewed checkpoint")
    w = eval_windows(tsetup, args.pattern, args.window + 1)[args.window]
    window, duration = window_arrivals(w, tsetup.mean_rps, setup.seed)
    arrivals, run_s = replay(window, duration, setup)
    warm_ids = [f"warm-{i}" for i in range(setup.warmup)]
    batches, trace = requests_for(adapter, [*warm_ids, *(a.request_id for a in arrivals)],
                                  "sharegpt", "train", setup.prompt_tokens)
    tokens = token_counts(batches)
    profile = profile_for(MODEL)
    plans = pod_plans(sc, MODEL)
    floor = memory_floor(plans[0], profile, memory_options)
    rows: dict[str, Any] = {}
    for name, make in makers.items():
        print(f"[{time.strftime('%H:%M:%S')}] {name}: real run ({len(arrivals)} requests, "
              f"{run_s:.0f} s)", flush=True)
        load_before = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as tmp:
            log, warm = run_measured(sc, plans, adapter, make(), floor, arrivals, run_s,
                                     batches, warm_ids, tmp, setup)
        cal, prof, caller_s = calibrate_local(sc, plans[0], profile, trace,
                                              shape.vocab_size, warm, setup, tokens)
        sim_args = (floor, arrivals, run_s, warm_ids, setup)
        slog, res = run_simulated(sc, plans[0], prof, trace, shape.vocab_size, make(),
                                  *sim_args, cal, tokens, caller_s)
        # the simulator under the decisions the real run applied (controller divergence out)
        replayed = Replayed([(t - log.t0, n, c) for t, n, c in log.applied], sc.interval_s)
        rlog, _ = run_simulated(sc, plans[0], prof, trace, shape.vocab_size, replayed,
                                *sim_args, cal, tokens, caller_s)
        # the round trip paid inside the worker's slot instead (the simulator's warm start)
        cal_w, prof_w, _ = calibrate_local(sc, plans[0], profile, trace, shape.vocab_size,
                                           warm, setup, tokens, round_trip_on_slot=True)
        wlog, _ = run_simulated(sc, plans[0], prof_w, trace, shape.vocab_size, make(),
                                *sim_args, cal_w, tokens)
        meas, sim = summary(log.records, log, sc.spec), summary(slog.records, slog, sc.spec)
        same = summary(rlog.records, rlog, sc.spec)
        on_slot = summary(wlog.records, wlog, sc.spec)
        meas.update(decisions_applied=len(log.applied), clamped_platform=log.clamped_platform,
                    clamped_memory_floor=log.clamped_floor, wall_s=log.wall_s,
                    loadavg_1min=[load_before, os.getloadavg()[0]],
                    driver_cpu_s=log.driver_cpu_s, worker_cpu_s=log.worker_cpu_s,
                    cpu_busy=(log.driver_cpu_s + log.worker_cpu_s) / (os.cpu_count() or 1)
                    / log.wall_s, applied=[(round(t, 2), n, [c.memory_mb, c.replicas,
                                                               c.concurrency])
                                              for t, n, c in log.applied])
        sim.update(decisions_applied=res.reconfigurations, clamped_memory_floor=slog.clamped_floor,
                   wall_s=slog.wall_s)
        rows[name] = {
            "measured": meas, "simulated": sim,
            "calibration": {
                "caller_overhead_s": caller_s, "cold_start_s": cal.cold_start_s,
                "warm_start_s_if_on_slot": cal_w.warm_start_s,
                "call_overhead_1vcpu_s": {
                    "segment": prof.segments[0].batch.overhead_s
                    - profile.segments[0].batch.overhead_s,
                    "expert": prof.experts[0].batch.overhead_s
                    - profile.experts[0].batch.overhead_s},
                "warmup_mean_s": statistics.fmean(lat for _, lat, _ in warm[1:]),
                # the serial warm-up's calls (the first, cold request left out)
                "warmup_handler_per_call_s": per_call([r for _, _, rs in warm[1:] for r in rs])},
            "cost_sim_vs_measured": sim["billed_usd"] / meas["billed_usd"],
            "p95_sim_vs_measured": sim["p95_s"] / meas["p95_s"],
            "provisioned_sim_vs_measured": sim["provisioned_usd"] / meas["provisioned_usd"],
            "simulated_same_decisions": {
                k: same[k] for k in ("billed_usd", "p95_s", "p50_s", "mean_s", "invocations",
                                     "cold_starts", "handler_s_by_kind", "handler_per_call_s")},
            "cost_sim_same_decisions_vs_measured": same["billed_usd"] / meas["billed_usd"],
            "p95_sim_same_decisions_vs_measured": same["p95_s"] / meas["p95_s"],
            "simulated_round_trip_on_slot": {
                k: on_slot[k] for k in ("billed_usd", "p95_s", "p50_s", "mean_s")},
            "p95_sim_round_trip_on_slot_vs_measured": on_slot["p95_s"] / meas["p95_s"],
        }
        r = rows[name]
        r["within_bar"] = all(abs(r[k] - 1) <= BAR for k in ("cost_sim_vs_measured",
                                                              "p95_sim_vs_measured"))
        print(f"  measured ${meas['billed_usd']:.3g} P95 {meas['p95_s'] * 1e3:.0f} ms | "
              f"sim ${sim['billed_usd']:.3g} P95 {sim['p95_s'] * 1e3:.0f} ms | cost "
              f"{r['cost_sim_vs_measured']:.3f} p95 {r['p95_sim_vs_measured']:.3f} | "
              f"{meas['decisions_applied']} applied, {meas['clamped_memory_floor']} floor "
              f"clamps", flush=True)
    out = {
        "emulated": EMULATED, "model": MODEL, "platform": sc.spec.name,
        "checkpoint": str(args.checkpoint), "scenario_model": sc.model, "slo_s": sc.slo_s,
        "interval_s": sc.interval_s, "bar": f"sim/measured within +-{BAR:.0%}",
        "replay": {"pattern": args.pattern, "window": f"{w.function[:8]}@{w.start_minute}",
                   "cv": w.cv, "window_s": duration, "window_arrivals": len(window),
                   "mean_rps_window": tsetup.mean_rps, "compress": setup.compress,
                   "keep": setup.keep, "run_s": run_s, "requests": len(arrivals),
                   "mean_rps_run": len(arrivals) / run_s, "prompt_tokens": setup.prompt_tokens,
                   "warmup": setup.warmup, "workers": setup.workers},
        "memory_floor_mb": sorted(set(floor.values())),
        "controllers": rows,
        "wall_s": time.perf_counter() - t_all, "driver_cpu_s": time.process_time() - cpu_all,
        "loadavg_start": load0, "loadavg_end": os.getloadavg(),
        "command": " ".join(["python", "benchmarks/smoe_online.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__},
    }
    write_json_atomic(args.out, out)
    print(f"wrote {args.out} ({out['wall_s']:.0f} s wall)")


if __name__ == "__main__":
    main()
