"""The CPU expert products per weight: our AVX512-BF16 kernel against the grouped GEMM.

For each expert shape (OLMoE-1B-7B's gate/up, 2048 -> 2048, and down, 1024 -> 2048, by
default) and each number of rows per expert, R rows on each of several bf16 weights
(64 weights at 1-2 rows, as a decode step spreads them; fewer at more rows, as brownout's
united experts gather them), timed both ways in one run, median of ``--reps``:
``moefleet.models.cpu_dpbf16.segments`` and ``torch._grouped_mm`` (oneDNN's product
per expert on the CPU). At more than one torch thread (``OMP_NUM_THREADS``) the kernel
splits its outputs between them, and is timed on one thread too. Writes JSON with
milliseconds per weight and the ratios. This is where ``cpu_dpbf16.MAX_ROWS_PER_EXPERT``
comes from. Random weights: speed only.

    OMP_NUM_THREADS=1 python benchmarks/cpu_expert_kernel.py \
        --out benchmarks/results/cpu_expert_kernel.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

from moefleet.io import write_text_atomic
from moefleet.models import cpu_dpbf16
from moefleet.models.dtypes import median_seconds


def weights_for(rows: int, total: int) -> int:
    """How many weights R rows each are spread over: all at 1-2 rows, 64 pairs' worth
    (at least 4) beyond."""
    return total if rows <= 2 else max(4, total // rows)


def measure(n_out: int, n_in: int, rows: int, total: int, reps: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(rows)
    n_w = weights_for(rows, total)
    w = torch.randn(n_w, n_out, n_in, generator=g).to(torch.bfloat16)
    x = torch.randn(n_w * rows, n_in, generator=g).to(torch.bfloat16)
    ends = torch.arange(rows, n_w * rows + 1, rows)
    offs, w_EIO = ends.to(torch.int32), w.transpose(1, 2)
    grouped = median_seconds(lambda: torch._grouped_mm(x, w_EIO, offs=offs), reps)
    kernel = median_seconds(lambda: cpu_dpbf16.segments(x, w, ends), reps)
    res = {"rows": rows, "weights": n_w, "grouped_ms_per_weight": grouped * 1e3 / n_w,
           "kernel_ms_per_weight": kernel * 1e3 / n_w, "grouped_over_kernel": grouped / kernel}
    threads = torch.get_num_threads()
    if threads > 1:  # the kernel on the calling thread alone, beside its split
        torch.set_num_threads(1)
        try:
            one = median_seconds(lambda: cpu_dpbf16.segments(x, w, ends), reps)
        finally:
            torch.set_num_threads(threads)
        res |= {"kernel_one_thread_ms_per_weight": one * 1e3 / n_w,
                "one_thread_over_split": one / kernel}
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="2048x2048,2048x1024",
                    help="OUTxIN expert shapes, comma-separated (IN a multiple of 32)")
    ap.add_argument("--rows", default="1,2,4,8,12,16,24")
    ap.add_argument("--weights", type=int, default=64, help="weights at 1-2 rows each")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results/cpu_expert_kernel.json")
    a = ap.parse_args(argv)
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
        rows = [int(r) for r in a.rows.split(",")]
    except ValueError:
        ap.error(f"--shapes {a.shapes!r} / --rows {a.rows!r}: use e.g. 2048x1024 and 1,2,8")
    if any(len(s) != 2 or s[0] < 1 or s[1] < 32 or s[1] % 32 for s in shapes):
        ap.error(f"--shapes {a.shapes!r}: OUTxIN with IN a positive multiple of 32")
    if any(not 1 <= r <= 256 for r in rows) or not 4 <= a.weights <= 256 or a.reps < 1:
        ap.error("--rows in [1, 256], --weights in [4, 256], --reps >= 1")
    if not cpu_dpbf16.available():
        print("the AVX512-BF16 kernel does not run on this machine (no AVX512-BF16, no C "
              "compiler, or it measured slower): nothing to compare", file=sys.stderr)
        return 1
    results = []
    for n_out, n_in in shapes:
        for r in rows:
            res = {"out": n_out, "in": n_in, **measure(n_out, n_in, r, a.weights, a.reps)}
            results.append(res)
            one = res.get("kernel_one_thread_ms_per_weight")
            print(f"{n_out}x{n_in} {r:3d} rows over {res['weights']:2d} weights: grouped "
                  f"{res['grouped_ms_per_weight']:.3f} ms/weight, kernel "
                  f"{res['kernel_ms_per_weight']:.3f}, {res['grouped_over_kernel']:.2f}x"
                  + ("" if one is None else f"; kernel on one thread {one:.3f}"),
                  flush=True)
    out = {"note": "random bf16 weights: speed only; one process, medians of reps",
           "machine": platform.processor() or platform.machine(),
           "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
           "max_rows_per_expert": cpu_dpbf16.MAX_ROWS_PER_EXPERT, "reps": a.reps,
           "results": results}
    write_text_atomic(a.out, json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
