"""One prefill batch at a time through an opened engine, with what a measurement reads of
it: the model's outputs, the invocation records, each MoE layer's calls and times (the
ODS/BO benchmarks and the runtime tests). Each batch is one engine step: open the engine
with :func:`moefleet.compose.score.score_options` sized for the batches."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from moefleet.compose.root import OpenedEngine
from moefleet.compose.run import run_billed
from moefleet.compose.score import SCORE
from moefleet.errors import MoefleetError
from moefleet.runtime.segments import SegmentRunner


@dataclass
class LayerRun:
    layer: int
    method: str
    invocations: int
    token_slots: int
    scatter_s: float
    experts_s: float
    gather_s: float

    @property
    def moe_s(self) -> float:
        return self.scatter_s + self.experts_s + self.gather_s


@dataclass
class BatchRun:
    output: torch.Tensor  # [B, T, X], zeros at padding
    records: list[Any]
    layers: list[LayerRun]
    latency_s: float
    tokens: int
    request_ids: list[str]


class Batches:
    """An opened engine (the segment runner, or the in-process runner with remote experts);
    :meth:`run_batch` runs one batch."""

    def __init__(self, opened: OpenedEngine) -> None:
        self.opened = opened
        self._n = 0

    @property
    def oversize_splits(self) -> int:
        rx = self.opened.remote
        return rx.oversize_splits if rx is not None else 0

    def run_batch(self, ids_BT: torch.Tensor, mask_BT: torch.Tensor | None = None,
                  request_ids: list[str] | None = None) -> BatchRun:
        B, T = ids_BT.shape
        mask = torch.ones_like(ids_BT) if mask_BT is None else mask_BT
        rows = [ids_BT[b, : int(mask[b].sum())].tolist() for b in range(B)]
        rids = request_ids or [f"b{self._n}-{b}" for b in range(B)]
        self._n += 1
        backend, rx, runner = self.opened.backend, self.opened.remote, self.opened.runner
        dep = self.opened.deployment
        if backend is None or rx is None or dep is None:
            raise MoefleetError("batches need a deployed plan", "open the engine with a plan")
        before = len(backend.records())
        stats0 = {k: (v.invocations, v.token_slots) for k, v in rx.stats.items()}
        steps0 = len(self.opened.engine.stats.steps)
        t0 = time.perf_counter()
        run = run_billed(self.opened, rows, SCORE, request_ids=rids)
        latency = time.perf_counter() - t0
        errors = [o.error for o in run.outputs if o.finish_reason == "error"]
        if errors:
            raise MoefleetError(f"the batch failed: {errors[0]}", "see the cause")
        if len(self.opened.engine.stats.steps) != steps0 + 1:
            raise MoefleetError("the batch took several engine steps",
                                "open the engine with score_options(batch size, length)")
        outs = [o.prompt_outputs for o in run.outputs]
        if any(o is None for o in outs):
            raise MoefleetError("a scored request came back without outputs", "a bug")
        out = torch.zeros(B, T, outs[0].shape[-1], dtype=outs[0].dtype)  # type: ignore[union-attr]
        for b, y in enumerate(outs):
            assert y is not None
            out[b, : y.shape[0]] = y
        layers = []
        segment = runner if isinstance(runner, SegmentRunner) else None
        for lp in dep.plan.layers:
            st = rx.stats.get(lp.layer)
            inv0, slots0 = stats0.get(lp.layer, (0, 0))
            lt = segment.layers.get(lp.layer) if segment is not None else None
            times = (lt.scatter_s[-1], lt.experts_s[-1], lt.gather_s[-1]) if lt else (
                0.0, 0.0, 0.0)
            layers.append(LayerRun(lp.layer, lp.method,
                                   (st.invocations if st else 0) - inv0,
                                   (st.token_slots if st else 0) - slots0, *times))
        audit = getattr(self.opened.biller, "audit", None)
        if audit is not None:  # this engine's own records (others may run at once)
            seen: dict[int, Any] = {}
            for rid in rids:
                for rec, _ in audit.pop(rid, []):
                    seen.setdefault(id(rec), rec)
            records = sorted(seen.values(), key=lambda r: r.end_s)
        else:
            records = backend.records()[before:]
        return BatchRun(out, records, layers, latency, sum(len(r) for r in rows), rids)


