"""The profiled key-value table of the Bayesian predictor, editable key by key.

A key is (MoE layer, token id f1, position id f2, attention id f3, expert i); its value
n(key) >= 0 is how often a token with those features went to that expert (ODS/BO §III-B).
Absent keys have count 0, and setting a count to 0 removes the key.

Storage: the four features are packed into one int64 *context* (bit layout below) and
the table is three parallel arrays (context, expert, count) sorted by (context, expert).
Because the packing order is layer, token, position, attention, every (layer, token) and
every (layer, token, position) prefix is a contiguous run of contexts, so aggregation by
prefix is a right shift. Single-key edits (the BO loop rewrites ~1000 pairs per
iteration) go to a small overlay dict and are merged in one sort on the next read.

Bit layout of a context, most significant first:
    layer index (into the model's MoE layers) 7 bits | token id 20 bits |
    position id 16 bits | attention id + 1 20 bits          (63 bits in all)
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from moefleet.errors import DataError
from moefleet.predict.base import ModelShape

LAYER_BITS, TOKEN_BITS, POS_BITS, ATT_BITS = 7, 20, 16, 20
# The top value of each field is kept free: predictors use it as an "unseen" sentinel.
MAX_LAYERS = (1 << LAYER_BITS) - 1
MAX_TOKEN = (1 << TOKEN_BITS) - 2
MAX_POSITION = (1 << POS_BITS) - 2
MAX_ATTENTION = (1 << ATT_BITS) - 3  # stored as attention + 1; -1 means "not recorded"
TOKEN_SHIFT = POS_BITS + ATT_BITS  # context >> TOKEN_SHIFT == (layer, token)
POS_SHIFT = ATT_BITS  # context >> POS_SHIFT == (layer, token, position)
LAYER_SHIFT = TOKEN_BITS + POS_BITS + ATT_BITS
POS_MASK = (1 << POS_BITS) - 1


class TableKey(NamedTuple):
    """One key of the table; ``layer`` is the block index as in the trace."""

    layer: int
    token: int
    position: int
    attention: int
    expert: int


def pack_context(layer_idx: np.ndarray, token: np.ndarray, position: np.ndarray,
                 attention: np.ndarray) -> np.ndarray:
    """Pack feature columns (already range-checked) into int64 contexts."""
    return (
        (np.asarray(layer_idx, np.int64) << LAYER_SHIFT)
        | (np.asarray(token, np.int64) << TOKEN_SHIFT)
        | (np.asarray(position, np.int64) << POS_SHIFT)
        | (np.asarray(attention, np.int64) + 1)
    )


def unpack_context(ctx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(layer index, token, position, attention) columns of packed contexts."""
    ctx = np.asarray(ctx, np.int64)
    return (
        ctx >> LAYER_SHIFT,
        (ctx >> TOKEN_SHIFT) & ((1 << TOKEN_BITS) - 1),
        (ctx >> POS_SHIFT) & ((1 << POS_BITS) - 1),
        (ctx & ((1 << ATT_BITS) - 1)) - 1,
    )


def check_feature_ranges(token: np.ndarray, position: np.ndarray, attention: np.ndarray) -> None:
    """DataError unless every feature fits its bit field."""
    for name, arr, lo, hi in (
        ("token id", token, 0, MAX_TOKEN),
        ("position id", position, 0, MAX_POSITION),
        ("attention id", attention, -1, MAX_ATTENTION),
    ):
        arr = np.asarray(arr)
        if arr.size and (int(arr.min()) < lo or int(arr.max()) > hi):
            raise DataError(
                f"{name} out of range [{lo}, {hi}]: saw {int(arr.min())}..{int(arr.max())}",
                "the count table packs features into 63 bits; shorten prompts "
                "(--max-length) or use a model with a smaller vocabulary",
            )


class CountTable:
    """n(layer, token, position, attention, expert) with get / set / add / iteration.

    Invariants: after ``_compact`` the arrays are sorted by (context, expert), unique,
    and every count is finite and > 0. ``version`` increases on every edit so derived
    statistics can be cached against it.
    """

    def __init__(self, shape: ModelShape, ctx: np.ndarray | None = None,
                 expert: np.ndarray | None = None, count: np.ndarray | None = None) -> None:
        if shape.num_moe_layers > MAX_LAYERS:
            raise DataError(f"model has {shape.num_moe_layers} MoE layers; the table holds at "
                            f"most {MAX_LAYERS}", "predict a subset of layers")
        self.shape = shape
        self._ctx = np.zeros(0, np.int64) if ctx is None else np.asarray(ctx, np.int64)
        self._expert = np.zeros(0, np.int64) if expert is None else np.asarray(expert, np.int64)
        self._count = np.zeros(0) if count is None else np.asarray(count, np.float64)
        self._edits: dict[tuple[int, int], float] = {}
        self.version = 0

    @classmethod
    def from_rows(cls, shape: ModelShape, layer_idx: np.ndarray, token: np.ndarray,
                  position: np.ndarray, attention: np.ndarray, expert_NK: np.ndarray,
                  ) -> CountTable:
        """Count trace rows: each row adds 1 to the key of each of its K experts."""
        check_feature_ranges(token, position, attention)
        ctx = pack_context(layer_idx, token, position, attention)
        K = expert_NK.shape[1]
        keys = np.repeat(ctx, K)
        experts = np.asarray(expert_NK, np.int64).reshape(-1)
        order = np.lexsort((experts, keys))
        keys, experts = keys[order], experts[order]
        new = np.ones(keys.size, bool)
        new[1:] = (keys[1:] != keys[:-1]) | (experts[1:] != experts[:-1])
        starts = np.flatnonzero(new)
        counts = np.diff(np.r_[starts, keys.size]).astype(np.float64)
        return cls(shape, keys[starts], experts[starts], counts)

    # -- single keys -----------------------------------------------------------------
    def _encode(self, key: TableKey | tuple[int, int, int, int, int]) -> tuple[int, int]:
        key = TableKey(*key)
        li = self.shape.layer_index(int(key.layer))
        if not 0 <= key.expert < self.shape.num_experts[li]:
            raise DataError(f"expert {key.expert} does not exist in layer {key.layer}",
                            f"layer {key.layer} has {self.shape.num_experts[li]} experts")
        check_feature_ranges(np.array([key.token]), np.array([key.position]),
                             np.array([key.attention]))
        ctx = pack_context(np.array([li]), np.array([key.token]), np.array([key.position]),
                           np.array([key.attention]))
        return int(ctx[0]), int(key.expert)

    def _base_index(self, ctx: int, expert: int) -> int:
        lo = int(np.searchsorted(self._ctx, ctx, "left"))
        hi = int(np.searchsorted(self._ctx, ctx, "right"))
        hit = np.flatnonzero(self._expert[lo:hi] == expert)
        return lo + int(hit[0]) if hit.size else -1

    def get(self, key: TableKey | tuple[int, int, int, int, int]) -> float:
        """The count of ``key`` (0.0 when absent)."""
        ck = self._encode(key)
        if ck in self._edits:
            return self._edits[ck]
        i = self._base_index(*ck)
        return float(self._count[i]) if i >= 0 else 0.0

    def set(self, key: TableKey | tuple[int, int, int, int, int], count: float) -> None:
        """Set the count of ``key`` (creating it); 0 removes it. DataError if negative."""
        if not math.isfinite(count) or count < 0:
            raise DataError(f"count for {TableKey(*key)} must be finite and >= 0, got {count}",
                            "counts are token occurrences; use 0 to remove a key")
        self._edits[self._encode(key)] = float(count)
        self.version += 1

    def add(self, key: TableKey | tuple[int, int, int, int, int], delta: float) -> float:
        """Add ``delta`` to the count of ``key``; returns the new count (must stay >= 0)."""
        new = self.get(key) + float(delta)
        if new < 0:
            raise DataError(f"count for {TableKey(*key)} would become {new} < 0",
                            "subtract at most the current count")
        self.set(key, new)
        return new

    # -- whole table -----------------------------------------------------------------
    def _compact(self) -> None:
        if not self._edits:
            return
        drop = [i for ck in self._edits if (i := self._base_index(*ck)) >= 0]
        keep = np.ones(self._ctx.size, bool)
        keep[drop] = False
        added = [(c, e, n) for (c, e), n in self._edits.items() if n > 0]
        add_ctx = np.array([a[0] for a in added], np.int64)
        add_exp = np.array([a[1] for a in added], np.int64)
        add_cnt = np.array([a[2] for a in added], np.float64)
        ctx = np.r_[self._ctx[keep], add_ctx]
        exp = np.r_[self._expert[keep], add_exp]
        cnt = np.r_[self._count[keep], add_cnt]
        order = np.lexsort((exp, ctx))
        self._ctx, self._expert, self._count = ctx[order], exp[order], cnt[order]
        self._edits.clear()

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(context, expert, count), sorted and unique, edits merged. Do not modify."""
        self._compact()
        return self._ctx, self._expert, self._count

    def __len__(self) -> int:
        return int(self.arrays()[0].size)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, tuple) and len(key) == 5 and self.get(key) > 0

    def items(self) -> Iterator[tuple[TableKey, float]]:
        """Every (key, count) with count > 0, in (layer, token, position, attention,
        expert) order."""
        ctx, expert, count = self.arrays()
        li, tok, pos, att = unpack_context(ctx)
        layers = np.asarray(self.shape.moe_layers)[li]
        for row in zip(layers.tolist(), tok.tolist(), pos.tolist(), att.tolist(),
                       expert.tolist(), count.tolist(), strict=True):
            yield TableKey(*row[:5]), row[5]

    def keys(self) -> Iterator[TableKey]:
        for key, _ in self.items():
            yield key

    def copy(self) -> CountTable:
        ctx, expert, count = self.arrays()
        return CountTable(self.shape, ctx.copy(), expert.copy(), count.copy())
