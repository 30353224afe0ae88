"""Engine throughput vs HF ``generate`` (static batches, and one request at a time).

Workload: ShareGPT prompts (first human turns, tokenised and cut to ``--max-prompt``
tokens), output lengths drawn from the Azure LLM 2023 conversation trace (capped at
``--max-output``), greedy, end-of-sequence ignored so every request produces exactly its
length. Side by side in one run, on one device:

- engine, stacked expert kernel and per-expert loop (continuous batching, up to
  ``--max-num-seqs`` running);
- HF ``generate`` in static batches of the same maximum size (a batch runs until its
  longest request is done; only requested tokens count);
- HF ``generate`` one request at a time, on the first ``--sequential`` prompts (timing
  all would take hours on 2 cores; throughput is a rate, so the subset is comparable).

Outputs are checked: the engine's greedy tokens must equal HF's one-at-a-time tokens on
the sequential subset (the exact reference) and are compared with the static batches
(left padding changes fp32 rounding, so near-ties may flip: the match rate is reported).
Bookkeeping = step time minus model forward, over steps with ``--max-num-seqs`` running.

    python benchmarks/engine_throughput.py [--prompts 200] [--device cuda]
writes benchmarks/results/engine_throughput.json (and _cuda.json for --device cuda).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from hf_baseline import run_hf  # benchmarks/ is on sys.path when run as a script

from moefleet.compose.presets import build_engine
from moefleet.data.registry import load_prompts
from moefleet.engine import SamplingParams
from moefleet.io import write_text_atomic
from moefleet.models import zoo
from moefleet.workloads.azure_llm import load_azure_llm

RESULTS = Path(__file__).parent / "results"


def workload(tok, n: int, max_prompt: int, max_output: int, seed: int):
    prompts = [p.text for p in load_prompts("sharegpt", limit=n)]
    ids = [tok.encode(t)[:max_prompt] or [0] for t in prompts]
    trace = load_azure_llm("conv")
    rng = np.random.default_rng(seed)
    lens = np.minimum(rng.choice(trace.output_tokens, size=len(ids)), max_output)
    return ids, [max(1, int(x)) for x in lens]


def run_engine(adapter, ids, lens, kernel: str, max_num_seqs: int, device: str):
    engine = build_engine(adapter, device=device, kernel=kernel,  # type: ignore[arg-type]
                          max_num_seqs=max_num_seqs)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lens]
    t0 = time.perf_counter()
    outs = engine.generate(ids, params)
    wall = time.perf_counter() - t0
    full = [s for s in engine.stats.steps if s.num_running == max_num_seqs]
    book = [(s.total_s - s.forward_s) / s.total_s for s in full if s.total_s > 0]
    return [o.new_token_ids for o in outs], wall, {
        "steps": len(engine.stats.steps), "preemptions": engine.scheduler.num_preemptions,
        "bookkeeping_share_median": statistics.median(book) if book else None,
        "steps_at_max_num_seqs": len(full)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-moe-lm")
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--sequential", type=int, default=20)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if not (1 <= a.prompts <= 5000 and 1 <= a.sequential <= a.prompts):
        sys.exit("error: need 1 <= --sequential <= --prompts <= 5000")
    adapter = zoo.load(a.model)
    model = adapter.model.to(a.device)
    model.generation_config.eos_token_id = None  # fixed lengths for every method
    ids, lens = workload(adapter.tokenizer, a.prompts, a.max_prompt, a.max_output, a.seed)
    tokens = sum(lens)
    print(f"{len(ids)} prompts, {tokens} output tokens, device {a.device}", flush=True)
    res: dict = {"model": a.model, "device": a.device, "prompts": len(ids),
                 "output_tokens": tokens, "max_num_seqs": a.max_num_seqs,
                 "torch_threads": torch.get_num_threads(), "runs": {}}
    engine_out = {}
    for kernel in ("stacked", "loop"):
        out, wall, extra = run_engine(adapter, ids, lens, kernel, a.max_num_seqs, a.device)
        engine_out[kernel] = out
        res["runs"][f"engine_{kernel}"] = {"wall_s": wall, "tokens_per_s": tokens / wall,
                                           **extra}
        print(f"engine ({kernel}): {tokens / wall:.1f} tok/s", flush=True)
    static, wall, _ = run_hf(model, ids, lens, a.max_num_seqs, a.device)
    res["runs"]["hf_static"] = {"wall_s": wall, "tokens_per_s": tokens / wall}
    print(f"hf static: {tokens / wall:.1f} tok/s", flush=True)
    k = a.sequential
    seq, wall, _ = run_hf(model, ids[:k], lens[:k], 1, a.device)
    res["runs"]["hf_sequential"] = {"wall_s": wall, "tokens_per_s": sum(lens[:k]) / wall,
                                    "prompts": k}
    print(f"hf sequential ({k} prompts): {sum(lens[:k]) / wall:.1f} tok/s", flush=True)
    # the engine's default on this device ("auto": loop on CPU, stacked on GPU)
    default = "loop" if a.device == "cpu" else "stacked"
    res["engine_kernel"] = default
    best = res["runs"][f"engine_{default}"]["tokens_per_s"]
    res["speedup_vs_static"] = best / res["runs"]["hf_static"]["tokens_per_s"]
    res["speedup_vs_sequential"] = best / res["runs"]["hf_sequential"]["tokens_per_s"]
    res["stacked_vs_loop"] = (res["runs"]["engine_stacked"]["tokens_per_s"]
                              / res["runs"]["engine_loop"]["tokens_per_s"])
    res["outputs_equal_sequential"] = all(engine_out[kn][:k] == seq for kn in engine_out)
    res["kernels_agree"] = engine_out["stacked"] == engine_out["loop"]
    res["static_match_rate"] = sum(x == y for x, y in zip(engine_out[default], static,
                                                          strict=True)) / len(ids)
    RESULTS.mkdir(exist_ok=True)
    name = "engine_throughput.json" if a.device == "cpu" else "engine_throughput_cuda.json"
    write_text_atomic(RESULTS / name, json.dumps(res, indent=2, sort_keys=True) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=2))
    return 0 if res["outputs_equal_sequential"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
