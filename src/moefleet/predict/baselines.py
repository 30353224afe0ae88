"""Baseline predictors: token-id MAP ("lina"), historical average ("dop"), equal ("ef").

Shape legend: L MoE layers, E experts (padded), K top-k, T tokens, U distinct contexts.

- ``LinaPredictor``: each token goes to the K experts it visited most often in the
  profile, per layer (token id is the only feature; Lina, ATC'23, as ODS/BO compares
  against). Ties and unseen tokens fall back to the layer's overall popularity order.
  Counts are the counts of these MAP choices.
- ``DOPPredictor``: every batch gets the profile's per-layer slot shares, scaled to
  K x tokens (distribution-only prediction, as Remoe's DOP baseline).
- ``EFPredictor``: every expert of a layer gets K x tokens / E (equal frequency).
"""

from __future__ import annotations

from typing import Any, Self

import numpy as np

from moefleet.predict._sparse import SparseRows
from moefleet.predict._trace import TraceArrays
from moefleet.predict.base import (
    ExpertPredictor,
    ModelShape,
    Request,
    add_topk_counts,
    register_kind,
)
from moefleet.predict.table import MAX_TOKEN, TOKEN_BITS
from moefleet.traces.schema import Trace


def _marginal_LE(counts_LE: np.ndarray, shape: ModelShape) -> np.ndarray:
    """Slot shares per layer; uniform over a layer's experts where it has no counts."""
    tot = counts_LE.sum(axis=1, keepdims=True)
    uniform = shape.mask_LE() / np.asarray(shape.num_experts)[:, None]
    return np.where(tot > 0, counts_LE / np.where(tot > 0, tot, 1.0), uniform)


def _total_tokens(requests: list[Request]) -> int:
    return sum(r.num_tokens for r in requests)


@register_kind
class LinaPredictor(ExpertPredictor):
    """Token-id-only MAP top-K with back-off to the layer marginal (see module doc)."""

    kind = "lina"

    def __init__(self) -> None:
        super().__init__()
        self._rows: SparseRows | None = None
        self._marg_LE = np.zeros((0, 0))

    def _fit(self, trace: Trace) -> None:
        assert self.shape is not None
        ta = TraceArrays.from_trace(trace, self.shape)
        K = self.shape.top_k
        tok = np.minimum(ta.tok_N, MAX_TOKEN)
        key = np.repeat(ta.layer_idx_N << TOKEN_BITS | tok, K)
        self._rows = SparseRows.build(key, ta.ids_NK.reshape(-1), (np.ones(key.size),))
        self._marg_LE = _marginal_LE(ta.counts_LE(), self.shape)

    def _top(self, tok_T: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(layer per context, top_UK, inverse of the flattened (L, T) queries)."""
        assert self.shape is not None and self._rows is not None
        L, E = self.shape.num_moe_layers, self.shape.max_experts
        tok = np.minimum(tok_T, MAX_TOKEN + 1)
        key = (np.arange(L, dtype=np.int64)[:, None] << TOKEN_BITS | tok[None, :]).reshape(-1)
        uk, inv = np.unique(key, return_inverse=True)
        li = uk >> TOKEN_BITS
        row, found = self._rows.find(uk)
        # Integer counts + a share in [0, 1) keeps the count order and breaks its ties
        # (and orders unseen tokens) by the layer's popularity.
        score = self._rows.dense(row, found, E, 0) + 0.5 * self._marg_LE[li]
        score[~self.shape.mask_LE()[li]] = -1.0
        return li, np.argsort(-score, axis=1, kind="stable")[:, :k], inv.reshape(-1)

    def predict_topk(self, token_ids: Any, k: int) -> np.ndarray:
        """ids_LTK: the k experts each token visited most often in the profile."""
        self._check_k(k)
        assert self.shape is not None
        tok = np.asarray(token_ids, np.int64).reshape(-1)
        _, top, inv = self._top(tok, k)
        return top[inv].reshape(self.shape.num_moe_layers, tok.size, k)

    def _predict_counts(self, requests: list[Request]) -> np.ndarray:
        assert self.shape is not None
        counts_LE, tok = self._zero_counts_and_tokens(requests)
        if tok.size == 0:
            return counts_LE
        li, top, inv = self._top(tok, self.shape.top_k)
        add_topk_counts(counts_LE, li, top, np.bincount(inv, minlength=li.size).astype(np.float64))
        return counts_LE

    def _state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        assert self._rows is not None
        r = self._rows
        return {"key": r.key_C, "indptr": r.indptr_C1, "expert": r.expert_X,
                "count": r.values[0], "marg": self._marg_LE}, {}

    @classmethod
    def _from_state(cls, shape: ModelShape, arrays: dict[str, np.ndarray],
                    params: dict[str, Any]) -> Self:
        obj = cls()
        obj._rows = SparseRows(arrays["key"], arrays["indptr"], arrays["expert"],
                               (arrays["count"],))
        obj._marg_LE = arrays["marg"]
        return obj


@register_kind
class DOPPredictor(ExpertPredictor):
    """Historical per-layer slot shares, scaled to the batch (see module doc)."""

    kind = "dop"

    def __init__(self) -> None:
        super().__init__()
        self._marg_LE = np.zeros((0, 0))

    def _fit(self, trace: Trace) -> None:
        assert self.shape is not None
        self._marg_LE = _marginal_LE(TraceArrays.from_trace(trace, self.shape).counts_LE(),
                                     self.shape)

    def predict_topk(self, token_ids: Any, k: int) -> np.ndarray:
        """ids_LTK: the layer's k most popular experts, the same for every token."""
        self._check_k(k)
        assert self.shape is not None
        T = int(np.asarray(token_ids).size)
        score = np.where(self.shape.mask_LE(), self._marg_LE, -1.0)
        top_LK = np.argsort(-score, axis=1, kind="stable")[:, :k]
        return np.repeat(top_LK[:, None, :], T, axis=1)

    def _predict_counts(self, requests: list[Request]) -> np.ndarray:
        assert self.shape is not None
        return self._marg_LE * self.shape.top_k * _total_tokens(requests)

    def _state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        return {"marg": self._marg_LE}, {}

    @classmethod
    def _from_state(cls, shape: ModelShape, arrays: dict[str, np.ndarray],
                    params: dict[str, Any]) -> Self:
        obj = cls()
        obj._marg_LE = arrays["marg"]
        return obj


@register_kind
class EFPredictor(ExpertPredictor):
    """Equal frequency: K x tokens spread evenly over each layer's experts."""

    kind = "ef"

    def _fit(self, trace: Trace) -> None:
        pass  # nothing to learn beyond the model shape

    def _predict_counts(self, requests: list[Request]) -> np.ndarray:
        assert self.shape is not None
        share_LE = self.shape.mask_LE() / np.asarray(self.shape.num_experts)[:, None]
        return share_LE * self.shape.top_k * _total_tokens(requests)

    def _state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        return {}, {}

    @classmethod
    def _from_state(cls, shape: ModelShape, arrays: dict[str, np.ndarray],
                    params: dict[str, Any]) -> Self:
        return cls()
