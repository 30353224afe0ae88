"""BrownoutServe under a burst: zero brownout vs SALC, same arrivals, same engine.

Poisson arrivals whose rate doubles a third of the way in (the paper: 250 s, doubling at
75 s; here ``--duration`` s scaled to what 2 cores run). The base rate is set from a
measured capacity: ``--load`` × the zero-brownout throughput at overload, so the burst
pushes the engine past what it can serve. SLOs: ``--slo-factor`` × the unloaded TTFT
and TPOT measured first. A token violates its SLO when its latency exceeds it: a
request's first token against the TTFT SLO (prefill), every later token's gap against
the TPOT SLO (decode). ``violation_reduction`` = 1 - SALC's violating share / zero's.

    python benchmarks/brownout_burst.py [--duration 60]
writes benchmarks/results/brownout_burst.json and brownout_burst.png (P90 latency and
the threshold over time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from moefleet.brownout.salc import SALC
from moefleet.brownout.serving import brownout_engine
from moefleet.data.registry import load_prompts
from moefleet.engine import SamplingParams
from moefleet.engine.replay import replay
from moefleet.io import write_text_atomic
from moefleet.models import zoo
from moefleet.report.figures import pyplot, save_png

RESULTS = Path(__file__).parent / "results"


def token_latencies(outs) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(time, latency) of every first token (TTFT) and every later token (gap)."""
    first, later = [], []
    for o in outs:
        t = o.times
        first.append((t.token_times[0], t.token_times[0] - t.arrival))
        later += [(b, b - a) for a, b in zip(t.token_times, t.token_times[1:], strict=False)]
    return first, later


def share_over(samples: list[tuple[float, float]], slo: float) -> float:
    return sum(lat > slo for _, lat in samples) / max(len(samples), 1)


def p90_series(samples, start: float, width: float, end: float) -> list[float | None]:
    out: list[float | None] = []
    t = start
    while t < end:
        xs = [lat for ts, lat in samples if t <= ts < t + width]
        out.append(float(np.percentile(xs, 90)) if xs else None)
        t += width
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-moe-lm-e32")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--load", type=float, default=0.7, help="base rate / capacity")
    ap.add_argument("--slo-factor", type=float, default=3.0)
    ap.add_argument("--ways", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=64)
    ap.add_argument("--output", type=int, default=24)
    ap.add_argument("--kernel", default="loop")
    a = ap.parse_args(argv)
    if not 5 <= a.duration <= 1800:
        raise SystemExit("error: --duration must be in [5, 1800] s")
    torch.set_num_threads(1)
    adapter = zoo.load(a.model)
    tok = adapter.tokenizer
    texts = [p.text for p in load_prompts("sharegpt", limit=400)]
    pool = [tok.encode(t)[: a.max_prompt] or [0] for t in texts]
    params = SamplingParams(max_tokens=a.output, temperature=0, ignore_eos=True)
    kw = {"kernel": a.kernel, "max_num_seqs": 32}

    # 1. unloaded latencies -> SLOs; 2. capacity at overload -> base rate
    engine, _, _ = brownout_engine(adapter, ways=None, **kw)
    solo = replay(engine, [(0.0, pool[i], params) for i in range(4)])
    slo_ttft = a.slo_factor * statistics.median(o.times.ttft_s for o in solo)
    slo_tpot = a.slo_factor * statistics.median(o.times.tpot_s for o in solo)
    engine, _, _ = brownout_engine(adapter, ways=None, **kw)
    t0 = time.perf_counter()
    replay(engine, [(0.0, pool[i % len(pool)], params) for i in range(64)])
    capacity = 64 / (time.perf_counter() - t0)  # requests/s
    base = a.load * capacity
    rng = np.random.default_rng(7)
    t, arrivals, i = 0.0, [], 0
    while True:
        t += rng.exponential(1 / (base if t < a.duration / 3 else 2 * base))
        if t >= a.duration:
            break
        arrivals.append((t, pool[i % len(pool)], params))
        i += 1
    print(f"SLO TTFT {slo_ttft:.3f} s, TPOT {slo_tpot:.3f} s; capacity {capacity:.2f} req/s;"
          f" {len(arrivals)} requests", flush=True)
    runs = {}
    salc = SALC(slo_ttft, slo_tpot)
    for name, ways, control in (("zero", None, None), ("salc", a.ways, salc)):
        engine, _, hook = brownout_engine(adapter, ways=ways, salc=control, **kw)
        start = engine.clock()
        outs = replay(engine, arrivals, max_wall_s=10 * a.duration + 600)
        first, later = token_latencies(outs)
        first = [(ts - start, x) for ts, x in first]
        later = [(ts - start, x) for ts, x in later]
        end = max(ts for ts, _ in first + later)
        runs[name] = {
            "prefill_violation_share": share_over(first, slo_ttft),
            "decode_violation_share": share_over(later, slo_tpot),
            "p90_ttft_series": p90_series(first, 0.0, a.duration / 30, end),
            "p90_tpot_series": p90_series(later, 0.0, a.duration / 30, end),
            "threshold_trace": ([(round(now - start, 3), kind, th) for now, kind, th
                                 in hook.trace] if hook else []),
            "makespan_s": end}
        print(name, {k: v for k, v in runs[name].items() if "share" in k}, flush=True)
    red = {}
    for phase in ("prefill", "decode"):
        z = runs["zero"][f"{phase}_violation_share"]
        red[phase] = 1 - runs["salc"][f"{phase}_violation_share"] / z if z > 0 else None
    res = {"model": a.model, "duration_s": a.duration, "requests": len(arrivals),
           "base_rate": base, "capacity_req_s": capacity, "slo_ttft_s": slo_ttft,
           "slo_tpot_s": slo_tpot, "ways": a.ways, "kernel": a.kernel,
           "violation_reduction": red, "runs": runs}
    RESULTS.mkdir(exist_ok=True)
    write_text_atomic(RESULTS / "brownout_burst.json",
                      json.dumps(res, indent=2, sort_keys=True) + "\n")
    plt = pyplot()
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    width = a.duration / 30
    for name in runs:
        for ax, key, slo in ((ax1, "p90_ttft_series", slo_ttft), (ax2, "p90_tpot_series",
                                                                   slo_tpot)):
            ys = runs[name][key]
            ax.plot([width * (k + 0.5) for k in range(len(ys))], ys, label=name)
            ax.axhline(slo, color="grey", ls="--")
    tr = runs["salc"]["threshold_trace"]
    for kind in ("prefill", "decode"):
        pts = [(x, th) for x, k, th in tr if k == kind]
        ax3.plot([x for x, _ in pts], [th for _, th in pts], ".", ms=2, label=kind)
    for ax in (ax1, ax2, ax3):
        ax.axvline(a.duration / 3, color="red", lw=0.8)
        ax.legend()
    ax1.set_ylabel("P90 TTFT (s)")
    ax2.set_ylabel("P90 TPOT (s)")
    ax3.set_ylabel("threshold")
    ax3.set_xlabel("time (s); rate doubles at the red line")
    save_png(fig, RESULTS / "brownout_burst.png")
    print(json.dumps({"violation_reduction": red}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
