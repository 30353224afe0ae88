"""Routing-recorder overhead vs the plain forward, on the same batches, side by side.

For each model: tokenise wikitext2 prompts into right-padded batches, then alternate
(plain forward, recorded forward) over the same batches for several repeats. Reports the
median time per repeat of each and their ratio. Writes benchmarks/results/trace_overhead.json.

    python benchmarks/trace_overhead.py [--models tiny-mixtral-random,minilm-moe-e8]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from moefleet.data import load_prompts
from moefleet.io import write_json_atomic
from moefleet.models import load_adapter, zoo
from moefleet.models.base import MoEModelAdapter
from moefleet.traces import RoutingRecorder, tokenize_prompts

RESULTS = Path(__file__).resolve().parent / "results" / "trace_overhead.json"


def batches(adapter: MoEModelAdapter, tokens: int, batch: int, max_len: int):
    prompts = load_prompts("wikitext2", split="train")
    seqs = [s for _, s in tokenize_prompts(adapter, [p.text for p in prompts],
                                           max_tokens=tokens, max_length=max_len)]
    pad = int(getattr(adapter.tokenizer, "pad_token_id", 0) or 0)
    out = []
    for i in range(0, len(seqs), batch):
        chunk = seqs[i : i + batch]
        T = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), T), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, s in enumerate(chunk):
            ids[b, : len(s)] = torch.tensor(s)
            mask[b, : len(s)] = 1
        out.append((ids, mask))
    return out


def measure(name: str, tokens: int, repeats: int, batch: int, max_len: int) -> dict:
    adapter = load_adapter(name)
    data = batches(adapter, tokens, batch, max_len)
    plain, recorded = [], []
    with torch.no_grad():
        adapter.reference_forward(*data[0])  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            for ids, mask in data:
                adapter.reference_forward(ids, mask)
            plain.append(time.perf_counter() - t0)
            rec = RoutingRecorder(adapter).attach()
            t0 = time.perf_counter()
            for i, (ids, mask) in enumerate(data):
                rec.record([f"r{i}-{b}" for b in range(ids.shape[0])], ids, mask)
            rec.trace()
            recorded.append(time.perf_counter() - t0)
            rec.detach()
    p, r = statistics.median(plain), statistics.median(recorded)
    return {
        "model": name,
        "tokens": int(sum(int(m.sum()) for _, m in data)),
        "batches": len(data),
        "repeats": repeats,
        "plain_s_median": p,
        "recorded_s_median": r,
        "overhead_ratio": r / p,
        "plain_s": plain,
        "recorded_s": recorded,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    default = [m for m in ("minilm-moe-e8", "tiny-moe-lm", "tiny-mixtral-random")
               if zoo.has_entry(m)]
    ap.add_argument("--models", default=",".join(default))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=128)
    args = ap.parse_args()
    results = [measure(m, args.tokens, args.repeats, args.batch, args.max_len)
               for m in args.models.split(",") if m]
    for r in results:
        print(f"{r['model']:24s} plain {r['plain_s_median']:.3f}s  recorded "
              f"{r['recorded_s_median']:.3f}s  overhead x{r['overhead_ratio']:.3f}")
    write_json_atomic(RESULTS, {
        "claim": "recording overhead <= 1.25x the plain forward",
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "results": results,
    })
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
