"""A measured prefill run of a deployed plan: prompts scored in batches through an opened
engine, priced by the platform's meter (``moefleet run``, the demo, the benchmarks).

    with open_engine(adapter, plan=plan, options=score_options(batch_size, max_length),
                     store=store) as opened:
        summary = score(opened, prompts, reference=adapter)

Each prompt is a prefill-only request (``max_tokens`` 0); the engine admits them first
come, first served, ``batch_size`` at a time, so each step is one batch (the token budget
holds a whole batch: nothing is chunked). With the segment runner every block runs in the
plan's segment functions; with the in-process runner only the experts are remote.

Cost: every invocation record the backend kept (failed attempts included: a platform bills
them) priced by :class:`~moefleet.platform.Meter`, plus this process's own store requests;
per request, what the biller attributed (its share of each invocation by its tokens).
Invariant: with ``reference``, every request's outputs equal the monolithic model's to
``tolerance`` (else :class:`MoefleetError`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from moefleet.compose.billing import InvocationBiller
from moefleet.compose.options import EngineOptions
from moefleet.compose.root import OpenedEngine
from moefleet.compose.run import run_billed
from moefleet.engine import SamplingParams
from moefleet.errors import MoefleetError
from moefleet.models.base import MoEModelAdapter
from moefleet.platform import Meter
from moefleet.runtime.segments import SegmentRunner

SCORE = SamplingParams(max_tokens=0)


def score_options(batch_size: int, max_length: int, *, runner: str = "segments",
                  device: str = "cpu") -> EngineOptions:
    """Engine sizes that make each step one batch of up to ``batch_size`` whole prompts."""
    if batch_size < 1 or max_length < 2:
        raise MoefleetError(f"batch size {batch_size} and max length {max_length} must be "
                            ">= 1 and >= 2", "use e.g. --batch-size 8 --max-length 256")
    return EngineOptions(device=device, max_num_seqs=batch_size,
                         max_num_batched_tokens=batch_size * max_length,
                         max_model_len=max_length, runner=runner)  # type: ignore[arg-type]


def score(opened: OpenedEngine, prompts: Sequence[tuple[str, list[int]]], *,
          reference: MoEModelAdapter | None = None, tolerance: float = 1e-4,
          progress: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Score ``prompts`` (request id, token ids) and summarise (module docstring)."""
    if not prompts:
        raise MoefleetError("no prompts to run", "use a dataset with text in it")
    if opened.backend is None:
        raise MoefleetError("a measured run needs a deployed plan", "pass --plan")
    before = len(opened.backend.records())  # a running backend may have served others
    run = run_billed(opened, [ids for _, ids in prompts], SCORE, progress=progress,
                     request_ids=[rid for rid, _ in prompts])
    failed = [o for o in run.outputs if o.finish_reason == "error"]
    if failed:
        raise MoefleetError(f"{len(failed)} of {len(prompts)} requests failed: "
                            f"{failed[0].error}", "see the error; retry the run")
    max_diff = None
    if reference is not None:
        max_diff = max_abs_diff(reference, prompts, run.outputs, tolerance)
    steps = opened.engine.stats.steps
    latencies = [s.forward_s for s in steps]
    tokens = sum(len(ids) for _, ids in prompts)
    summary = _bill(opened, tokens, before)
    busy = sum(latencies)
    summary.update({
        "batches": len(steps), "tokens": tokens,
        "latency_s": {"per_batch": latencies,
                      "median": statistics.median(latencies) if latencies else 0.0,
                      "total": busy},
        "wall_s": run.wall_s,
        "throughput_tokens_per_s": tokens / busy if busy > 0 else 0.0,
        "by_request": {rid: c.total for (rid, _), c in zip(prompts, run.costs, strict=True)},
        "kind": "score", "max_abs_diff": max_diff,
        "oversize_splits": opened.remote.oversize_splits if opened.remote else 0,
        "runner": type(opened.runner).__name__, "notes": opened.notes,
    })
    return summary


def max_abs_diff(reference: MoEModelAdapter, prompts: Sequence[tuple[str, list[int]]],
                 outputs: Sequence[Any], tolerance: float = float("inf")) -> float:
    """The largest |deployed - monolithic| over every request's outputs; raises past
    ``tolerance``."""
    import torch

    worst = 0.0
    for (rid, ids), out in zip(prompts, outputs, strict=True):
        want = reference.reference_forward(torch.tensor([ids]))[0]
        diff = float((out.prompt_outputs.to(want.dtype) - want).abs().max())
        worst = max(worst, diff)
        if diff > tolerance:
            raise MoefleetError(
                f"request {rid}: the deployed model's output differs from the monolithic "
                f"model by {diff:.3g} (> {tolerance:g})",
                "the deployment does not match the model; redeploy it")
    return worst


def _bill(opened: OpenedEngine, tokens: int, before: int) -> dict[str, Any]:
    """The platform's bill over every record the backend kept since ``before``, per layer
    and kind."""
    biller = opened.biller
    if opened.deployment is None or opened.backend is None \
            or not isinstance(biller, InvocationBiller):
        raise MoefleetError("a measured run needs a deployed plan", "pass --plan")
    dep, backend = opened.deployment, opened.backend
    meter = Meter(biller.spec)
    records = backend.records()[before:]
    for r in records:
        meter.add(r)
    meter.add_storage(*opened.client_store_requests(), function="<engine>")
    bill = meter.bill()
    layer_times = opened.runner.layers if isinstance(opened.runner, SegmentRunner) else {}
    layers = []
    for layer in dep.moe_layers:
        recs = [r for r in records if r.layer == layer]
        lp = dep.plan.layer(layer)
        row: dict[str, Any] = {
            "layer": layer, "method": lp.method, "beta": lp.beta,
            "invocations": len(recs), "cold_starts": sum(r.cold for r in recs),
            "cost_usd": bill.by_layer[layer].total if layer in bill.by_layer else 0.0}
        lt = layer_times.get(layer)
        if lt is not None and lt.moe_s:
            row.update(moe_latency_s=statistics.median(lt.moe_s),
                       moe_latency_s_max=max(lt.moe_s),
                       scatter_s=statistics.mean(lt.scatter_s),
                       experts_s=statistics.mean(lt.experts_s),
                       gather_s=statistics.mean(lt.gather_s))
        layers.append(row)
    total = bill.total.total
    return {
        "model": dep.model, "platform": biller.spec.name,
        "backend": dep.backend,
        "cost_usd": {"total": total, "per_1k_tokens": 1000 * total / tokens if tokens else 0.0,
                     **bill.total.to_dict(),
                     "by_layer": {str(k): v.total for k, v in sorted(bill.by_layer.items())},
                     "by_kind": {k: v.total for k, v in sorted(bill.by_kind.items())}},
        "layers": layers, "invocations": bill.invocations, "cold_starts": bill.cold_starts,
        "init_s_total": sum(r.init_s for r in records), "bill": bill.to_dict(),
    }
