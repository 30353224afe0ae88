"""ODS/BO Fig. 11 analogue: billed cost and throughput of one MoE layer vs tokens per batch
for the three scatter-gather methods, measured on the local backend (not in the suite).

Setup: a one-block Mixtral-style layer (hidden 256, 8 experts of FFN 1024, top-2; the
model of runtime_overhead.py's beta sweep), every expert at ``--memory`` MB with one
replica, the object store with the platform's S3 latency and bandwidth emulated (both on
the workers' side and the executor's), the local backend's memory and vCPU limits on
(emulated), 10 worker processes so that the gate and all 8 experts run at once (the
layer is I/O-bound on the emulated store; compute is small next to it). Per method and
batch size: one cold batch, then ``--reps`` warm batches; median MoE-layer latency
(scatter + experts + gather) and the mean bill of a warm batch
(expert invocations + every store request the segment functions and the executor made,
priced by the platform's Meter). Pipelined uses β = ceil(tokens per replica / 4).
Direct needs the payload to fit: a batch whose replica packet does not fit is recorded
as such, not run.

    python benchmarks/odsbo_fig11.py [--quick]

Writes benchmarks/results/odsbo_fig11.json and .png.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from moefleet.errors import MoefleetError
from moefleet.io import write_json_atomic
from moefleet.platform import LocalObjectStore, Meter, load_platform
from moefleet.runtime.local import LocalBackend
from moefleet.runtime.stores import LatencyStore

OUT = Path(__file__).resolve().parent / "results"


def _layer_model() -> Any:
    from runtime_overhead import _layer_model as layer  # the same measured layer

    return layer("fig11-layer")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from moefleet.compose import open_engine
    from moefleet.compose.batches import Batches
    from moefleet.compose.score import score_options
    from moefleet.plan import DeploymentPlan

    spec = load_platform(args.platform)
    assert spec.storage is not None
    latency = (spec.storage.access_latency_s, spec.storage.bandwidth_bytes_per_s)
    adapter = _layer_model()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        base = LocalObjectStore(tmp)
        backend = LocalBackend(spec, store=base, store_latency=latency, limits=True,
                               workers=args.workers)
        try:
            for tokens in args.tokens:
                ids = torch.randint(0, 512, (max(1, tokens // 64), min(tokens, 64)),
                                    generator=torch.Generator().manual_seed(tokens))
                per_replica = math.ceil(ids.numel() * 2 / 8)
                for method in ("direct", "storage", "pipelined"):
                    beta = max(1, math.ceil(per_replica / 4))
                    plan = DeploymentPlan.uniform(
                        "fig11-layer", spec.name, [0], [8], 1, args.memory,
                        method=method, beta=beta,  # type: ignore[arg-type]
                        segment_memory_mb=spec.baseline_memory())
                    client = LatencyStore(base, *latency)
                    row: dict[str, Any] = {"method": method, "tokens": ids.numel(),
                                           "beta": beta if method == "pipelined" else None}
                    try:
                        with open_engine(adapter, plan=plan, backend=backend, store=client,
                                         platform=spec, model_ref=plan.model,
                                         options=score_options(*ids.shape)) as opened:
                            ex = Batches(opened)
                            ex.run_batch(ids)  # cold starts out of the way
                            puts0, gets0 = opened.client_store_requests()
                            res = [ex.run_batch(ids) for _ in range(args.reps)]
                            puts, gets = opened.client_store_requests()
                    except MoefleetError as err:  # a direct share over the payload limit
                        if "payload" not in err.message:
                            raise
                        rows.append({**row, "error": err.message})
                        print(f"  {method:9s} {ids.numel():5d} tokens: payload too large")
                        continue
                    meter = Meter(spec)
                    for r in res:
                        for rec in r.records:
                            meter.add(rec)
                    meter.add_storage(puts - puts0, gets - gets0)
                    moe = [r.layers[0].moe_s for r in res]
                    row.update(moe_s=statistics.median(moe),
                               cost_usd=meter.bill().total.total / len(res),
                               throughput_tokens_per_s=ids.numel() / statistics.median(moe))
                    rows.append(row)
                    print(f"  {method:9s} {ids.numel():5d} tokens: {row['moe_s']:.3f} s, "
                          f"{row['cost_usd']:.3e} USD/batch")
            stretch = backend.stats()["cpu_stretch_s"]
            limits = backend.stats()["limits"]
        finally:
            backend.teardown()
    return {"platform": spec.name, "memory_mb": args.memory, "store_latency": latency,
            "workers": args.workers,
            "reps": args.reps, "rows": rows, "cpu_stretch_s": stretch, "limits": limits}


def plot(result: dict[str, Any], path: Path) -> None:
    from moefleet.report.figures import pyplot, save_png

    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for method in ("direct", "storage", "pipelined"):
        rs = [r for r in result["rows"] if r["method"] == method and "error" not in r]
        ax1.plot([r["tokens"] for r in rs], [r["cost_usd"] for r in rs], "o-", label=method)
        ax2.plot([r["tokens"] for r in rs], [r["throughput_tokens_per_s"] for r in rs], "o-",
                 label=method)
    for ax, label in ((ax1, "billed USD per batch"), (ax2, "tokens/s (MoE layer)")):
        ax.set_xscale("log")
        ax.set_xlabel("tokens per batch")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"One MoE layer on the local backend, emulated S3 "
                 f"(cf. ODS/BO Fig. 11; {result['memory_mb']} MB experts, limits emulated)")
    save_png(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two batch sizes, one warm rep")
    ap.add_argument("--platform", default="aws-lambda-2020")
    ap.add_argument("--memory", type=int, default=1536)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workers", type=int, default=10,
                    help="worker processes: the gate and all 8 experts at once, as on a "
                         "platform where every function has its own instance")
    args = ap.parse_args()
    args.tokens = [64, 512] if args.quick else [64, 256, 1024, 4096]
    if args.quick:
        args.reps = 1
    t0 = time.perf_counter()
    result = run(args)
    result["wall_s"] = time.perf_counter() - t0
    OUT.mkdir(parents=True, exist_ok=True)
    write_json_atomic(OUT / "odsbo_fig11.json", result)
    plot(result, OUT / "odsbo_fig11.png")
    print(f"wrote {OUT / 'odsbo_fig11.json'} in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
