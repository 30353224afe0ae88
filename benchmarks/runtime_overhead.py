"""Local-backend overheads, measured side by side in one run (not part of the test suite).

1. Warm invocation overhead: a no-op (echo) handler invoked back to back; the round trip
   as the caller sees it, and that minus the handler's own time (goal: median <= 1 ms on
   the local backend; <= 5 ms on the ray backend, a Ray Serve handle call, key
   ``warm_overhead_ray``, skipped when ray is not installed).
2. Transfer throughput vs payload size: ``direct`` (bytes in the invocation payload, both
   ways) vs ``storage`` (caller PUTs, handler GETs and PUTs, caller GETs), on a local
   directory store and on the same store with the platform's S3 latency/bandwidth emulated.
3. ODS/BO Fig. 11: one MoE layer's latency with ``pipelined`` as the minibatch size β
   varies, next to ``storage`` (no pipelining), on the emulated S3 store.
4. Pool facts: worker start-up (forkserver first start, later starts) and memory per
   worker (RSS and PSS) idle and with a model's instances loaded.

Writes benchmarks/results/runtime_overhead.json and .png (~2-3 minutes on 2 cores).

    python benchmarks/runtime_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform as pyplatform
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from moefleet.io import write_json_atomic
from moefleet.platform import LocalObjectStore, ObjectStore, PlatformSpec, load_platform
from moefleet.runtime import FunctionBackend, FunctionSpec, HandlerRef
from moefleet.runtime.local import LocalBackend
from moefleet.runtime.payload import pack
from moefleet.runtime.stores import LatencyStore

RESULTS = Path(__file__).resolve().parent / "results"
DEBUG = HandlerRef("moefleet.runtime.handlers:debug_handler")


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _debug_fn(backend: FunctionBackend) -> str:
    name = f"bench-{uuid.uuid4().hex[:6]}"
    backend.deploy(FunctionSpec(name, "aux", DEBUG, memory_mb=1769))
    return name


def warm_overhead(backend: FunctionBackend, n: int) -> dict[str, Any]:
    name = _debug_fn(backend)
    payload = pack(meta={"op": "echo"})
    for _ in range(50):
        backend.invoke(name, payload)
    rtt, handler = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        rec = backend.invoke(name, payload).record
        rtt.append(time.perf_counter() - t0)
        handler.append(rec.duration_s)
    over = [a - b for a, b in zip(rtt, handler, strict=True)]
    return {"invocations": n, "payload_bytes": len(payload),
            "roundtrip_ms": {"median": 1e3 * statistics.median(rtt), "p90": 1e3 * _q(rtt, 0.9),
                             "p99": 1e3 * _q(rtt, 0.99)},
            "overhead_ms": {"median": 1e3 * statistics.median(over),
                            "p90": 1e3 * _q(over, 0.9)}}


def ray_warm_overhead(spec: PlatformSpec, store: str, n: int) -> dict[str, Any] | None:
    """The same measurement on the ray backend (a local Ray node started and stopped here)."""
    try:
        from moefleet.runtime.ray_backend import RayBackend
    except ImportError:
        return None
    backend = RayBackend(spec, store=store, wait_ready=True)
    try:
        return warm_overhead(backend, n)
    finally:
        backend.teardown()


def transfers(backend: LocalBackend, client: ObjectStore, sizes: list[int], reps: int,
              label: str) -> list[dict[str, Any]]:
    name = _debug_fn(backend)
    rows = []
    for size in sizes:
        blob = torch.zeros(size, dtype=torch.uint8)
        direct = pack({"blob": blob}, {"op": "echo"})
        stored = pack({"blob": blob})
        t_direct, t_storage = [], []
        backend.invoke(name, pack(meta={"op": "pid"}))
        for i in range(reps):
            t0 = time.perf_counter()
            backend.invoke(name, direct)
            t_direct.append(time.perf_counter() - t0)
            key_in, key_out = f"bench/{label}/{i}/in", f"bench/{label}/{i}/out"
            t0 = time.perf_counter()
            client.put(key_in, stored)
            backend.invoke(name, pack(meta={"op": "copy", "in": key_in, "out": key_out}))
            client.get(key_out)
            t_storage.append(time.perf_counter() - t0)
        for method, ts in (("direct", t_direct), ("storage", t_storage)):
            med = statistics.median(ts)
            rows.append({"store": label, "method": method, "payload_bytes": size,
                         "median_s": med, "throughput_mb_s": 2 * size / med / 1e6})
    return rows


def _layer_model(name: str = "bench-layer") -> Any:
    """One Mixtral block (hidden 256, 8 experts top-2), seeded: the layer both
    runtime_overhead.py and odsbo_fig11.py measure."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from moefleet.models.hf import HFMoEAdapter

    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                        num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
                        max_position_embeddings=512)
    return HFMoEAdapter(MixtralForCausalLM(cfg).float().eval(), name=name)


def beta_sweep(spec: PlatformSpec, betas: list[int], tokens: int, reps: int,
               latency: tuple[float, float]) -> list[dict[str, Any]]:
    from moefleet.compose import open_engine
    from moefleet.compose.batches import Batches
    from moefleet.compose.score import score_options
    from moefleet.plan import DeploymentPlan

    adapter = _layer_model()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        base = LocalObjectStore(tmp)
        client = LatencyStore(base, *latency)
        backend = LocalBackend(spec, store=base, store_latency=latency)
        try:
            ids = torch.randint(0, 512, (tokens // 64, 64), generator=torch.Generator()
                                .manual_seed(0))
            for method, beta in [("storage", max(betas)), *[("pipelined", b) for b in betas]]:
                plan = DeploymentPlan.uniform("bench-layer", spec.name, [0], [8], 1, 1769,
                                              method=method, beta=beta)  # type: ignore[arg-type]
                with open_engine(adapter, plan=plan, backend=backend, store=client,
                                 platform=spec, model_ref=plan.model,
                                 options=score_options(*ids.shape)) as opened:
                    ex = Batches(opened)
                    ex.run_batch(ids)  # cold starts out of the way
                    stats = [ex.run_batch(ids).layers[0] for _ in range(reps)]
                rows.append({"method": method, "beta": beta, "tokens": ids.numel(),
                             "moe_s": statistics.median(s.moe_s for s in stats),
                             "experts_s": statistics.median(s.experts_s for s in stats),
                             "scatter_s": statistics.median(s.scatter_s for s in stats),
                             "gather_s": statistics.median(s.gather_s for s in stats)})
                print(f"  {method:9s} beta={beta:4d}  MoE layer {rows[-1]['moe_s']:.3f} s")
            loaded = backend.stats()["workers"]
        finally:
            backend.teardown()
    rows.append({"workers_with_instances": loaded})
    return rows


def plot(result: dict[str, Any], path: Path) -> None:
    from moefleet.report.figures import pyplot, save_png

    plt = pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    # 'direct' never touches the store: one curve (from the local-dir run) is enough.
    for store, method, style, label in (
        ("local-dir", "direct", "-o", "direct (payload over a pipe)"),
        ("local-dir", "storage", "--s", "storage, local directory"),
        ("emulated-s3", "storage", "--^", "storage, emulated S3"),
    ):
        rows = [r for r in result["transfer"] if r["store"] == store and r["method"] == method]
        a.plot([r["payload_bytes"] for r in rows], [r["throughput_mb_s"] for r in rows],
               style, label=label)
    a.set(xscale="log", yscale="log", xlabel="payload (bytes)", ylabel="MB/s (both ways)",
          title="Transfer throughput vs payload size")
    a.legend(fontsize=8)
    sweep = [r for r in result["beta_sweep"] if r.get("method") == "pipelined"]
    storage = [r for r in result["beta_sweep"] if r.get("method") == "storage"]
    b.plot([r["beta"] for r in sweep], [r["moe_s"] for r in sweep], "-o", label="pipelined")
    if storage:
        b.axhline(storage[0]["moe_s"], color="gray", ls="--", label="storage (no pipelining)")
    b.set(xscale="log", xlabel="beta (tokens per minibatch)", ylabel="MoE layer latency (s)",
          title="Pipelined vs not, emulated S3 (cf. ODS/BO Fig. 11)")
    b.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (~1 minute)")
    args = ap.parse_args()
    spec = load_platform("aws-lambda")
    assert spec.storage is not None
    latency = (spec.storage.access_latency_s, spec.storage.bandwidth_bytes_per_s)
    reps = 3 if args.quick else 5
    result: dict[str, Any] = {"platform": spec.name, "machine": {
        "python": pyplatform.python_version(), "torch": torch.__version__,
        "cpus": os.cpu_count()}, "storage_emulation": {
        "access_latency_s": latency[0], "bandwidth_bytes_per_s": latency[1]}}
    sizes = [1024, 16 * 1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        backend = LocalBackend(spec, store=tmp)
        first = time.perf_counter() - t0
        idle = backend.stats()["workers"]
        try:
            print("warm overhead ...")
            result["warm_overhead"] = warm_overhead(backend, 500 if args.quick else 2000)
            print(f"  {result['warm_overhead']}")
            print("warm overhead, ray backend ...")
            ray_row = ray_warm_overhead(spec, tmp, 500 if args.quick else 2000)
            if ray_row is not None:
                result["warm_overhead_ray"] = ray_row
            print(f"  {ray_row}")
            print("transfers, local directory store ...")
            result["transfer"] = transfers(backend, LocalObjectStore(tmp), sizes, reps,
                                           "local-dir")
        finally:
            backend.teardown()
        t0 = time.perf_counter()
        backend = LocalBackend(spec, store=tmp, store_latency=latency)
        again = time.perf_counter() - t0
        try:
            print("transfers, emulated S3 ...")
            result["transfer"] += transfers(backend, LatencyStore(LocalObjectStore(tmp),
                                                                  *latency), sizes, reps,
                                            "emulated-s3")
        finally:
            backend.teardown()
    result["pool"] = {"workers": len(idle), "start_first_s": first, "start_again_s": again,
                      "idle_workers": idle}
    print("beta sweep, emulated S3 ...")
    sweep = beta_sweep(spec, [8, 16, 32, 64, 128], 512, 2 if args.quick else 3, latency)
    result["pool"]["workers_with_instances"] = sweep.pop()["workers_with_instances"]
    result["beta_sweep"] = sweep
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_json_atomic(RESULTS / "runtime_overhead.json", result)
    plot(result, RESULTS / "runtime_overhead.png")
    print(f"wrote {RESULTS / 'runtime_overhead.json'} and .png")


if __name__ == "__main__":
    main()
