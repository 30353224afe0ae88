"""Bayesian token-feature expert predictor (ODS/BO §III-B; READING-NOTES eq. 1).

Shape legend: L MoE layers, E experts (padded), K top-k, T tokens, U distinct query
contexts, C table contexts.

Features of a token: f1 token id, f2 position id, f3 attention id. The profiled table
(:class:`~moefleet.predict.table.CountTable`) holds n(e, f1, f2, f3, i). Before a token
runs only f1 (and, in position mode, f2) is known, so the others are marginalised with
the priors of the notes: P'(f2) uniform (a constant that cancels in the normalisation)
and P'(f3 = v) = frequency of token v in the profiled data. For layer e and token t:

    score(i)  = sum_{f2, f3} n(e, t, f2, f3, i) * P'(f3)
    q(i)      = score(i) / sum_j score(j)
    m         = sum_{f2, f3, i} n(e, t, f2, f3, i) / K        (tokens observed; unweighted)
    post(i)   = (m * q(i) + lam_tok * marg_e(i)) / (m + lam_tok)

``marg_e(i)`` here stands for the back-off prior of layer e, chosen by ``backoff``:
- ``"rare"`` (default): slot shares of the tokens seen at most ``rare_max`` times. An
  unseen token routes like a rare one, not like the average token, which frequent tokens
  ([CLS], punctuation, "the") dominate -- Good-Turing's reasoning;
- ``"layer"``: slot shares of all tokens of the layer;
- ``"position"``: P(i | e, position), itself shrunk to the layer marginal with
  ``backoff_smoothing``.
The pseudo-count ``lam_tok`` (``smoothing``) shrinks rarely seen tokens toward the prior;
an unseen token (m = 0) gets the prior exactly. (P* of the notes is n / N_e; N_e cancels
in q.) Defaults (lam_tok = 0, lam_pos = 0.3, rare back-off, rare_max = 2) come from a
grid on minilm-moe-e8 top-1/top-2: shrinking seen tokens raised the batch count error;
the rare back-off cut it by 7-40% within a domain (wikitext2, c4 80/20) but raised it
up to 7% from wikitext2 to c4; the position back-off changed it by < 1%.

Position mode conditions on the known position p and backs off to the token posterior:

    post_p(i) = (m_p * q_p(i) + lam_pos * post(i)) / (m_p + lam_pos)      (lam_pos > 0)

with q_p, m_p computed as above over the rows with f2 = p only.

``mode="auto"`` chooses token or position mode per MoE layer: it fits both on the first
(1 - holdout) of the profiled requests, scores each layer on the held-out requests with
the Brier score sum_i (K post(i) - [i among the real top-K])^2 per token, keeps the
better mode per layer (ties -> token) and refits on everything. ``layer_modes`` holds
the outcome. A per-token proper score, not the batch count error: counts of a batch
average over positions, so their error hides a position effect behind sampling noise.

Expected counts for a batch: counts_LE[e, i] = K * sum over the batch's tokens of
post(i | token, e). Every row sums to K * tokens; K * post(i) is the probability that i
is among the token's K experts. ``counts="map"`` instead counts each token's MAP top-K
(ODS/BO eq. 2) -- the quantity the paper's Fig. 10 evaluates.

P'(f3) of an attention id never seen as a token (or -1, "not recorded") is floored at
1 / (profiled tokens), as if seen once, so keys a BO loop adds are never weightless. If
the whole profiled trace has no attention ids, the weighting is switched off (weight 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Self

import numpy as np

from moefleet.errors import DataError
from moefleet.predict._sparse import SparseRows
from moefleet.predict._trace import TraceArrays
from moefleet.predict.base import (
    ExpertPredictor,
    ModelShape,
    Request,
    add_topk_counts,
    register_kind,
    token_array,
)
from moefleet.predict.table import (
    MAX_POSITION,
    MAX_TOKEN,
    POS_BITS,
    POS_MASK,
    POS_SHIFT,
    TOKEN_BITS,
    TOKEN_SHIFT,
    CountTable,
    unpack_context,
)
from moefleet.traces.schema import Trace

Mode = Literal["token", "position", "auto"]
LayerMode = Literal["token", "position"]
Backoff = Literal["layer", "rare", "position"]
CountsMode = Literal["expected", "map"]


@dataclass(frozen=True)
class _Stats:
    """Aggregates of the table, valid for one ``CountTable.version``."""

    version: int
    marg_LE: np.ndarray
    prior_LE: np.ndarray  # back-off prior of unseen tokens: marg_LE or the rare-token one
    tok: SparseRows  # key (layer, token); values (P'-weighted counts, raw counts)
    tok_m_C: np.ndarray
    pos: SparseRows | None  # key (layer, token, position); same values
    pos_m_C: np.ndarray | None
    lpos: SparseRows | None  # key (layer, position); values (raw counts,)
    lpos_m_C: np.ndarray | None


def _posterior_rows(rows: SparseRows, m_C: np.ndarray, keys_U: np.ndarray,
                    prior_UE: np.ndarray, lam: float) -> np.ndarray:
    """post_UE = (m q + lam prior) / (m + lam); the prior where nothing was observed."""
    E = prior_UE.shape[1]
    row, found = rows.find(keys_U)
    score_UE = rows.dense(row, found, E, 0)
    s_U = score_UE.sum(axis=1)
    m_U = np.where(found & (s_U > 0), m_C[row], 0.0)
    q_UE = score_UE / np.where(s_U > 0, s_U, 1.0)[:, None]
    denom = m_U + lam
    safe = np.where(denom > 0, denom, 1.0)
    post = (m_U[:, None] * q_UE + lam * prior_UE) / safe[:, None]
    return np.where((denom > 0)[:, None], post, prior_UE)


@register_kind
class BayesPredictor(ExpertPredictor):
    """MAP / expected-count expert prediction from token features (see module doc)."""

    kind = "bayes"

    def __init__(self, mode: Mode = "token", counts: CountsMode = "expected",
                 smoothing: float = 0.0, position_smoothing: float = 0.3,
                 attention_weighting: bool = True, holdout: float = 0.1,
                 backoff: Backoff = "rare", backoff_smoothing: float = 10.0,
                 rare_max: float = 2.0) -> None:
        super().__init__()
        if mode not in ("token", "position", "auto"):
            raise DataError(f"unknown mode {mode!r}", "use 'token', 'position' or 'auto'")
        if not 0 < holdout < 1:
            raise DataError(f"holdout must be in (0, 1), got {holdout}",
                            "use e.g. holdout=0.1 (10% of the profiled requests)")
        if backoff not in ("layer", "rare", "position"):
            raise DataError(f"unknown backoff {backoff!r}", "use 'layer', 'rare' or 'position'")
        if counts not in ("expected", "map"):
            raise DataError(f"unknown counts mode {counts!r}", "use 'expected' or 'map'")
        if smoothing < 0 or position_smoothing < 0 or backoff_smoothing < 0:
            raise DataError("smoothing pseudo-counts must be >= 0",
                            "use e.g. smoothing=1.0, position_smoothing=1.0")
        self.mode: Mode = mode
        self.counts: CountsMode = counts
        self.smoothing = float(smoothing)
        self.position_smoothing = float(position_smoothing)
        self.attention_weighting = attention_weighting
        self.holdout = float(holdout)
        self.backoff: Backoff = backoff
        self.backoff_smoothing = float(backoff_smoothing)
        self.rare_max = float(rare_max)
        self.layer_modes: tuple[LayerMode, ...] = ()
        self.table: CountTable | None = None
        self._vocab_ids = np.zeros(0, np.int64)
        self._vocab_freq = np.zeros(0)
        self._has_attention = False
        self._stats: _Stats | None = None

    # -- fitting ---------------------------------------------------------------------
    def _fit(self, trace: Trace) -> None:
        assert self.shape is not None
        ta = TraceArrays.from_trace(trace, self.shape)
        self.table = CountTable.from_rows(self.shape, ta.layer_idx_N, ta.tok_N, ta.pos_N,
                                          ta.att_N, ta.ids_NK)
        self._vocab_ids, self._vocab_freq = ta.token_frequency()
        self._has_attention = bool((ta.att_N >= 0).any())
        self._stats = None
        L = self.shape.num_moe_layers
        if self.mode == "auto":
            self.layer_modes = self._choose_layer_modes(trace, ta)
        else:
            only: LayerMode = "position" if self.mode == "position" else "token"
            self.layer_modes = tuple(only for _ in range(L))

    def _choose_layer_modes(self, trace: Trace, ta: TraceArrays) -> tuple[LayerMode, ...]:
        """Per layer, the mode with the lower held-out Brier score (module doc)."""
        assert self.shape is not None
        L, E, K = self.shape.num_moe_layers, self.shape.max_experts, self.shape.top_k
        n_fit = round(ta.num_requests * (1 - self.holdout))
        token: tuple[LayerMode, ...] = tuple("token" for _ in range(L))
        if n_fit < 1 or n_fit >= ta.num_requests:
            return token  # too few requests to hold any out
        head = Trace(trace.table.filter(np.isin(ta.req_idx_N, np.arange(n_fit))), trace.meta)
        held = ta.requests()[n_fit:]
        tok = token_array(held)
        pos = np.concatenate([np.arange(r.num_tokens) for r in held])
        ids_LTK = np.concatenate(ta.request_expert_ids()[n_fit:], axis=1)
        # y_LTE: 1 where the expert was among the token's real top-K.
        y_LTE = np.zeros((L, tok.size, E))
        np.put_along_axis(y_LTE, ids_LTK, 1.0, axis=2)
        brier = {}
        for mode in ("token", "position"):
            sub = BayesPredictor(mode, "expected", self.smoothing, self.position_smoothing,
                                 self.attention_weighting, backoff=self.backoff,
                                 backoff_smoothing=self.backoff_smoothing,
                                 rare_max=self.rare_max).fit(head)
            brier[mode] = ((K * sub.posterior(tok, pos) - y_LTE) ** 2).sum(-1).mean(-1)
        return tuple("position" if p < t else "token"
                     for t, p in zip(brier["token"], brier["position"], strict=True))

    def _weights(self, att: np.ndarray) -> np.ndarray:
        """P'(f3) per table entry (see module doc for the floor and the off switch)."""
        if not (self.attention_weighting and self._has_attention):
            return np.ones(att.size)
        total = float(self._vocab_freq.sum())
        idx = np.searchsorted(self._vocab_ids, att).clip(max=max(self._vocab_ids.size - 1, 0))
        seen = (self._vocab_ids.size > 0) & (self._vocab_ids[idx] == att)
        return np.where(seen, self._vocab_freq[idx], 1.0) / total

    def _get_stats(self) -> _Stats:
        if self.table is None or self.shape is None:
            raise RuntimeError("not fitted")
        if self._stats is not None and self._stats.version == self.table.version:
            return self._stats
        ctx, expert, count = self.table.arrays()
        li, _, _, att = unpack_context(ctx)
        K, L, E = self.shape.top_k, self.shape.num_moe_layers, self.shape.max_experts
        marg = np.bincount(li * E + expert, weights=count, minlength=L * E)[: L * E]
        marg_LE = marg.reshape(L, E)
        tot = marg_LE.sum(axis=1, keepdims=True)
        uniform = self.shape.mask_LE() / np.asarray(self.shape.num_experts)[:, None]
        marg_LE = np.where(tot > 0, marg_LE / np.where(tot > 0, tot, 1.0), uniform)
        weighted = count * self._weights(att)
        tok = SparseRows.build(ctx >> TOKEN_SHIFT, expert, (weighted, count))
        tok_m = tok.row_sums(1) / K
        prior_LE = marg_LE
        if self.backoff == "rare":
            prior_LE = self._rare_prior(tok, tok_m, marg_LE)
        pos = pos_m = None
        if "position" in self.layer_modes:
            pos = SparseRows.build(ctx >> POS_SHIFT, expert, (weighted, count))
            pos_m = pos.row_sums(1) / K
        lpos = lpos_m = None
        if self.backoff == "position":
            layer_pos = (li << POS_BITS) | ((ctx >> POS_SHIFT) & POS_MASK)
            lpos = SparseRows.build(layer_pos, expert, (count,))
            lpos_m = lpos.row_sums(0) / K
        self._stats = _Stats(self.table.version, marg_LE, prior_LE, tok, tok_m, pos, pos_m,
                             lpos, lpos_m)
        return self._stats

    def _rare_prior(self, tok: SparseRows, tok_m: np.ndarray, marg_LE: np.ndarray) -> np.ndarray:
        """Slot shares of the tokens seen at most ``rare_max`` times, per layer (the
        marginal where a layer has none). Unseen tokens route like rare ones, not like the
        average token, which frequent tokens dominate (Good-Turing's reasoning)."""
        L, E = marg_LE.shape
        rare = tok_m <= self.rare_max
        lens = np.diff(tok.indptr_C1)
        entry_rare = np.repeat(rare, lens)
        entry_layer = np.repeat(tok.key_C >> TOKEN_BITS, lens)
        sums = np.bincount(entry_layer[entry_rare] * E + tok.expert_X[entry_rare],
                           weights=tok.values[1][entry_rare], minlength=L * E)[: L * E]
        sums_LE = sums.reshape(L, E)
        tot = sums_LE.sum(axis=1, keepdims=True)
        return np.where(tot > 0, sums_LE / np.where(tot > 0, tot, 1.0), marg_LE)

    # -- posteriors ------------------------------------------------------------------
    def _unique_posteriors(self, tok_T: np.ndarray, pos_T: np.ndarray,
                           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(layer index per context, post_UE, inverse) over the distinct query contexts
        of all layers; ``inverse`` maps the flattened (L, T) queries to rows of post_UE."""
        st = self._get_stats()
        assert self.shape is not None
        L = self.shape.num_moe_layers
        # Out-of-range ids map to the free top value of their field: never in the table.
        tok = np.minimum(np.asarray(tok_T, np.int64), MAX_TOKEN + 1)
        key2 = (np.arange(L, dtype=np.int64)[:, None] << TOKEN_BITS | tok[None, :]).reshape(-1)
        keyed_by_pos = "position" in self.layer_modes or self.backoff == "position"
        if not keyed_by_pos:
            uk2, inv = np.unique(key2, return_inverse=True)
            li = uk2 >> TOKEN_BITS
            post = _posterior_rows(st.tok, st.tok_m_C, uk2, st.prior_LE[li], self.smoothing)
            return li, post, inv.reshape(-1)
        pos = np.minimum(np.asarray(pos_T, np.int64), MAX_POSITION + 1)
        key3 = (key2.reshape(L, -1) << POS_BITS | pos[None, :]).reshape(-1)
        uk3, inv = np.unique(key3, return_inverse=True)
        li = uk3 >> (POS_BITS + TOKEN_BITS)
        prior = st.prior_LE[li]
        if st.lpos is not None and st.lpos_m_C is not None:
            layer_pos = (li << POS_BITS) | (uk3 & POS_MASK)
            prior = _posterior_rows(st.lpos, st.lpos_m_C, layer_pos, prior,
                                    self.backoff_smoothing)
        post2 = _posterior_rows(st.tok, st.tok_m_C, uk3 >> POS_BITS, prior, self.smoothing)
        if st.pos is None or st.pos_m_C is None:
            return li, post2, inv.reshape(-1)
        post3 = _posterior_rows(st.pos, st.pos_m_C, uk3, post2, self.position_smoothing)
        by_pos = np.array([m == "position" for m in self.layer_modes])[li]
        return li, np.where(by_pos[:, None], post3, post2), inv.reshape(-1)

    def posterior(self, token_ids: np.ndarray | list[int],
                  positions: np.ndarray | list[int] | None = None) -> np.ndarray:
        """post_LTE: P(expert | features) of each token per MoE layer; rows sum to 1.

        ``positions`` default to 0..T-1 (one request); they matter in position mode only.
        """
        shape = self._require_fitted()
        tok = np.asarray(token_ids, np.int64).reshape(-1)
        pos = np.arange(tok.size) if positions is None else np.asarray(positions, np.int64)
        if pos.shape != tok.shape or (pos.size and int(pos.min()) < 0):
            raise DataError(f"need one position >= 0 per token; got {pos.size} positions "
                            f"for {tok.size} tokens", "pass one position per token")
        _, post, inv = self._unique_posteriors(tok, pos)
        return post[inv].reshape(shape.num_moe_layers, tok.size, shape.max_experts)

    def _topk_unique(self, post_UE: np.ndarray, k: int) -> np.ndarray:
        # Stable sort on -post: ties go to the lower expert index (deterministic).
        return np.argsort(-post_UE, axis=1, kind="stable")[:, :k]

    def predict_topk(self, token_ids: Any, k: int) -> np.ndarray:
        """ids_LTK: the MAP top-k experts of each token (positions 0..T-1)."""
        self._check_k(k)
        shape = self._require_fitted()
        tok = np.asarray(token_ids, np.int64).reshape(-1)
        _, post, inv = self._unique_posteriors(tok, np.arange(tok.size))
        return self._topk_unique(post, k)[inv].reshape(shape.num_moe_layers, tok.size, k)

    def _predict_counts(self, requests: list[Request]) -> np.ndarray:
        assert self.shape is not None
        K = self.shape.top_k
        counts_LE, tok = self._zero_counts_and_tokens(requests)
        if tok.size == 0:
            return counts_LE
        pos = np.concatenate([np.arange(r.num_tokens) for r in requests])
        li, post, inv = self._unique_posteriors(tok, pos)
        mult_U = np.bincount(inv, minlength=post.shape[0]).astype(np.float64)
        if self.counts == "expected":
            np.add.at(counts_LE, li, K * mult_U[:, None] * post)
        else:
            add_topk_counts(counts_LE, li, self._topk_unique(post, K), mult_U)
        return counts_LE

    # -- persistence -----------------------------------------------------------------
    def _state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        assert self.table is not None
        ctx, expert, count = self.table.arrays()
        arrays = {"ctx": ctx, "expert": expert, "count": count,
                  "vocab_ids": self._vocab_ids, "vocab_freq": self._vocab_freq}
        params = {"mode": self.mode, "counts": self.counts, "smoothing": self.smoothing,
                  "position_smoothing": self.position_smoothing,
                  "attention_weighting": self.attention_weighting,
                  "holdout": self.holdout, "backoff": self.backoff,
                  "backoff_smoothing": self.backoff_smoothing, "rare_max": self.rare_max,
                  "layer_modes": list(self.layer_modes),
                  "has_attention": self._has_attention}
        return arrays, params

    @classmethod
    def _from_state(cls, shape: ModelShape, arrays: dict[str, np.ndarray],
                    params: dict[str, Any]) -> Self:
        params = dict(params)
        has_attention = bool(params.pop("has_attention"))
        layer_modes = tuple(params.pop("layer_modes"))
        obj = cls(**params)
        obj.layer_modes = layer_modes
        obj._has_attention = has_attention
        obj._vocab_ids, obj._vocab_freq = arrays["vocab_ids"], arrays["vocab_freq"]
        obj.table = CountTable(shape, arrays["ctx"], arrays["expert"], arrays["count"])
        return obj
