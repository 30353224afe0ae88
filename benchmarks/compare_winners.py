"""Winners per platform and traffic: ``moefleet compare`` on the embedded default model and
on a real shape, every policy, one results JSON per (model, traffic) under
``benchmarks/results/compare/`` and a markdown table of the winners (the README's).

    OMP_NUM_THREADS=1 python benchmarks/compare_winners.py [--quick] [--duration 600]
        [--models gpt2-moe,deepseek-v2-lite] [--traffics azure-llm:conv,azure-fn-2019:bursty]

Each run is the command its JSON records under ``inputs.command``; ``wall_s`` is this
machine's wall time for it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from moefleet.compare.output import write_outputs
from moefleet.compare.run import run_compare
from moefleet.io import write_text_atomic

OUT = Path(__file__).parent / "results" / "compare"
PLATFORMS = ["alibaba-fc-gpu", "aws-lambda"]


def winner(rows: list[dict], platform: str) -> str:
    mine = [r for r in rows if r["platform"] in (platform, "gpu-server")
            and r["absent"] is None and r["cost_per_1m_usd"]]
    ok = sorted((r for r in mine if r["meets_slo"]), key=lambda r: r["cost_per_1m_usd"])
    if ok:
        w = ok[0]
        return f"{w['policy']} (${w['cost_per_1m_usd']:.3g}/1M, {w['fidelity']})"
    if not mine:
        return "none ran"
    best = max(mine, key=lambda r: (r["slo_attainment"] or 0, -r["cost_per_1m_usd"]))
    return f"none meets; closest {best['policy']} ({100 * (best['slo_attainment'] or 0):.0f}%)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2-moe,deepseek-v2-lite")
    ap.add_argument("--traffics", default="azure-llm:conv,azure-llm:code,azure-fn-2019:bursty")
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--slo-ttft", type=float, default=20.0)
    ap.add_argument("--slo-tpot", type=float, default=0.2)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    lines = ["| model | traffic | " + " | ".join(PLATFORMS) + " | wall (s) |",
             "|---|---|" + "---|" * len(PLATFORMS) + "---|"]
    for model in args.models.split(","):
        for traffic in args.traffics.split(","):
            t0 = time.perf_counter()
            cmd = (f"moefleet compare --model {model} --traffic {traffic} --platform "
                   f"{','.join(PLATFORMS)} --slo-ttft {args.slo_ttft:g} --slo-tpot "
                   f"{args.slo_tpot:g} --duration {args.duration:g}"
                   + (" --quick" if args.quick else ""))
            res = run_compare(model=model, traffic=traffic, platforms=PLATFORMS,
                              slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                              duration_s=args.duration, quick=args.quick, command=cmd,
                              say=lambda m: print(f"  {m}", flush=True))
            data = res.to_dict()
            name = f"{model}_{traffic.replace(':', '-')}"
            write_outputs(data, OUT / name)
            wins = [winner(data["rows"], p) for p in PLATFORMS]
            lines.append(f"| {model} | {traffic} | " + " | ".join(wins)
                         + f" | {time.perf_counter() - t0:.0f} |")
            print(lines[-1], flush=True)
    # merge with the rows of earlier runs (other models or traffics)
    old = OUT / "winners.md"
    done = {tuple(c.strip() for c in ln.split("|")[1:3]) for ln in lines[2:]}
    if old.is_file():
        for ln in old.read_text().splitlines()[2:]:
            if tuple(c.strip() for c in ln.split("|")[1:3]) not in done:
                lines.append(ln)
    write_text_atomic(old, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
