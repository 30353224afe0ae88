"""What ``engine_scale.py`` measures besides the runs themselves: the device's copy
bandwidth (the roofline's yardstick), the weight bytes a decode step reads, peak memory,
and the peak RSS of loading a full model shape in a fresh process."""

from __future__ import annotations

import gc
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from hf_baseline import sync  # benchmarks/ is on sys.path when run as a script

GiB = 1 << 30


def copy_bandwidth(device: torch.device, nbytes: int = 512 << 20) -> float:
    """Bytes moved (read + write) per second by ``copy_`` of a large buffer (median of 5)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


class StepBytes:
    """Weight bytes a decode step of ``B`` rows reads: every non-expert weight but the
    embedding table (only its rows), plus the experts its tokens touch, estimated with
    uniform routing as a share ``1 - (1 - k/E)^B`` of each layer's experts (at large B
    every expert: the issue's "a decode step reads all weights once")."""

    def __init__(self, adapter: Any) -> None:
        shape = adapter.summary()
        emb = adapter.model.get_input_embeddings().weight
        self.fixed = shape.non_expert_param_bytes - emb.numel() * emb.element_size()
        self.experts = shape.expert_param_bytes
        self.k_over_e = adapter.top_k / adapter.num_experts(adapter.moe_layers[0])

    def __call__(self, rows: int) -> float:
        return self.fixed + self.experts * (1 - (1 - self.k_over_e) ** rows)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (compiled attention's compiles)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def release(device: torch.device) -> None:
    """Give back what the last run held (its KV cache above all: on a GPU each engine
    sizes its cache from the memory left, so the next one must find it free)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def gpu_peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None


def load_rss(model: str, dtype: str) -> dict[str, Any]:
    """Peak RSS of building ``model`` in a fresh process, over its weight bytes."""
    # VmHWM, not ru_maxrss: Linux carries this (parent) process's peak into the child.
    code = ("import json, torch\n"
            "from moefleet.models.registry import load_adapter\n"
            "from moefleet.runtime.local_limits import peak_bytes\n"
            f"a = load_adapter({model!r}, dtype={dtype!r})\n"
            "w = sum(p.numel() * p.element_size() for p in a.model.parameters())\n"
            "print(json.dumps({'weight_bytes': w, 'peak_rss_bytes': peak_bytes()}))\n")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=1800)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["ratio"] = res["peak_rss_bytes"] / res["weight_bytes"]
    res["build_s"] = time.perf_counter() - t0
    res["model"] = model
    return res


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def load_check(ref: str, dtype: str) -> dict[str, Any]:
    """:func:`load_rss` when this machine's free memory can hold the shape, else why not."""
    from moefleet.models.real_shapes import hf_config, parse_ref

    shape, layers = parse_ref(ref)
    with torch.device("meta"):
        import transformers

        meta = getattr(transformers, shape.arch)(hf_config(shape, layers))
    want = sum(p.numel() for p in meta.parameters()) * 2
    if mem_available() > 1.3 * want:
        return load_rss(ref, dtype)
    return {"model": ref, "skipped": f"needs ~{want / GiB:.1f} GiB, "
            f"{mem_available() / GiB:.1f} GiB free"}
