"""BrownoutServe under a burst: zero brownout vs SALC, same arrivals, same engine.

Poisson arrivals whose rate doubles a third of the way in (the paper: 250 s, doubling at
75 s; here ``--duration`` s scaled to what 2 cores run). The base rate is set from a
measured capacity: ``--loads`` × the zero-brownout throughput at overload, one run pair
per load (the paper does not give its base load relative to capacity; its Fig. 11 shows
both systems within the SLO before the burst, so several loads are reported side by
side). SLOs (``--slo-from base``, the default): 1.25 × zero brownout's own P90 TTFT and
TPOT before the burst, per load, so that the plain server meets them until the burst as
in the paper's Fig. 11 (its vLLM run peaks 24% / 60% over the SLO in the burst);
``--slo-from unloaded``: ``--slo-factor`` (3) × the unloaded medians. A token
violates its SLO when its latency exceeds it: a request's first token against the TTFT
SLO (prefill; queueing included), every later token's gap against the TPOT SLO
(decode). The engine's own step times are reported too: the P90 of prefill and decode
step latencies (what the paper's Fig. 11 plots), with no queueing in them.
``violation_reduction`` = 1 - SALC's violating share / zero's, per phase and load.

SALC's clock is scaled with the trace: its window and check interval are the defaults
(5 s, 1 s) × ``--duration`` / 250, so the controller sees as many checks per burst as
it would on the paper's 250 s trace (``--salc-scale`` overrides the factor).

    python benchmarks/brownout_burst.py [--duration 30] [--loads 0.4,0.5,0.6]
        [--slo-from base|unloaded] [--device cuda]
writes benchmarks/results/brownout_burst.json and brownout_burst.png (P90 latency and
the threshold over time, for the first load); ``_cuda`` before the suffix for
``--device cuda``.
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
from moefleet.compose.presets import brownout_engine
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


def step_p90s(engine, start_s: float) -> dict[str, float | None]:
    """P90 of the engine's own step latencies by kind (a step with more tokens than
    rows ran some prompt tokens: prefill)."""
    steps = engine.stats.steps
    pre = [s.total_s for s in steps if s.num_tokens > s.num_rows]
    dec = [s.total_s for s in steps if s.num_tokens == s.num_rows]
    return {"prefill_step_p90_s": float(np.percentile(pre, 90)) if pre else None,
            "decode_step_p90_s": float(np.percentile(dec, 90)) if dec else None}


def phase_shares(samples, slo: float, split: float) -> dict[str, float]:
    before = [x for x in samples if x[0] < split]
    after = [x for x in samples if x[0] >= split]
    return {"base": share_over(before, slo), "burst": share_over(after, slo)}


def p90_before(samples, split: float) -> float:
    xs = [lat for ts, lat in samples if ts < split]
    return float(np.percentile(xs, 90)) if xs else float("nan")


def replay_run(adapter, arrivals, a, ways, control, kw) -> dict:
    opened = brownout_engine(adapter, ways=ways, salc=control, **kw)
    engine, hook = opened.engine, opened.salc
    start = engine.clock()
    outs = replay(engine, arrivals, max_wall_s=10 * a.duration + 600)
    first, later = token_latencies(outs)
    first = [(ts - start, x) for ts, x in first]
    later = [(ts - start, x) for ts, x in later]
    th = [(round(now - start, 3), kind, t) for now, kind, t in hook.trace] if hook else []
    return {"first": first, "later": later, "trace": th, "steps": step_p90s(engine, start),
            "end": max(ts for ts, _ in first + later)}


def summarise(r: dict, a, slo_ttft: float, slo_tpot: float) -> dict:
    split = a.duration / 3
    burst_th = [t for x, _, t in r["trace"] if x >= split]
    return {
        "prefill_violation_share": share_over(r["first"], slo_ttft),
        "decode_violation_share": share_over(r["later"], slo_tpot),
        "prefill_violation_by_phase": phase_shares(r["first"], slo_ttft, split),
        "decode_violation_by_phase": phase_shares(r["later"], slo_tpot, split),
        **r["steps"],
        "median_threshold_in_burst": float(np.median(burst_th)) if burst_th else 1.0,
        "p90_ttft_series": p90_series(r["first"], 0.0, a.duration / 30, r["end"]),
        "p90_tpot_series": p90_series(r["later"], 0.0, a.duration / 30, r["end"]),
        "threshold_trace": r["trace"], "makespan_s": r["end"]}


def run_pair(adapter, arrivals, a, unloaded_slos, kw) -> dict:
    """Zero brownout first; with ``--slo-from base`` its pre-burst P90s set the SLOs
    (zero's run does not depend on them), then SALC runs against those SLOs."""
    zero = replay_run(adapter, arrivals, a, None, None, kw)
    if a.slo_from == "base":
        slo_ttft = a.slo_factor * p90_before(zero["first"], a.duration / 3)
        slo_tpot = a.slo_factor * p90_before(zero["later"], a.duration / 3)
    else:
        slo_ttft, slo_tpot = unloaded_slos
    scale = a.salc_scale if a.salc_scale is not None else a.duration / 250.0
    salc = SALC(slo_ttft, slo_tpot, window_s=5.0 * scale, interval_s=1.0 * scale)
    runs = {"zero": summarise(zero, a, slo_ttft, slo_tpot),
            "salc": summarise(replay_run(adapter, arrivals, a, a.ways, salc, kw), a,
                              slo_ttft, slo_tpot)}
    for name, r in runs.items():
        print(name, {k: v for k, v in r.items() if "share" in k or "p90_s" in k}, flush=True)
    red = {}
    for phase in ("prefill", "decode"):
        z = runs["zero"][f"{phase}_violation_share"]
        red[phase] = 1 - runs["salc"][f"{phase}_violation_share"] / z if z > 0 else None
    return {"runs": runs, "violation_reduction": red, "salc_scale": scale,
            "slo_ttft_s": slo_ttft, "slo_tpot_s": slo_tpot}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-moe-lm-e32")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--loads", default="0.4,0.5,0.6", help="base rates / capacity")
    ap.add_argument("--slo-from", choices=("base", "unloaded"), default="base")
    ap.add_argument("--slo-factor", type=float, default=None,
                    help="x zero's pre-burst P90 (base; default 1.25) or x the unloaded "
                         "median (unloaded; default 3)")
    ap.add_argument("--ways", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=64)
    ap.add_argument("--output", type=int, default=24)
    ap.add_argument("--kernel", default="loop")
    ap.add_argument("--salc-scale", type=float, default=None)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    a = ap.parse_args(argv)
    if not 5 <= a.duration <= 1800:
        raise SystemExit("error: --duration must be in [5, 1800] s")
    try:
        loads = [float(x) for x in a.loads.split(",")]
    except ValueError:
        raise SystemExit(f"error: --loads {a.loads!r} is not a comma list of numbers") from None
    if not loads or len(loads) > 8 or not all(0 < x <= 2 for x in loads):
        raise SystemExit("error: --loads takes 1 to 8 values in (0, 2]")
    if a.salc_scale is not None and not 0 < a.salc_scale <= 10:
        raise SystemExit("error: --salc-scale must be in (0, 10]")
    if a.slo_factor is None:
        a.slo_factor = 1.25 if a.slo_from == "base" else 3.0
    if not 1 <= a.slo_factor <= 100:
        raise SystemExit("error: --slo-factor must be in [1, 100]")
    torch.set_num_threads(1)
    adapter = zoo.load(a.model)
    tok = adapter.tokenizer
    texts = [p.text for p in load_prompts("sharegpt", limit=400)]
    pool = [tok.encode(t)[: a.max_prompt] or [0] for t in texts]
    params = SamplingParams(max_tokens=a.output, temperature=0, ignore_eos=True)
    kw = {"kernel": a.kernel, "max_num_seqs": 32, "device": a.device}

    # 1. unloaded latencies -> SLOs; 2. capacity at overload -> base rates
    engine = brownout_engine(adapter, ways=None, **kw).engine
    solo = replay(engine, [(0.0, pool[i], params) for i in range(4)])
    unloaded = (statistics.median(o.times.ttft_s for o in solo),
                statistics.median(o.times.tpot_s for o in solo))
    slo_ttft, slo_tpot = (a.slo_factor * x for x in unloaded)
    engine = brownout_engine(adapter, ways=None, **kw).engine
    t0 = time.perf_counter()
    replay(engine, [(0.0, pool[i % len(pool)], params) for i in range(64)])
    capacity = 64 / (time.perf_counter() - t0)  # requests/s
    print(f"unloaded TTFT {unloaded[0]:.3f} s, TPOT {unloaded[1]:.3f} s; capacity "
          f"{capacity:.2f} req/s", flush=True)
    per_load = {}
    for load in loads:
        base = load * capacity
        rng = np.random.default_rng(7)
        t, arrivals, i = 0.0, [], 0
        while True:
            t += rng.exponential(1 / (base if t < a.duration / 3 else 2 * base))
            if t >= a.duration:
                break
            arrivals.append((t, pool[i % len(pool)], params))
            i += 1
        print(f"load {load}: base {base:.2f} req/s, {len(arrivals)} requests", flush=True)
        per_load[str(load)] = {"load": load, "base_rate": base, "requests": len(arrivals),
                               **run_pair(adapter, arrivals, a, (slo_ttft, slo_tpot), kw)}
    res = {"model": a.model, "device": a.device, "duration_s": a.duration,
           "capacity_req_s": capacity,
           "unloaded_ttft_s": unloaded[0], "unloaded_tpot_s": unloaded[1],
           "slo_from": a.slo_from, "slo_factor": a.slo_factor, "ways": a.ways,
           "kernel": a.kernel, "torch_threads": 1, "loads": per_load,
           "violation_reduction": {k: v["violation_reduction"] for k, v in per_load.items()}}
    RESULTS.mkdir(exist_ok=True)
    stem = "brownout_burst" + ("" if a.device == "cpu" else "_cuda")
    write_text_atomic(RESULTS / f"{stem}.json",
                      json.dumps(res, indent=2, sort_keys=True) + "\n")
    first = per_load[str(loads[0])]
    plot(first["runs"], a.duration, first["slo_ttft_s"], first["slo_tpot_s"], loads[0],
         a.device, RESULTS / f"{stem}.png")
    print(json.dumps({"violation_reduction": res["violation_reduction"]}))
    return 0


def plot(runs, duration: float, slo_ttft: float, slo_tpot: float, load: float,
         device: str, out: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    width = duration / 30
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
        ax.axvline(duration / 3, color="red", lw=0.8)
        ax.legend()
    where = "CPU, 1 thread" if device == "cpu" else f"{device}, 1 host thread"
    ax1.set_title(f"load {load} of capacity before the burst, 2x after ({where})")
    ax1.set_ylabel("P90 TTFT (s)")
    ax2.set_ylabel("P90 TPOT (s)")
    ax3.set_ylabel("threshold")
    ax3.set_xlabel("time (s); rate doubles at the red line")
    save_png(fig, out)


if __name__ == "__main__":
    raise SystemExit(main())
