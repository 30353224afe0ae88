"""A simulated bursty hour: a static plan vs the HPA baseline, side by side.

Both runs use the same seeded bursty workload (inter-arrival CV 3), the same synthetic
6-block x 8-expert model and the same platform; only the scaling policy differs.
Writes benchmarks/results/sim_bursty_hour.json and .png (p95 latency and cumulative
billed cost over time).

    python benchmarks/sim_bursty_hour.py [--duration 3600] [--rate 2] [--cv 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from moefleet.io import write_json_atomic
from moefleet.report.figures import pyplot, save_png

plt = pyplot()

RESULTS = Path(__file__).resolve().parent / "results"


def simulate(policy: str, args: argparse.Namespace, out: Path) -> dict:
    exe = Path(sys.executable).parent / "moefleet"
    cmd = [str(exe), "simulate", "-m", args.model, "--memory", str(args.memory),
           "-w", f"bursty:rate={args.rate},cv={args.cv}", "--duration", str(args.duration),
           "--policy", policy, "--slo", str(args.slo), "--seed", str(args.seed),
           "--interval", "60", "-o", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="synthetic:blocks=6,experts=8")
    ap.add_argument("--memory", type=int, default=2048)
    ap.add_argument("--duration", type=float, default=3600)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--cv", type=float, default=3.0)
    ap.add_argument("--slo", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for policy in ("static", "hpa"):
            runs[policy] = simulate(policy, args, Path(tmp) / f"{policy}.json")
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for policy, res in runs.items():
        tl = res["timeline"]
        t = np.array([r["t_s"] for r in tl]) / 60
        ax1.plot(t, [r["p95_latency_s"] for r in tl], label=policy)
        ax2.plot(t, [r["cost_usd"] for r in tl], label=policy)  # already cumulative
        ax3.plot(t, [r["instances"] for r in tl], label=policy)
    first = runs["static"]["timeline"]
    ax1.axhline(args.slo, color="grey", ls="--", lw=1, label="SLO")
    ax1.set_ylabel("p95 latency (s)")
    ax2.set_ylabel("cumulative billed cost ($)")
    ax3.set_ylabel("instances")
    ax3.set_xlabel("minute")
    rate = ax1.twinx()
    rate.bar(np.array([r["t_s"] for r in first]) / 60, [r["arrivals"] for r in first],
             width=0.8, alpha=0.15, color="k")
    rate.set_ylabel("arrivals / interval")
    ax1.legend(loc="upper left")
    fig.suptitle(f"Bursty hour (CV {args.cv}, {args.rate} req/s), {args.model}, "
                 f"{args.memory} MB: static plan vs HPA")
    fig.tight_layout()
    RESULTS.mkdir(exist_ok=True)
    save_png(fig, RESULTS / "sim_bursty_hour.png", dpi=110)
    summary = {
        p: {"cost_usd": r["cost"]["total"], "latency_s": r["latency_s"],
            **{k: r[k] for k in ("slo_violation_rate", "cold_starts", "peak_instances",
                                 "requests", "throughput_rps")}}
        for p, r in runs.items()
    }
    write_json_atomic(RESULTS / "sim_bursty_hour.json", {"args": vars(args), "runs": summary})
    for p, r in summary.items():
        lat = r["latency_s"]
        print(f"{p:7s} cost ${r['cost_usd']:.4f}  mean {lat['mean']:.3f}s  p95 {lat['p95']:.3f}s "
              f" p99 {lat['p99']:.3f}s  SLO viol {r['slo_violation_rate']:.4f}  "
              f"cold {r['cold_starts']}  peak inst {r['peak_instances']}")


if __name__ == "__main__":
    main()
