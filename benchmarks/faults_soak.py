"""A long run under mixed faults at a fixed share of capacity: nothing accepted is lost.

    python benchmarks/faults_soak.py [--minutes 30] [--load 0.8] [--rate 0.05] [--seed 0]

The tiny Mixtral (random weights, 3 MoE layers x 8 experts) deployed as a plan on the
local backend (storage method: tokens pass through the object store; 2 worker
processes), as in benchmarks/faults.py. Each request scores an 8-token prompt (one
prefill step through the segment runner, experts invoked as functions).

1. Capacity, without faults: ``--capacity-requests`` requests submitted at once (the
   engine batches up to 8); capacity = requests / wall seconds (after a warm-up that
   starts every instance: cold starts are not faults).
2. The soak: Poisson arrivals at ``--load`` x capacity for ``--minutes``, replayed into
   the engine in real time, under the ``mixed`` fault plan at ``--rate``: each injected
   backend fault is drawn from crash (a worker SIGKILLed: real), timeout, throttle and
   straggler (emulated at the harness), and the object store fails the same share of
   operations with 503 SlowDown or a dropped connection (emulated).

Per run: accepted, completed, failed with a clear error, ``lost`` = accepted - completed
- failed (must be 0), completed outputs equal to the monolithic model's, completions in
every 60 s window (the minimum must not be 0), latency p50/p99, faults injected, retries,
billed cost with failed attempts. Writes benchmarks/results/faults_soak.json and prints
a progress line every minute. Offered load above capacity is refused (see --load).
"""

from __future__ import annotations

import argparse
import os
import platform as pyplatform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moefleet.experiments.fault_runs import run_under_faults
from moefleet.io import write_json_atomic
from moefleet.models.hf import HFMoEAdapter
from moefleet.models.tiny import tiny_model
from moefleet.plan import DeploymentPlan
from moefleet.platform import LocalObjectStore, load_platform
from moefleet.runtime.deploy import deploy_plan
from moefleet.runtime.faults import FaultPlan
from moefleet.runtime.local import LocalBackend

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "faults_soak.json"
PROMPT_TOKENS, BATCH, WINDOW_S = 8, 8, 60.0


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n, PROMPT_TOKENS), generator=g).tolist()


def run(adapter: HFMoEAdapter, dep: Any, backend: LocalBackend, store: LocalObjectStore,
        spec: Any, plan: FaultPlan, arrivals: list[tuple[float, list[int]]],
        label: str) -> dict[str, Any]:
    """Replay ``arrivals`` (t_s, prompt) under ``plan`` through the fault harness
    (``experiments.fault_runs``); its counts and bill, with completions per window."""
    done = {"n": 0, "t": time.monotonic()}
    start = time.monotonic()

    def tick(_: Any) -> None:  # a progress line a minute, on a long run
        done["n"] += 1
        if time.monotonic() - done["t"] >= WINDOW_S:
            done["t"] = time.monotonic()
            print(f"  {label}: {time.monotonic() - start:6.0f} s, {done['n']}/{len(arrivals)}"
                  " requests done", file=sys.stderr, flush=True)

    r = run_under_faults(adapter, dep, backend, store, spec, plan, [p for _, p in arrivals],
                         arrivals_s=[t for t, _ in arrivals], batch=BATCH, on_finish=tick)
    # every window from the first arrival to the last completion (the drain included)
    span = max(arrivals[-1][0], max(r.finished_s, default=0.0), WINDOW_S)
    windows = np.histogram(r.finished_s, bins=np.arange(0.0, span + WINDOW_S, WINDOW_S))[0]
    lat = r.latencies_s
    return {
        "label": label, "fault_plan": {"kind": plan.kind, "rate": plan.rate, "seed": plan.seed},
        "emulated": "timeout, throttle, straggler and store faults are injected at the "
                    "harness; crash SIGKILLs a real worker process" if plan.kind != "none"
                    else None,
        "offered_rps": (len(arrivals) - 1) / arrivals[-1][0] if arrivals[-1][0] > 0 else None,
        "accepted": r.accepted, "completed": r.completed, "failed": r.failed, "lost": r.lost,
        "outputs_equal_monolithic": r.outputs_equal, "errors": sorted(set(r.errors))[:5],
        "completed_per_window": windows.tolist(), "window_s": WINDOW_S,
        "min_completed_in_a_window": int(windows.min()) if len(windows) else 0,
        "latency_p50_s": float(np.percentile(lat, 50)) if lat else None,
        "latency_p99_s": float(np.percentile(lat, 99)) if lat else None,
        "faults_injected": r.injected, "retries": r.retries + r.store_retries,
        "cost_usd": r.cost_usd, "failed_attempts_billed": r.failed_attempts,
        "failed_attempt_cost_usd": r.failed_attempt_cost_usd, "wall_s": r.wall_s,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--load", type=float, default=0.8, help="share of measured capacity")
    ap.add_argument("--rate", type=float, default=0.05, help="fault rate (0..1)")
    ap.add_argument("--capacity-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args(argv)
    if not 0.0 < a.minutes <= 24 * 60:
        ap.error(f"--minutes must be in (0, 1440], got {a.minutes}")
    if not 0.0 < a.load <= 1.0:
        ap.error(f"--load must be in (0, 1] (a share of capacity), got {a.load}")
    if not 0.0 <= a.rate <= 1.0:
        ap.error(f"--rate must be in [0, 1], got {a.rate}")
    if not 8 <= a.capacity_requests <= 10_000:
        ap.error(f"--capacity-requests must be in [8, 10000], got {a.capacity_requests}")
    spec = load_platform("aws-lambda")
    adapter = HFMoEAdapter(tiny_model("mixtral"))
    plan = DeploymentPlan.uniform("mixtral", spec.name, adapter.moe_layers,
                                  [adapter.num_experts(x) for x in adapter.moe_layers],
                                  adapter.num_layers, 512, method="storage")
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="moefleet-soak-") as tmp:
        store = LocalObjectStore(Path(tmp) / "store")
        backend = LocalBackend(spec, store=store, workers=2)
        try:
            dep = deploy_plan(adapter, plan, spec, store, backend=backend)
            none = FaultPlan("none", 0.0)
            burst = prompts(a.capacity_requests, a.seed)
            run(adapter, dep, backend, store, spec, none, [(0.0, p) for p in burst[:16]],
                "warm-up")
            cap = run(adapter, dep, backend, store, spec, none, [(0.0, p) for p in burst],
                      "capacity")
            capacity = cap["completed"] / cap["wall_s"]
            rps = a.load * capacity
            rng = np.random.default_rng(a.seed)
            n = max(2, int(rps * a.minutes * 60))
            times = np.concatenate([[0.0], np.cumsum(rng.exponential(1 / rps, n - 1))])
            soak_prompts = prompts(n, a.seed + 1)
            print(f"capacity {capacity:.2f} req/s; soak: {n} requests at {rps:.2f} req/s "
                  f"({a.load:.0%}) for {a.minutes:g} min, mixed faults at {a.rate:.0%}",
                  file=sys.stderr, flush=True)
            soak = run(adapter, dep, backend, store, spec,
                       FaultPlan("mixed", a.rate, seed=a.seed, straggle_s=0.05,
                                 timeout_s=0.05),
                       list(zip(times.tolist(), soak_prompts, strict=True)), "soak")
        finally:
            backend.teardown()
    report = {
        "command": "python benchmarks/faults_soak.py " + " ".join(argv or sys.argv[1:]),
        "model": "tiny-mixtral (random weights, 3 MoE layers x 8 experts), local backend, "
                 "storage method, 2 worker processes",
        "capacity_rps": capacity, "load": a.load, "minutes": a.minutes,
        "capacity_run": cap, "soak": soak, "lost": soak["lost"],
        "wall_s": time.perf_counter() - t_all,
        "machine": {"cpus": os.cpu_count(), "platform": pyplatform.platform()},
    }
    write_json_atomic(a.out, report)
    s = soak
    print(f"soak: accepted {s['accepted']} completed {s['completed']} failed {s['failed']} "
          f"lost {s['lost']}; equal {s['outputs_equal_monolithic']}; faults "
          f"{s['faults_injected']}; min completions per minute "
          f"{s['min_completed_in_a_window']}; wrote {a.out}")
    return report


if __name__ == "__main__":
    main()
