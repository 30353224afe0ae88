"""BrownoutServe throughput: brownout configurations vs zero brownout on one engine.

Poisson arrivals at several rates up to overload, prompts from ShareGPT and Alpaca (cut
to ``--max-prompt`` tokens), ``--output`` tokens each (end-of-sequence ignored), on the
zoo's many-expert decoder. Configurations (ways, threshold): zero brownout, (2, 0.0),
(4, 0.2), (8, 0.4), partial brownout with united experts distilled by index; each with
the per-expert ("non-fused", kernel ``loop``) and the stacked ("fused", kernel
``stacked``) expert paths. Throughput = output tokens / (last finish - first arrival);
side by side in one run, one thread.

    python benchmarks/brownout_throughput.py [--requests 48] [--rates 2,8,1000] [--device cuda]
writes benchmarks/results/brownout_throughput.json (``speedup_vs_zero`` per
configuration, path and rate) and brownout_throughput.png (``_cuda`` before the suffix
for ``--device cuda``; on CUDA the expert-path timer synchronises the device around each
call, so the profile pass's step is slightly slower than the throughput rows').

A separate profile pass (all requests at once, loop kernel) times the expert path (the
ExpertFn the engine calls, brownout routing included) and counts expert accesses per
MoE layer call, so the JSON also gives ``expert_share`` (expert path / step time),
``expert_path_speedup`` and the Amdahl ceiling ``1 / ((1 - f) + f / s)`` that the
expert-path speedup ``s`` allows when the expert path is a share ``f`` of zero
brownout's step time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from moefleet.compose.presets import brownout_engine
from moefleet.data.registry import load_prompts
from moefleet.engine import SamplingParams
from moefleet.engine.replay import replay
from moefleet.io import write_text_atomic
from moefleet.models import zoo
from moefleet.report.figures import pyplot, save_png

RESULTS = Path(__file__).parent / "results"
CONFIGS = [(None, 1.0), (2, 0.0), (4, 0.2), (8, 0.4)]


def prompts(tok, n: int, max_prompt: int) -> list[list[int]]:
    texts = [p.text for p in load_prompts("sharegpt", limit=n)]
    texts += [p.text for p in load_prompts("alpaca", limit=n)]
    rng = np.random.default_rng(0)
    order = rng.permutation(len(texts))[:n]
    return [tok.encode(texts[i])[:max_prompt] or [0] for i in order]


class TimedExperts:
    """Times an ExpertFn and counts the distinct experts each layer call routes to."""

    def __init__(self, inner, device: str) -> None:
        self.inner, self.seconds, self.calls, self.routed = inner, 0.0, 0, 0
        # CUDA launches are asynchronous: without a sync the timer sees launch time only
        self.sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def __call__(self, layer, x_ND, ids_NK, w_NK):
        self.sync()
        t0 = time.perf_counter()
        y = self.inner(layer, x_ND, ids_NK, w_NK)
        self.sync()
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.routed += int(torch.unique(ids_NK).numel())
        return y


def profile_pass(adapter, ids, params, max_wall: float, device: str) -> list[dict]:
    """Expert-path time and accesses at overload, loop kernel, per configuration."""
    arrivals = [(0.0, p, params) for p in ids]
    rows = []
    for ways, th in CONFIGS:
        timers: list[TimedExperts] = []

        def wrap(fn, timers=timers):
            timers.append(TimedExperts(fn, device))
            return timers[-1]

        opened = brownout_engine(adapter, ways=ways, threshold=th, kernel="loop",
                                 wrap=wrap, device=device)
        engine, experts = opened.engine, opened.brownout
        t0 = time.perf_counter()
        replay(engine, arrivals, max_wall_s=max_wall)
        wall = time.perf_counter() - t0
        tm = timers[0]
        if experts is not None:
            st = experts.stats
            accesses = (st.original_accesses + st.united_accesses) / max(st.calls, 1)
        else:
            accesses = tm.routed / max(tm.calls, 1)
        rows.append({"ways": ways or "zero", "threshold": th, "wall_s": wall,
                     "expert_path_s": tm.seconds, "expert_share": tm.seconds / wall,
                     "experts_routed_per_layer_call": tm.routed / max(tm.calls, 1),
                     "expert_accesses_per_layer_call": accesses})
        print(json.dumps(rows[-1]), flush=True)
    zero = rows[0]
    f = zero["expert_share"]
    for r in rows:
        s = zero["expert_path_s"] / r["expert_path_s"]
        r["expert_path_speedup"] = s
        r["speedup_vs_zero"] = zero["wall_s"] / r["wall_s"]
        r["amdahl_ceiling"] = 1 / ((1 - f) + f / s)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-moe-lm-e32")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rates", default="2,8,1000", help="requests/s; 1000 = all at once")
    ap.add_argument("--max-prompt", type=int, default=96)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--kernels", default="loop,stacked")
    ap.add_argument("--max-wall", type=float, default=600.0)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    a = ap.parse_args(argv)
    if not 1 <= a.requests <= 2000:
        sys.exit("error: --requests must be in [1, 2000]")
    torch.set_num_threads(1)
    adapter = zoo.load(a.model)
    ids = prompts(adapter.tokenizer, a.requests, a.max_prompt)
    params = SamplingParams(max_tokens=a.output, temperature=0, ignore_eos=True)
    rows = []
    for rate in [float(r) for r in a.rates.split(",")]:
        t = np.cumsum(np.random.default_rng(1).exponential(1 / rate, size=len(ids)))
        t -= t[0]
        arrivals = [(float(ti), p, params) for ti, p in zip(t, ids, strict=True)]
        for kernel in a.kernels.split(","):
            for ways, th in CONFIGS:
                opened = brownout_engine(adapter, ways=ways, threshold=th, kernel=kernel,
                                         device=a.device)
                engine, experts = opened.engine, opened.brownout
                t0 = time.perf_counter()
                outs = replay(engine, arrivals, max_wall_s=a.max_wall)
                wall = time.perf_counter() - t0
                tokens = sum(len(o.new_token_ids) for o in outs)
                assert tokens == a.output * len(ids)
                end = max(o.times.finished for o in outs)  # type: ignore[union-attr]
                start = min(o.times.arrival for o in outs)  # type: ignore[union-attr]
                row = {"rate": rate, "kernel": kernel, "ways": ways or "zero",
                       "threshold": th, "tokens_per_s": tokens / (end - start),
                       "wall_s": wall}
                if experts is not None:
                    st = experts.stats
                    pairs = st.original_pairs + st.united_pairs + st.dropped_pairs
                    row["share_pairs_original"] = st.original_pairs / max(pairs, 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
    for r in rows:
        zero = next(z for z in rows if z["rate"] == r["rate"] and z["kernel"] == r["kernel"]
                    and z["ways"] == "zero")
        r["speedup_vs_zero"] = r["tokens_per_s"] / zero["tokens_per_s"]
    profile = profile_pass(adapter, ids, params, a.max_wall, a.device)
    res = {"model": a.model, "device": a.device, "requests": len(ids),
           "output_tokens": a.output,
           "max_prompt": a.max_prompt, "torch_threads": 1, "rows": rows,
           "profile_overload_loop": profile}
    RESULTS.mkdir(exist_ok=True)
    stem = "brownout_throughput" + ("" if a.device == "cpu" else "_cuda")
    write_text_atomic(RESULTS / f"{stem}.json",
                      json.dumps(res, indent=2, sort_keys=True) + "\n")
    plt = pyplot()
    fig, axes = plt.subplots(1, len(a.kernels.split(",")), figsize=(10, 4), squeeze=False)
    for ax, kernel in zip(axes[0], a.kernels.split(","), strict=True):
        for ways, th in CONFIGS:
            pts = [r for r in rows if r["kernel"] == kernel and r["ways"] == (ways or "zero")]
            ax.plot([r["rate"] for r in pts], [r["tokens_per_s"] for r in pts], marker="o",
                    label="zero" if ways is None else f"({ways}, {th})")
        ax.set_xscale("log")
        ax.set_title(f"{kernel} experts ({a.device})")
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel("output tokens/s")
        ax.legend()
    save_png(fig, RESULTS / f"{stem}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
