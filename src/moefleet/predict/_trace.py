"""A trace's columns as flat numpy arrays, plus the per-request views predictors need.

Shape legend: N rows (one per token and MoE layer), K top-k, P requests, L MoE layers,
E experts (padded to the largest layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import pyarrow as pa

from moefleet.errors import DataError
from moefleet.predict.base import ModelShape, Request
from moefleet.traces.schema import Trace


@dataclass(frozen=True)
class TraceArrays:
    """Row-aligned columns of a trace.

    Invariants: all arrays have N rows; ``layer_idx_N`` indexes ``shape.moe_layers``;
    ``req_idx_N`` indexes ``request_ids`` (requests in order of first appearance).
    """

    shape: ModelShape
    request_ids: list[str]
    req_idx_N: np.ndarray
    layer_idx_N: np.ndarray
    pos_N: np.ndarray
    tok_N: np.ndarray
    att_N: np.ndarray
    ids_NK: np.ndarray

    @classmethod
    def from_trace(cls, trace: Trace, shape: ModelShape | None = None) -> TraceArrays:
        shape = shape or ModelShape.from_trace(trace)
        rid_col = trace.table.column("request_id").combine_chunks()
        enc = cast(pa.DictionaryArray, rid_col.dictionary_encode())
        req_idx_N = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        layer_N = trace.column("layer").astype(np.int64)
        lookup = np.full(max(max(shape.moe_layers), int(layer_N.max(initial=0))) + 1, -1, np.int64)
        lookup[list(shape.moe_layers)] = np.arange(shape.num_moe_layers)
        layer_idx_N = lookup[layer_N]
        if (layer_idx_N < 0).any():
            bad = sorted(set(layer_N[layer_idx_N < 0].tolist()))[:5]
            raise DataError(f"trace rows name layers {bad} that are not MoE layers "
                            f"{shape.moe_layers}", "re-record the trace with moefleet profile")
        ids_NK = trace.column("expert_ids").astype(np.int64)
        limit_N = np.asarray(shape.num_experts)[layer_idx_N]
        if ids_NK.size and ((ids_NK < 0).any() or (ids_NK >= limit_N[:, None]).any()):
            raise DataError("trace has expert ids outside [0, num_experts)",
                            "re-record the trace with moefleet profile")
        return cls(
            shape=shape,
            request_ids=[str(x) for x in enc.dictionary.to_pylist()],
            req_idx_N=req_idx_N,
            layer_idx_N=layer_idx_N,
            pos_N=trace.column("position_id").astype(np.int64),
            tok_N=trace.column("token_id").astype(np.int64),
            att_N=trace.column("attention_id").astype(np.int64),
            ids_NK=ids_NK,
        )

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    def requests(self) -> list[Request]:
        """Each request's token ids ordered by position (read from the first MoE layer)."""
        sel = np.flatnonzero(self.layer_idx_N == 0)
        order = sel[np.lexsort((self.pos_N[sel], self.req_idx_N[sel]))]
        bounds = np.searchsorted(self.req_idx_N[order], np.arange(self.num_requests + 1))
        toks = self.tok_N[order]
        return [
            Request(rid, tuple(toks[bounds[p] : bounds[p + 1]].tolist()))
            for p, rid in enumerate(self.request_ids)
        ]

    def request_expert_ids(self) -> list[np.ndarray]:
        """ids_LTK of each request (its real top-K experts per layer and position)."""
        order = np.lexsort((self.pos_N, self.layer_idx_N, self.req_idx_N))
        bounds = np.searchsorted(self.req_idx_N[order], np.arange(self.num_requests + 1))
        L, K = self.shape.num_moe_layers, self.ids_NK.shape[1]
        return [self.ids_NK[order[bounds[p] : bounds[p + 1]]].reshape(L, -1, K)
                for p in range(self.num_requests)]

    def request_counts(self) -> np.ndarray:
        """counts_PLE: token slots per (request, layer, expert)."""
        L, E = self.shape.num_moe_layers, self.shape.max_experts
        flat = ((self.req_idx_N * L + self.layer_idx_N)[:, None] * E + self.ids_NK).reshape(-1)
        n = self.num_requests * L * E
        counts = np.bincount(flat, minlength=n)[:n].astype(np.float64)
        return counts.reshape(self.num_requests, L, E)

    def counts_LE(self) -> np.ndarray:
        """counts_LE over the whole trace."""
        return self.request_counts().sum(axis=0)

    def token_frequency(self) -> tuple[np.ndarray, np.ndarray]:
        """(token ids ascending, how often each occurs) over the tokens of the trace."""
        tok = self.tok_N[self.layer_idx_N == 0]
        ids, freq = np.unique(tok, return_counts=True)
        return ids, freq.astype(np.float64)
