"""Expert routing in the simulator: how many tokens each expert of a layer gets.

A :class:`Router` answers ``counts(li, n, rng, request_id) -> counts_E``: for ``n``
tokens of MoE layer number ``li`` (0-based position in ``moe_layers``), token slots per
expert; the sum is ``n * top_k``. Implementations:

- :class:`TraceRowRouter`: per-token rows of a routing trace. A request the trace
  recorded, with the same token count, is replayed exactly (its own tokens' experts);
  otherwise ``n`` rows of that layer are drawn with replacement and their top-k ids
  counted. Keeps the joint top-k structure (a token never picks an expert twice) and
  the trace's skew.
- :class:`DistributionRouter`: a per-layer expert distribution (a trace's empirical
  popularity, a predictor's ``counts_LE``, or uniform); slots are drawn multinomially,
  so one token may (rarely) land twice on an expert; each count is capped at ``n`` and
  the excess re-drawn over the other experts, keeping the sum at ``n * top_k``.

All draws use the simulator's numpy Generator: same seed, same counts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np

from moefleet.errors import DataError

if TYPE_CHECKING:  # importing moefleet.traces loads torch; a router only reads the table
    from moefleet.traces.schema import Trace


class Router(ABC):
    top_k: int
    num_experts: list[int]

    @abstractmethod
    def counts(self, li: int, n: int, rng: np.random.Generator,
               request_id: str | None = None) -> np.ndarray:
        """Token slots per expert (int64, length ``num_experts[li]``, sum ``n * top_k``).
        ``request_id`` names the request when the pass is one request's (else None)."""

    def describe(self) -> dict[str, object]:
        return {"kind": type(self).__name__, "top_k": self.top_k,
                "num_experts": list(self.num_experts)}


class DistributionRouter(Router):
    """Multinomial slots from per-layer probabilities ``p_LE`` (rows normalised)."""

    def __init__(self, p_LE: Sequence[Sequence[float] | np.ndarray] | np.ndarray,
                 top_k: int) -> None:
        rows = [np.asarray(p, dtype=np.float64) for p in p_LE]
        if not rows:
            raise DataError("a routing distribution needs at least one MoE layer")
        self.top_k = int(top_k)
        self.num_experts = [len(r) for r in rows]
        self.p_LE: list[np.ndarray] = []
        for li, r in enumerate(rows):
            if len(r) < self.top_k or not np.all(np.isfinite(r)) or np.any(r < 0) or r.sum() <= 0:
                raise DataError(
                    f"MoE layer #{li}: expert distribution must be >= 0 with a positive sum "
                    f"over at least top_k={self.top_k} experts, got {r.tolist()}",
                    "check the predicted counts or the trace")
            self.p_LE.append(r / r.sum())

    @classmethod
    def uniform(cls, num_experts: Sequence[int], top_k: int) -> DistributionRouter:
        return cls([np.full(e, 1.0 / e) for e in num_experts], top_k)

    @classmethod
    def from_counts(cls, counts_LE: Sequence[Sequence[float]] | np.ndarray,
                    num_experts: Sequence[int], top_k: int) -> DistributionRouter:
        """From predicted (or counted) slots per expert, ``counts_LE`` padded to the
        largest layer (an ``ExpertPredictor.predict_counts`` result); rows are cut to
        each layer's ``num_experts``."""
        rows = [np.asarray(row, dtype=np.float64) for row in counts_LE]
        if len(rows) != len(num_experts):
            raise DataError(f"counts for {len(rows)} MoE layers, the plan has "
                            f"{len(num_experts)}", "predict counts for this model's layers")
        return cls([row[:e] for row, e in zip(rows, num_experts, strict=True)], top_k)

    @classmethod
    def from_trace(cls, trace: Trace) -> DistributionRouter:
        return cls([row[: trace.num_experts(layer)]
                    for row, layer in zip(trace.popularity(), trace.moe_layers, strict=True)],
                   trace.top_k)

    def counts(self, li: int, n: int, rng: np.random.Generator,
               request_id: str | None = None) -> np.ndarray:
        p = self.p_LE[li]
        out: np.ndarray = rng.multinomial(n * self.top_k, p)
        over = out > n
        if over.any():
            # One token takes an expert once: move the excess to the other experts.
            excess = int((out[over] - n).sum())
            out[over] = n
            q = np.where(over, 0.0, p)
            while excess:
                extra = rng.multinomial(excess, q / q.sum())
                out += extra
                spill = np.maximum(out - n, 0)
                out -= spill
                excess = int(spill.sum())
                q = np.where(out >= n, 0.0, q)
        return out


class TraceRowRouter(Router):
    """Per-token rows of a routing trace: exact replay of recorded requests, else rows
    sampled with replacement per layer."""

    def __init__(self, trace: Trace) -> None:
        self.top_k = trace.top_k
        self.num_experts = [trace.num_experts(layer) for layer in trace.moe_layers]
        layer_col = trace.column("layer")
        ids_NK = trace.column("expert_ids").astype(np.int64)
        rids, rid_N = np.unique(trace.column("request_id").astype(str), return_inverse=True)
        self.request_index = {str(r): i for i, r in enumerate(rids)}
        self.ids: list[np.ndarray] = []
        self.replay_RE: list[np.ndarray] = []  # per layer: slots per (request, expert)
        self.tokens_R: list[np.ndarray] = []  # per layer: tokens per request
        for layer, e in zip(trace.moe_layers, self.num_experts, strict=True):
            sel = layer_col == layer
            rows = ids_NK[sel]
            if rows.size == 0:
                raise DataError(f"routing trace has no rows for MoE layer {layer}",
                                "record a trace that covers every MoE layer")
            if rows.min() < 0 or rows.max() >= e:
                raise DataError(f"routing trace layer {layer}: expert ids outside 0..{e - 1}",
                                "re-record the trace")
            self.ids.append(rows)
            req = rid_N[sel]
            table = np.zeros((len(rids), e), dtype=np.int64)
            np.add.at(table, (np.repeat(req, self.top_k), rows.reshape(-1)), 1)
            self.replay_RE.append(table)
            self.tokens_R.append(np.bincount(req, minlength=len(rids)))

    def counts(self, li: int, n: int, rng: np.random.Generator,
               request_id: str | None = None) -> np.ndarray:
        if request_id is not None:
            r = self.request_index.get(request_id)
            if r is not None and self.tokens_R[li][r] == n:
                return self.replay_RE[li][r].copy()
        rows = self.ids[li]
        pick = rows[rng.integers(0, len(rows), size=n)]
        return np.bincount(pick.reshape(-1), minlength=self.num_experts[li])


def router_from_trace(trace: Trace, mode: Literal["rows", "distribution"] = "rows") -> Router:
    """A router replaying ``trace``: per-token rows (default) or its per-layer popularity."""
    if mode == "rows":
        return TraceRowRouter(trace)
    if mode == "distribution":
        return DistributionRouter.from_trace(trace)
    raise DataError(f"routing mode must be 'rows' or 'distribution', got {mode!r}")
