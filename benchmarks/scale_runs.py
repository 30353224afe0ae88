"""The parts of ``engine_scale.py``'s engine and HF runs that are not the timed loop:
the host-read count of a decode step, a profile of decode steps, and HF static batches
that halve on running out of GPU memory."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from hf_baseline import run_hf, sync  # benchmarks/ is on sys.path when run as a script
from scale_helpers import release

from moefleet.compose import StackOptions, in_process_engine
from moefleet.engine import SamplingParams
from moefleet.engine.host_reads import HostReads

HOST_READ_ROWS = 32  # rows of the host-read counting pass (reads are per step, not per row)


def profile_decode(adapter: Any, ids: list[list[int]], a: argparse.Namespace,
                   stack: StackOptions, attention: str, steps: int = 3) -> dict[str, Any]:
    """Where a decode step's time goes: ``max_num_seqs`` rows (prompts cut to 64 tokens)
    prefilled, then ``steps`` decode steps under ``torch.profiler``: wall per step, the
    device's kernel time per step, kernel launches per step, the top operators."""
    from torch.profiler import ProfilerActivity, profile

    rows = [p[:64] for p in ids[: a.max_num_seqs]]
    budget = len(rows) * 128 * adapter.kv_layout().bytes_per_token
    eng = in_process_engine(adapter, stack=stack, device=a.device, attention=attention,
                            max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len,
                            kv_budget_bytes=budget).engine
    # Enough new tokens that no row finishes before the last is prefilled (rows prefilled
    # early decode meanwhile): at most one per prefill step, plus the profiled steps.
    prefill_steps = -(-sum(len(p) for p in rows) // 64) + 1  # generous: prefill chunks are larger
    for p in rows:
        room = a.max_model_len - len(p)  # the context bounds it
        eng.add_request(p, SamplingParams(max_tokens=min(prefill_steps + steps + 4, room),
                                          temperature=0, ignore_eos=True))
    while True:  # prefill, and one decode step of every row to warm up
        eng.step()
        st = eng.stats.steps[-1]
        if st.num_tokens == st.num_rows == len(rows):
            break
        if not eng.has_unfinished:
            raise RuntimeError("every request finished before a decode step of all rows")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device != "cpu" else [])
    sync(torch.device(a.device))
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            eng.step()
        sync(torch.device(a.device))
    wall = (time.perf_counter() - t0) / steps
    ev = prof.key_averages()

    def dev_us(e: Any) -> float:
        return float(getattr(e, "self_device_time_total", 0)
                     or getattr(e, "self_cuda_time_total", 0) or 0)

    kernels = [e for e in ev if str(getattr(e, "device_type", "")).endswith("CUDA")]
    launches = sum(e.count for e in ev if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                     "cudaLaunchKernelExC"))

    def rows_of(events: list[Any], key: Any) -> list[dict[str, Any]]:
        return [{"op": e.key[:120], "count_per_step": e.count / steps,
                 "device_ms_per_step": dev_us(e) / 1e3 / steps,
                 "cpu_self_ms_per_step": e.self_cpu_time_total / 1e3 / steps}
                for e in sorted(events, key=key, reverse=True)[:15]]

    return {"rows": len(rows), "steps": steps, "step_wall_ms": wall * 1e3,
            # kernel events only: an operator's device time is its kernels' again
            "device_kernel_ms_per_step": sum(dev_us(e) for e in kernels) / 1e3 / steps,
            "kernel_launches_per_step": launches / steps,
            "cpu_ops_per_step": sum(e.count for e in ev if e.key.startswith("aten::"))
            / steps,
            "top_kernels": rows_of(kernels, dev_us),
            "top_cpu_ops": rows_of([e for e in ev if e.key.startswith("aten::")],
                                   lambda e: e.self_cpu_time_total)}


def host_reads(adapter: Any, ids: list[list[int]], a: argparse.Namespace,
               stack: StackOptions, attention: str) -> dict[str, Any]:
    """Host reads per decode step, counted in an untimed pass of its own (the counting
    mode sees every torch call from Python, which would slow the timed run): the first
    ``HOST_READ_ROWS`` prompts (at most ``max_num_seqs``), 6 tokens each, on a cache
    sized for just them."""
    rows = ids[: min(a.max_num_seqs, HOST_READ_ROWS)]
    budget = len(rows) * a.max_model_len * adapter.kv_layout().bytes_per_token
    try:
        eng = in_process_engine(adapter, stack=stack, device=a.device,
                                max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len,
                                attention=attention, kv_budget_bytes=budget).engine
        for p in rows:
            eng.add_request(p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        counts = []
        while eng.has_unfinished:
            with HostReads() as reads:
                eng.step()
            st = eng.stats.steps[-1]
            if st.num_tokens == st.num_rows:
                counts.append(reads.count)
    except Exception as err:  # a failed count is reported, not fatal
        return {"host_reads_error": f"{type(err).__name__}: {err}"[:500]}
    return {"host_reads_per_decode_step_max": max(counts, default=None),
            "host_reads_per_decode_step_median": statistics.median(counts) if counts else None,
            "host_reads_rows": len(rows)}


def hf_static(model: Any, ids: list[list[int]], lens: list[int], a: argparse.Namespace
              ) -> tuple[list[list[int]], float, list[int], int] | None:
    """HF ``generate`` in static batches of ``--hf-batch`` (default ``max_num_seqs``),
    halved while a batch runs out of GPU memory (the largest batch that fits is HF's
    fastest); None when not even 16 fit."""
    batch = a.hf_batch or a.max_num_seqs
    while True:
        try:
            got, wall, steps = run_hf(model, ids, lens, batch, a.device)
            return got, wall, steps, batch
        except torch.OutOfMemoryError:
            print(f"hf_static: batch {batch} out of memory, halving", flush=True)
        release(torch.device(a.device))
        batch //= 2
        if batch < 16:
            return None
