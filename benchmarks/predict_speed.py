"""Speed of the expert-popularity predictors on real routing of a zoo model.

    python benchmarks/predict_speed.py [--model tiny-moe-lm] [--repeats 5]

Data (all real; how it is enlarged is recorded in the JSON):
- routing: ``moefleet profile`` of every ShareGPT prompt (500, at most ``--max-length``
  tokens each) on ``--model``;
- Bayes fit input: ``--fit-batches`` x 10,240 tokens, made by drawing whole profiled
  requests with replacement (seeded) and renaming each copy, so every row is a real
  routing decision; the copies repeat contexts, so the count table is smaller than a
  corpus of that many distinct tokens would give (its size is reported);
- SPS prompts: every prompt of every shared dataset, tokenised by the model (no
  forward pass is needed: the tree clusters prompt vectors only); the first
  ``--sps-prompts`` build the tree, the next ``--queries`` are the queries. Their
  activation distributions are real profiled ShareGPT ones assigned by a seeded draw:
  they do not enter tree building or neighbour search, only the final weighted sum.

Measured (medians over ``--repeats`` after one warm-up call, wall seconds, this process):
- ``bayes_predict``: ``BayesPredictor.predict_counts`` on whole requests totalling at
  least 10,240 tokens, fitted on the large trace (goal <= 20 ms);
- ``bayes_fit``: ``BayesPredictor().fit`` on the large trace (goal <= 30 s);
- ``sps_build``: ``SPSPredictor.fit_prompts`` with method ``tree`` (k-medoids tree) on
  ``--sps-prompts`` prompt vectors (goal <= 0.5 s for 5,000);
- ``sps_query``: ``neighbours`` of each query vector, tree vs brute force at the same
  alpha, plus the whole per-request ``predict_distribution`` (embedding included) and
  the recall of BF's neighbours by the tree (goal: tree >= 10x faster).

Writes benchmarks/results/predict_speed.json. Wall times on a shared machine vary with
its load (recorded in ``machine``). BLAS runs single-threaded unless the environment
sets ``OPENBLAS_NUM_THREADS`` / ``OMP_NUM_THREADS``: on a loaded 2-core machine threaded
OpenBLAS made the small (5000 x 256) @ (256 x 2) products of tree building 10-20x slower
than one thread. The setting used is recorded in ``machine``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Must precede the numpy import (OpenBLAS reads it once); see the module doc.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from moefleet.data import list_datasets, load_prompts  # noqa: E402
from moefleet.io import write_json_atomic  # noqa: E402
from moefleet.models import load_adapter  # noqa: E402
from moefleet.predict import (  # noqa: E402
    BayesPredictor,
    ModelShape,
    Request,
    SPSPredictor,
    adapter_embedding,
)
from moefleet.predict._trace import TraceArrays  # noqa: E402
from moefleet.predict.harness import make_batches  # noqa: E402
from moefleet.traces import profile, tokenize_prompts  # noqa: E402
from moefleet.traces.schema import Trace  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "predict_speed.json"
BATCH_TOKENS = 10_240


def timed(fn: Callable[[], Any], repeats: int) -> tuple[Any, dict[str, Any]]:
    """(last result, timings): one warm-up call, then ``repeats`` timed calls."""
    t0 = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t0
    walls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - t0)
    return out, {"first_s": first, "median_s": statistics.median(walls),
                 "min_s": min(walls), "repeats": repeats, "all_s": walls}


def resample_trace(trace: Trace, tokens: int, seed: int) -> Trace:
    """Whole requests of ``trace`` drawn with replacement until >= ``tokens`` tokens;
    copy c of request r is renamed ``r#c`` so requests stay distinct."""
    ta = TraceArrays.from_trace(trace)
    order = np.argsort(ta.req_idx_N, kind="stable")  # rows grouped by request, in order
    bounds = np.searchsorted(ta.req_idx_N[order], np.arange(ta.num_requests + 1))
    rows_P = np.diff(bounds)
    tokens_P = rows_P // len(trace.moe_layers)  # one row per token and MoE layer
    rng = np.random.default_rng(seed)
    picks: list[int] = []
    total = 0
    while total < tokens:
        p = int(rng.integers(ta.num_requests))
        picks.append(p)
        total += int(tokens_P[p])
    take = np.concatenate([order[bounds[p] : bounds[p + 1]] for p in picks])
    table = trace.table.take(pa.array(take))
    names = np.concatenate([np.full(rows_P[p], f"{ta.request_ids[p]}#{c}", dtype=object)
                            for c, p in enumerate(picks)])
    table = table.set_column(table.schema.get_field_index("request_id"), "request_id",
                             pa.array(names.tolist(), pa.string()))
    meta = {**trace.meta, "num_requests": len(picks), "num_tokens": total,
            "dataset": f"{trace.meta.get('dataset', '')} resampled x{len(picks)}"}
    return Trace(table, meta)


def all_prompt_ids(adapter: Any, max_length: int) -> tuple[list[list[int]], dict[str, int]]:
    """Token ids of every prompt of every dataset (every split that holds them all)."""
    seqs: list[list[int]] = []
    per: dict[str, int] = {}
    for d in list_datasets():
        splits = ["all"] if "all" in d.splits else list(d.splits)
        for split in splits:
            texts = [p.text for p in load_prompts(d.name, split=split)]
            kept = tokenize_prompts(adapter, texts, max_tokens=10**9, max_length=max_length)
            seqs.extend(s for _, s in kept)
            per[f"{d.name}:{split}"] = len(kept)
    return seqs, per


def bench_bayes(trace: Trace, args: argparse.Namespace) -> dict[str, Any]:
    big = resample_trace(trace, args.fit_batches * BATCH_TOKENS, args.seed)
    print(f"bayes: fit trace {big.num_tokens} tokens x {len(big.moe_layers)} layers "
          f"= {big.table.num_rows} rows", flush=True)
    fitted, fit = timed(lambda: BayesPredictor().fit(big), args.fit_repeats)
    table = fitted.table
    assert table is not None
    # Query batch: whole requests of the profiled trace (not the resampled copies).
    batch = make_batches(TraceArrays.from_trace(trace).requests(), BATCH_TOKENS)[0]
    _, pred = timed(lambda: fitted.predict_counts(batch), args.repeats * 4)
    return {
        "fit": {**fit, "tokens": big.num_tokens, "rows": big.table.num_rows,
                "requests": int(big.meta["num_requests"]), "table_entries": len(table),
                "goal_s": 30.0, "met": fit["median_s"] <= 30.0},
        "predict_counts": {**pred, "tokens": sum(r.num_tokens for r in batch),
                           "requests": len(batch), "goal_s": 0.020,
                           "met": pred["median_s"] <= 0.020},
    }


def bench_sps(trace: Trace, adapter: Any, args: argparse.Namespace) -> dict[str, Any]:
    seqs, per = all_prompt_ids(adapter, args.max_length)
    n_build = min(args.sps_prompts, len(seqs))
    queries = seqs[n_build : n_build + args.queries] or seqs[: args.queries]
    emb = adapter_embedding(adapter)
    tree = SPSPredictor(emb, "tree", alpha=args.alpha)
    U_PD = np.stack([tree.prompt_vector(s) for s in seqs[:n_build]])
    Q = np.stack([tree.prompt_vector(s) for s in queries])
    ta = TraceArrays.from_trace(trace)
    A_real = ta.request_counts() / (np.array([r.num_tokens for r in ta.requests()])
                                    * ta.shape.top_k)[:, None, None]
    A_PLE = A_real[np.random.default_rng(args.seed).integers(len(A_real), size=n_build)]
    shape: ModelShape = ta.shape
    _, build = timed(lambda: tree.fit_prompts(shape, U_PD, A_PLE), args.repeats)
    bf = SPSPredictor(emb, "bf", alpha=args.alpha).fit_prompts(shape, U_PD, A_PLE)
    assert tree.tree is not None

    def search(pred: SPSPredictor) -> Callable[[], list[np.ndarray]]:
        return lambda: [pred.neighbours(u)[0] for u in Q]

    got_tree, q_tree = timed(search(tree), args.repeats)
    got_bf, q_bf = timed(search(bf), args.repeats)
    recall = float(np.mean([len(set(a.tolist()) & set(b.tolist())) / len(b)
                            for a, b in zip(got_tree, got_bf, strict=True)]))
    reqs = [Request(f"q{i}", tuple(s)) for i, s in enumerate(queries)]
    _, e2e_tree = timed(lambda: tree.predict_distribution(reqs), max(1, args.repeats // 2))
    _, e2e_bf = timed(lambda: bf.predict_distribution(reqs), max(1, args.repeats // 2))
    nq = len(Q)
    leaves = tree.tree.leaves()
    speedup = q_bf["median_s"] / q_tree["median_s"]
    return {
        "prompts_available": len(seqs), "prompts_per_dataset": per,
        "build": {**build, "prompts": n_build, "dim": int(U_PD.shape[1]),
                  "beta": tree.beta, "fanout": tree.fanout,
                  "leaves": int(leaves.size), "nodes": tree.tree.num_nodes,
                  "us_per_prompt": build["median_s"] / n_build * 1e6,
                  "goal_s_for_5000": 0.5,
                  "met": n_build >= 5000 and build["median_s"] <= 0.5},
        "query": {"queries": nq, "alpha": args.alpha,
                  "tree_us_per_query": q_tree["median_s"] / nq * 1e6,
                  "bf_us_per_query": q_bf["median_s"] / nq * 1e6,
                  "speedup": speedup, "goal_speedup": 10.0, "met": speedup >= 10.0,
                  "recall_of_bf_neighbours": recall,
                  "tree": q_tree, "bf": q_bf},
        "predict_distribution": {
            "what": "per-request prompt vector (embedding) + search + weighted sum",
            "tree_us_per_query": e2e_tree["median_s"] / nq * 1e6,
            "bf_us_per_query": e2e_bf["median_s"] / nq * 1e6,
            "tree": e2e_tree, "bf": e2e_bf},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-moe-lm")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--fit-repeats", type=int, default=3)
    ap.add_argument("--fit-batches", type=int, default=100,
                    help="fit trace size, in batches of 10,240 tokens")
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--sps-prompts", type=int, default=5000)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--alpha", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    load0 = os.getloadavg()
    adapter = load_adapter(args.model)
    prompts = load_prompts("sharegpt", split="all")
    t0 = time.perf_counter()
    trace = profile(adapter, [p.request_id for p in prompts], [p.text for p in prompts],
                    max_tokens=10**9, max_length=args.max_length, dataset="sharegpt")
    profile_s = time.perf_counter() - t0
    print(f"profiled {trace.num_tokens} ShareGPT tokens in {profile_s:.1f}s", flush=True)
    result: dict[str, Any] = {
        "command": "python benchmarks/predict_speed.py " + " ".join(sys.argv[1:]),
        "machine": {"python": platform.python_version(), "numpy": np.__version__,
                    "arch": platform.machine(), "cpus": os.cpu_count(),
                    "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
                    "loadavg_start": load0},
        "model": args.model,
        "profile": {"dataset": "sharegpt:all", "tokens": trace.num_tokens,
                    "requests": int(trace.meta.get("num_requests", 0)), "s": profile_s},
        "bayes": bench_bayes(trace, args),
        "sps": bench_sps(trace, adapter, args),
    }
    result["machine"]["loadavg_end"] = os.getloadavg()
    b, s = result["bayes"], result["sps"]
    print(f"bayes predict_counts {b['predict_counts']['tokens']} tokens: "
          f"{b['predict_counts']['median_s'] * 1e3:.2f} ms (goal 20 ms)")
    print(f"bayes fit {b['fit']['tokens']} tokens: {b['fit']['median_s']:.2f} s (goal 30 s)")
    print(f"sps tree build {s['build']['prompts']} prompts: {s['build']['median_s']:.3f} s "
          f"(goal 0.5 s for 5,000)")
    print(f"sps query tree {s['query']['tree_us_per_query']:.1f} us vs bf "
          f"{s['query']['bf_us_per_query']:.1f} us: x{s['query']['speedup']:.1f} (goal 10x), "
          f"recall {s['query']['recall_of_bf_neighbours']:.3f}")
    write_json_atomic(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
