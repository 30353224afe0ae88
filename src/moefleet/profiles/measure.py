"""Measure a model's compute profile on this machine: time vs tokens and vs threads.

What one timed call is (units: seconds per call; ``n`` tokens, ``v`` torch threads):

- expert of MoE layer l: the standalone ``adapter.expert(l, i)`` module (own weights,
  as an expert function would hold them) on ``x_ND`` = n random normal tokens. Experts of
  one layer share shapes, so ``experts_per_layer`` of them (seeded sample) are timed and
  their samples pooled into one law per layer.
- segment l: everything of block l that is not a routed expert, run from the adapter's
  own pieces: ``pre_moe`` (norms + attention + residual), the gate (``route``: router
  logits + top-k) on MoE layers, ``post_moe`` with an all-zero expert output (adds shared
  experts or runs the dense MLP, plus the residual); block 0 adds ``begin`` (embedding,
  masks, position encodings), the last block ``finish`` (final norm + head on every
  token). Dispatching tokens to experts and combining their outputs is not included: that
  is the executor's cost and depends on the scatter-gather method. The n tokens form
  ceil(n / seq_len) sequences of min(n, seq_len) tokens, so attention stays near linear
  in n as it does for a batch of prompts; blocks > 0 reuse a precomputed context.

Timing (clocks, warm-up, per-call medians, interleaved repeats) is in
:mod:`moefleet.profiles.timing`. At one thread every batch size is timed and the batch
law fitted to those medians; at more threads only the largest batch (all of them with
``full_thread_grid``), whose per-token times, taken as a running minimum over thread
counts, feed the thread law (see ``_fit_function`` and :mod:`moefleet.profiles.fit`).
"""

from __future__ import annotations

import functools
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from moefleet.errors import MoefleetError
from moefleet.limits import MAX_CALL_TOKENS
from moefleet.models.base import MoEModelAdapter, param_bytes
from moefleet.profiles.cache import profile_for, profile_path
from moefleet.profiles.fit import fit_batch_law, fit_thread_law
from moefleet.profiles.model import ComputeProfile, FunctionProfile
from moefleet.profiles.timing import (
    MIN_REPEAT_S,
    available_cpus,
    clock_for,
    load_avg,
    machine_info,
    median,
    time_cells,
    torch_threads,
)

__all__ = [  # profile_for / profile_path live in cache.py, re-exported here
    "DEFAULT_BATCH_SIZES", "DEFAULT_REPEATS", "THOROUGH_BATCH_SIZES", "THOROUGH_REPEATS",
    "available_cpus", "check_grid", "clock_for", "machine_info", "measure_profile", "profile_for",
    "profile_path", "time_cells", "torch_threads",
]

# progress(done, total, description), like the zoo's build progress
ProgressFn = Callable[[int, int, str], None]

# Defaults: a model of minilm-moe-e8's size (6 blocks, 6×8 experts, hidden 384) took 30 s
# on 2 cores at load average 7 (colleagues' tests running), well under 10 s when idle.
# THOROUGH_* is the full grid at every thread count, for results that support a claim.
DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 4, 16, 64, 256, 1024)
DEFAULT_REPEATS = 3
THOROUGH_BATCH_SIZES: tuple[int, ...] = tuple(2**k for k in range(11))  # 1 .. 1024
THOROUGH_REPEATS = 5
DEFAULT_EXPERTS_PER_LAYER = 2
DEFAULT_SEQ_LEN = 128


def check_grid(
    threads: Sequence[int] | None, batch_sizes: Sequence[int], repeats: int
) -> tuple[list[int], list[int]]:
    """Validate and normalise (sorted, unique) the thread counts and batch sizes."""
    cpus = available_cpus()
    tlist = sorted(set(threads)) if threads is not None else list(range(1, cpus + 1))
    if not tlist:
        raise MoefleetError("no thread counts given", f"pass e.g. --threads 1,{cpus}")
    for v in tlist:
        if v < 1 or v > cpus:
            raise MoefleetError(
                f"thread count {v} is outside 1..{cpus} (this machine's CPUs)",
                f"pass thread counts between 1 and {cpus}, e.g. --threads 1,{cpus}",
            )
    blist = sorted(set(batch_sizes))
    if not blist:
        raise MoefleetError("no batch sizes given", "pass e.g. --batch-sizes 1,16,128,512")
    for n in blist:
        if n < 1:
            raise MoefleetError(
                f"batch size {n} is not a positive number of tokens",
                "pass batch sizes ≥ 1, e.g. --batch-sizes 1,16,128,512",
            )
        if n > MAX_CALL_TOKENS:
            raise MoefleetError(f"batch size {n} exceeds the limit {MAX_CALL_TOKENS} tokens "
                                "per timed call", "see README, 'Limits'")
    if len(blist) < 2:
        raise MoefleetError(
            f"batch sizes {blist}: the batch law t = a + b*n needs at least two sizes",
            "pass e.g. --batch-sizes 1,16,256")
    if repeats < 1 or repeats > 1000:
        raise MoefleetError(f"repeats must be in 1..1000, got {repeats}",
                            "pass e.g. --repeats 3")
    return tlist, blist


def _expert_runners(
    expert: torch.nn.Module, sizes: Sequence[int], hidden: int, gen: torch.Generator
) -> tuple[list[Callable[[], object]], list[int]]:
    # inputs in the expert's own dtype (a bf16 expert refuses fp32 activations); drawn in
    # fp32 first so every dtype times the same numbers
    dtype = next(expert.parameters()).dtype
    runners: list[Callable[[], object]] = []
    for n in sizes:
        x_ND = torch.randn(n, hidden, generator=gen).to(dtype)
        runners.append(functools.partial(expert, x_ND))
    return runners, list(sizes)


def _segment_runners(
    adapter: MoEModelAdapter, layer: int, sizes: Sequence[int], seq_len: int,
    gen: torch.Generator,
) -> tuple[list[Callable[[], object]], list[int]]:
    is_moe = layer in set(adapter.moe_layers)
    first, last = layer == 0, layer == adapter.num_layers - 1
    runners: list[Callable[[], object]] = []
    tokens: list[int] = []
    for n in sizes:
        t = min(n, seq_len)
        ids_BT = torch.randint(0, adapter.vocab_size, (math.ceil(n / t), t), generator=gen)
        h0_BTD, ctx0 = adapter.begin(ids_BT, None)

        def run(ids_BT: torch.Tensor = ids_BT, h0_BTD: torch.Tensor = h0_BTD,
                ctx0: Any = ctx0) -> object:
            h_BTD, ctx = adapter.begin(ids_BT, None) if first else (h0_BTD, ctx0)
            residual_BTD, x_BTD = adapter.pre_moe(layer, h_BTD, ctx)
            routed_BTD = None
            if is_moe:
                adapter.route(layer, x_BTD.reshape(-1, x_BTD.shape[-1]))
                routed_BTD = torch.zeros_like(x_BTD)  # experts run elsewhere
            out_BTD = adapter.post_moe(layer, residual_BTD, x_BTD, routed_BTD)
            return adapter.finish(out_BTD, ctx) if last else out_BTD

        runners.append(run)
        tokens.append(int(ids_BT.numel()))
    return runners, tokens


def _fit_function(
    tokens: list[int], threads: list[int], samples: dict[int, list[list[float]]],
    pbytes: int,
) -> tuple[FunctionProfile, dict[str, Any]]:
    """Fit both laws to pooled samples[v][cell] and keep the evidence for ``raw``."""
    medians = {v: [median(s) for s in samples[v]] for v in threads}
    bfit = fit_batch_law(tokens, medians[1])  # measure_profile guarantees 1 in threads
    # Cells are in increasing token order at every v, so the largest batch comes last
    # (at v > 1 it may be the only cell measured).
    per_tok = [medians[v][-1] / tokens[-1] for v in threads]
    # v vCPUs can always run with fewer threads, so the law fits the running minimum: a
    # thread count that lost to contention (or to threading overhead on a small model)
    # must not make more vCPUs look slower.
    envelope = [min(per_tok[: j + 1]) for j in range(len(per_tok))]
    tfit = fit_thread_law(threads, envelope)
    law = FunctionProfile(batch=bfit.law, threads=tfit.law, param_bytes=pbytes,
                          batch_r2=bfit.r2, threads_r2=tfit.r2)
    raw = {
        "tokens": tokens,
        "threads": threads,
        "tokens_by_threads": {str(v): tokens[len(tokens) - len(samples[v]):] for v in threads},
        "median_s": {str(v): medians[v] for v in threads},
        "min_s": {str(v): [min(s) for s in samples[v]] for v in threads},
        "calls_per_cell": {str(v): [len(c) for c in samples[v]] for v in threads},
        "batch_fit": {"r2": bfit.r2, "residuals_s": bfit.residuals_s,
                      "degenerate": bfit.degenerate, "weights": "relative (1/t)"},
        "thread_fit": {"tokens": tokens[-1], "per_token_s": per_tok,
                       "envelope_s": envelope, "r2": tfit.r2,
                       "residuals_s": tfit.residuals_s, "method": tfit.method,
                       "notes": tfit.notes},
    }
    return law, raw


@torch.inference_mode()
def measure_profile(
    adapter: MoEModelAdapter,
    *,
    threads: Sequence[int] | None = None,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    repeats: int = DEFAULT_REPEATS,
    progress: ProgressFn | None = None,
    seed: int = 0,
    experts_per_layer: int = DEFAULT_EXPERTS_PER_LAYER,
    seq_len: int = DEFAULT_SEQ_LEN,
    min_repeat_s: float = MIN_REPEAT_S,
    full_thread_grid: bool = False,
) -> ComputeProfile:
    """Time every expert kind and segment of ``adapter``; fit and return the profile.

    ``threads`` defaults to 1..CPUs and must include 1 (the batch law is a one-thread
    law). ``batch_sizes`` are token counts; at least two distinct ones are needed to
    separate overhead from per-token time. At one thread every batch size is timed; at
    more threads only the largest, which is all the thread law reads (every size with
    ``full_thread_grid``, kept in ``raw``). The torch thread setting is restored on
    return; the adapter's weights are not touched.
    """
    tlist, blist = check_grid(threads, batch_sizes, repeats)
    if 1 not in tlist:
        raise MoefleetError(f"thread counts {tlist} lack 1; the batch law is fitted at one "
                            "thread", "include 1, e.g. --threads 1,2")
    if experts_per_layer < 1 or seq_len < 1:
        raise MoefleetError(f"experts_per_layer ({experts_per_layer}) and seq_len "
                            f"({seq_len}) must be ≥ 1", "pass positive values")
    started, load_start = time.perf_counter(), load_avg()
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    moe_layers, hidden = list(adapter.moe_layers), adapter.hidden_size
    picks = {
        layer: sorted(rng.sample(range(adapter.num_experts(layer)),
                                 min(experts_per_layer, adapter.num_experts(layer))))
        for layer in moe_layers
    }

    def cells(v: int) -> int:
        # The thread law only reads the largest batch, so v > 1 measures just that cell
        # unless the full grid is asked for: on a busy machine multi-threaded calls are
        # the slow ones (each stalls for a scheduler slice).
        return len(blist) if v == 1 or full_thread_grid else 1

    functions = sum(len(p) for p in picks.values()) + adapter.num_layers
    total = functions * sum(cells(v) for v in tlist)
    done = 0

    def measure(build: Callable[[], tuple[list[Callable[[], object]], list[int]]],
                label: str) -> tuple[list[int], dict[int, list[list[float]]]]:
        nonlocal done
        runners, tokens = build()
        pooled: dict[int, list[list[float]]] = {}
        for v in tlist:
            if progress:
                progress(done, total, f"{label} @ {v} thread{'s' * (v > 1)}")
            mine = runners[len(runners) - cells(v):]
            with torch_threads(v):
                pooled[v] = time_cells(mine, repeats, min_repeat_s, clock_for(v))
            done += len(mine)
        return tokens, pooled

    experts: dict[int, FunctionProfile] = {}
    raw_experts: dict[str, Any] = {}
    for layer in moe_layers:
        merged: dict[int, list[list[float]]] = {v: [[] for _ in range(cells(v))] for v in tlist}
        tokens: list[int] = list(blist)
        pbytes = 0
        for i in picks[layer]:
            module = adapter.expert(layer, i).eval()
            pbytes = param_bytes(module)
            tokens, got = measure(
                functools.partial(_expert_runners, module, blist, hidden, gen),
                f"expert {layer}.{i}",
            )
            for v in tlist:  # pool samples of the sampled experts cell by cell
                for cell, s in enumerate(got[v]):
                    merged[v][cell].extend(s)
        experts[layer], raw_experts[str(layer)] = _fit_function(tokens, tlist, merged, pbytes)
        raw_experts[str(layer)]["experts_sampled"] = picks[layer]

    segments: list[FunctionProfile] = []
    raw_segments: list[dict[str, Any]] = []
    for layer in range(adapter.num_layers):
        tokens, got = measure(
            functools.partial(_segment_runners, adapter, layer, blist, seq_len, gen),
            f"segment {layer}",
        )
        law, raw = _fit_function(tokens, tlist, got, param_bytes(adapter.segment(layer)))
        raw["includes"] = _segment_parts(adapter, layer)
        segments.append(law)
        raw_segments.append(raw)
    if progress:
        progress(total, total, "done")
    notes: list[str] = []
    if load_start is not None and load_start[0] + max(tlist) > available_cpus() + 0.5:
        notes.append(
            f"machine busy (load average {load_start[0]} on {available_cpus()} CPUs): "
            f"timings at {max(tlist)} threads compete with other processes; re-measure on "
            "an idle machine for a trustworthy thread law"
        )
    profile = ComputeProfile(
        model=adapter.name,
        hidden_size=hidden,
        moe_layers=moe_layers,
        experts=experts,
        segments=segments,
        bytes_per_token=hidden * 4,  # one fp32 hidden vector per token, each way
        machine=machine_info(),
        raw={
            "clocks": {"1": "thread CPU time", ">1": "wall time"},
            "settings": {"threads": tlist, "batch_sizes": blist, "repeats": repeats,
                         "seed": seed, "experts_per_layer": experts_per_layer,
                         "seq_len": seq_len, "min_repeat_s": min_repeat_s,
                         "full_thread_grid": full_thread_grid},
            "wall_s": round(time.perf_counter() - started, 3),
            "load_avg": {"start": load_start, "end": load_avg()},
            "notes": notes,
            "experts": raw_experts,
            "segments": raw_segments,
        },
    )
    return add_memory(profile, adapter)


def add_memory(profile: ComputeProfile, adapter: MoEModelAdapter) -> ComputeProfile:
    """``profile`` with the runtime footprints and the experts' intermediate memory per
    token measured (:mod:`moefleet.profiles.footprint`); fields already there are kept."""
    from moefleet.profiles.footprint import intermediate_per_token, measure_runtime_footprints

    if not profile.runtime_bytes:
        profile.runtime_bytes = measure_runtime_footprints()
    for layer in profile.moe_layers:
        if layer not in profile.intermediate_bytes_per_token:
            module = adapter.expert(layer, 0).eval()
            profile.intermediate_bytes_per_token[layer] = intermediate_per_token(
                module, adapter.hidden_size)
    return profile


def _segment_parts(adapter: MoEModelAdapter, layer: int) -> list[str]:
    parts = ["begin (embedding, masks, positions)"] if layer == 0 else []
    parts.append("pre_moe (norms, attention, residual)")
    if layer in set(adapter.moe_layers):
        parts += ["gate (router + top-k)", "post_moe (shared experts, residual)"]
    else:
        parts.append("post_moe (dense MLP, residual)")
    if layer == adapter.num_layers - 1:
        parts.append("finish (final norm, head on every token)")
    return parts
