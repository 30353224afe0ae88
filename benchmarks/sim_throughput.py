"""Simulator speed: SimPy events per second, and one hour of the Azure LLM conv trace.

Two measurements on a synthetic 12-block x 8-expert, top-2 model (hidden 768, estimated
compute profile), LambdaML-style uniform plan (10240 MB per function, direct transfers)
on aws-lambda, batched decode:

- ``events``: a Poisson workload (``--rate`` req/s, 128-token prompts, 32 output tokens)
  for ``--duration`` simulated seconds, ``--repeats`` times; median events/s;
- ``azure_hour``: the whole Azure LLM inference 2023 ``conv`` trace (19,366 requests over
  ~3,500 s, their own prompt and output lengths); wall and CPU seconds for the run.

Both wall-clock and process CPU time are reported: on a shared machine the wall time
includes time the process waited for a core. Writes benchmarks/results/sim_throughput.json.

    python benchmarks/sim_throughput.py [--repeats 3] [--skip-azure]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from moefleet.io import write_json_atomic
from moefleet.plan import DeploymentPlan
from moefleet.sim import SimConfig, Simulator
from moefleet.sim.synthetic import SyntheticModel
from moefleet.workloads import PoissonWorkload, load_workload

RESULTS = Path(__file__).resolve().parent / "results" / "sim_throughput.json"
MODEL = SyntheticModel(blocks=12, experts=8, top_k=2, hidden=768)
MEMORY_MB = 10240


def simulator(cfg: SimConfig, seed: int = 0) -> Simulator:
    profile = MODEL.profile()
    plan = DeploymentPlan.uniform(MODEL.name, "aws-lambda", profile.moe_layers,
                                  [MODEL.experts] * MODEL.blocks, MODEL.blocks, MEMORY_MB)
    return Simulator(plan, profile, "aws-lambda", config=cfg, seed=seed, top_k=MODEL.top_k)


def timed(sim: Simulator, workload: Any, duration: float) -> dict[str, Any]:
    wall0, cpu0 = time.perf_counter(), time.process_time()
    res = sim.run(workload, duration)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return {"wall_s": wall, "cpu_s": cpu, "events": res.events, "invocations": res.invocations,
            "events_per_s_wall": res.events / wall, "events_per_s_cpu": res.events / cpu,
            "requests": res.requests["completed"], "cost_usd": res.cost.total,
            "latency_mean_s": res.latency["mean"], "latency_p95_s": res.latency["p95"],
            "ttft_p95_s": res.ttft["p95"], "tpot_mean_s": res.tpot["mean"],
            "cold_starts": res.cold_starts, "makespan_s": res.makespan_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=5.0)
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-azure", action="store_true")
    args = ap.parse_args()
    cfg = SimConfig(prompt_tokens=128, output_tokens=32)
    runs = [timed(simulator(cfg, seed), PoissonWorkload(args.rate), args.duration)
            for seed in range(args.repeats)]
    events = {
        "workload": f"poisson:rate={args.rate:g}", "duration_s": args.duration,
        "runs": runs,
        "median_events_per_s_wall": statistics.median(r["events_per_s_wall"] for r in runs),
        "median_events_per_s_cpu": statistics.median(r["events_per_s_cpu"] for r in runs),
    }
    print(f"events/s: median {events['median_events_per_s_wall']:.0f} (wall), "
          f"{events['median_events_per_s_cpu']:.0f} (CPU)")
    out: dict[str, Any] = {
        "command": "python benchmarks/sim_throughput.py",
        "model": MODEL.name, "memory_mb": MEMORY_MB, "platform": "aws-lambda",
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "load_avg": os.getloadavg()},
        "events": events,
    }
    if not args.skip_azure:
        azure = timed(simulator(SimConfig()), load_workload("azure-llm:trace=conv"), 3600.0)
        out["azure_hour"] = {"workload": "azure-llm:trace=conv", "duration_s": 3600.0, **azure}
        print(f"Azure conv hour: {azure['wall_s']:.1f} s wall, {azure['cpu_s']:.1f} s CPU, "
              f"{azure['events']} events, {azure['requests']} requests")
    out["machine"]["load_avg_after"] = os.getloadavg()
    write_json_atomic(RESULTS, out)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
