"""A measured run: prompts → batches → executor → billed cost, latency, throughput.

``run_workload`` tokenises prompts (the profiler's rules: in order, truncated, exactly
``max_tokens`` tokens), right-pads them into batches, runs every batch through the
:class:`Executor`, optionally checks each output against the monolithic model, and
:func:`summarize` prices the invocation records with the platform's ``Meter``.

Cost attribution per request: an invocation's billed cost is split over the requests whose
tokens it processed, in proportion to their token counts (segment functions: real tokens
per row; expert replicas: the row of each token they served); the executor's own store
requests are split by real tokens. Invariant: the per-request costs sum to the total.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from moefleet.errors import MoefleetError
from moefleet.models.base import MoEModelAdapter
from moefleet.platform import Meter, PlatformSpec
from moefleet.runtime.executor import BatchResult, Executor

Batch = tuple[torch.Tensor, torch.Tensor, list[str]]  # ids_BT, mask_BT, request ids


def make_batches(adapter: MoEModelAdapter, request_ids: Sequence[str], texts: Sequence[str], *,
                 max_tokens: int, max_length: int, batch_size: int) -> list[Batch]:
    from moefleet.traces.profile import tokenize_prompts

    if batch_size <= 0:
        raise MoefleetError(f"--batch-size must be positive, got {batch_size}", "use e.g. 8")
    kept = tokenize_prompts(adapter, texts, max_tokens=max_tokens, max_length=max_length)
    pad = 0
    tok = adapter.tokenizer
    if tok is not None and getattr(tok, "pad_token_id", None) is not None:
        pad = int(tok.pad_token_id)
    batches: list[Batch] = []
    for start in range(0, len(kept), batch_size):
        chunk = kept[start : start + batch_size]
        T = max(len(s) for _, s in chunk)
        ids = torch.full((len(chunk), T), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), T), dtype=torch.long)
        for b, (_, seq) in enumerate(chunk):
            ids[b, : len(seq)] = torch.tensor(seq)
            mask[b, : len(seq)] = 1
        batches.append((ids, mask, [request_ids[i] for i, _ in chunk]))
    return batches


def run_workload(executor: Executor, batches: list[Batch], *,
                 reference: MoEModelAdapter | None = None, tolerance: float = 1e-4,
                 progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Run ``batches``; with ``reference`` every output is compared to the monolithic
    model's (raises when the max abs difference exceeds ``tolerance``)."""
    results: list[BatchResult] = []
    max_diff: float | None = None
    t0 = time.perf_counter()
    for i, (ids, mask, rids) in enumerate(batches):
        res = executor.run_batch(ids, mask, rids)
        results.append(res)
        if reference is not None:
            # Real tokens only: padding never reaches an expert (its MoE output is 0).
            real_BT = mask.bool() if mask is not None else slice(None)
            diff = float((res.output - reference.reference_forward(ids, mask))[real_BT]
                         .abs().max())
            max_diff = diff if max_diff is None else max(max_diff, diff)
            if diff > tolerance:
                raise MoefleetError(
                    f"batch {i}: the deployed model's output differs from the monolithic "
                    f"model by {diff:.3g} (> {tolerance:g})",
                    "the deployment does not match the model; redeploy it")
        if progress:
            progress(i + 1, len(batches))
    summary = summarize(executor, results, time.perf_counter() - t0)
    summary["max_abs_diff"] = max_diff
    # direct shares the plan undercounted, sent as extra (billed) invocations
    summary["oversize_splits"] = executor.oversize_splits
    return summary


def summarize(executor: Executor, results: list[BatchResult], wall_s: float) -> dict[str, Any]:
    """Billed cost (per layer, per kind, per request), latency, throughput, cold starts."""
    platform: PlatformSpec = executor.platform
    meter = Meter(platform)
    by_request: dict[str, float] = defaultdict(float)
    for res in results:
        for record, shares in res.attribution:
            cost = meter.add(record).total
            for rid, frac in shares.items():
                by_request[rid] += cost * frac
    puts, gets = executor.client_requests()
    client = meter.add_storage(puts, gets, function="<executor>").total
    tokens = sum(r.tokens for r in results)
    if tokens:
        for res in results:
            for rid, frac in _row_tokens(res).items():
                by_request[rid] += client * frac * res.tokens / tokens
    bill = meter.bill()
    latencies = [r.latency_s for r in results]
    busy = sum(latencies)
    layers = []
    for layer in executor.dep.moe_layers:
        stats = [s for r in results for s in r.layers if s.layer == layer]
        if not stats:
            continue
        records = [rec for r in results for rec in r.records if rec.layer == layer]
        layers.append({
            "layer": layer, "method": stats[0].method, "beta": stats[0].beta,
            "moe_latency_s": statistics.median(s.moe_s for s in stats),
            "moe_latency_s_max": max(s.moe_s for s in stats),
            "scatter_s": statistics.mean(s.scatter_s for s in stats),
            "experts_s": statistics.mean(s.experts_s for s in stats),
            "gather_s": statistics.mean(s.gather_s for s in stats),
            "invocations": len(records), "cold_starts": sum(rec.cold for rec in records),
            "cost_usd": bill.by_layer[layer].total if layer in bill.by_layer else 0.0,
        })
    return {
        "model": executor.dep.model, "platform": platform.name,
        "backend": executor.backend.name, "batches": len(results), "tokens": tokens,
        "positions": sum(r.positions for r in results),
        "latency_s": {"per_batch": latencies, "median": statistics.median(latencies)
                      if latencies else 0.0, "total": busy},
        "wall_s": wall_s,
        "throughput_tokens_per_s": tokens / busy if busy > 0 else 0.0,
        "cost_usd": {"total": bill.total.total, "per_1k_tokens": 1000 * bill.total.total
                     / tokens if tokens else 0.0, **bill.total.to_dict(),
                     "by_layer": {str(k): v.total for k, v in sorted(bill.by_layer.items())},
                     "by_kind": {k: v.total for k, v in sorted(bill.by_kind.items())}},
        "layers": layers,
        "invocations": bill.invocations, "cold_starts": bill.cold_starts,
        "init_s_total": sum(rec.init_s for r in results for rec in r.records),
        "by_request": dict(sorted(by_request.items())),
        "bill": bill.to_dict(),
    }


def _row_tokens(res: BatchResult) -> dict[str, float]:
    # Segment invocations carry the batch's per-row real-token split; reuse the first.
    for record, shares in res.attribution:
        if record.kind == "segment":
            return shares
    return {rid: 1.0 / len(res.request_ids) for rid in res.request_ids}
