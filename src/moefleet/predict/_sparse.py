"""Sparse (context x expert) matrices keyed by packed int64 context ids.

Shape legend: X entries, C distinct contexts, Q queries, E experts.

The Bayesian and token-id predictors aggregate millions of trace rows into a few
hundred thousand (context, expert) sums. A dict per context would cost hundreds of
bytes each; here every context is one int64 key in a sorted array and its experts are a
CSR slice, so aggregation is one sort and lookup is one ``searchsorted`` per batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SparseRows:
    """Aggregated values per (context key, expert).

    Invariants: ``key_C`` is strictly increasing; row c holds entries
    ``indptr_C1[c]:indptr_C1[c + 1]`` with strictly increasing ``expert_X`` inside a
    row; ``values[j]`` has one value per entry (sums of the rows that were aggregated).
    """

    key_C: np.ndarray
    indptr_C1: np.ndarray
    expert_X: np.ndarray
    values: tuple[np.ndarray, ...]

    @classmethod
    def build(
        cls, keys_X: np.ndarray, experts_X: np.ndarray, values: Sequence[np.ndarray]
    ) -> SparseRows:
        """Sum ``values`` over duplicate (key, expert) pairs."""
        keys_X = np.asarray(keys_X, dtype=np.int64)
        experts_X = np.asarray(experts_X, dtype=np.int64)
        if keys_X.size == 0:
            empty = np.zeros(0, np.int64)
            return cls(empty, np.zeros(1, np.int64), empty,
                       tuple(np.zeros(0) for _ in values))
        order = np.lexsort((experts_X, keys_X))
        k, e = keys_X[order], experts_X[order]
        new = np.ones(k.size, dtype=bool)
        new[1:] = (k[1:] != k[:-1]) | (e[1:] != e[:-1])
        starts = np.flatnonzero(new)
        uk, ue = k[starts], e[starts]
        sums = tuple(
            np.add.reduceat(np.asarray(v, dtype=np.float64)[order], starts) for v in values
        )
        row_start = np.flatnonzero(np.r_[True, uk[1:] != uk[:-1]])
        indptr = np.r_[row_start, uk.size].astype(np.int64)
        return cls(uk[row_start], indptr, ue, sums)

    @property
    def num_rows(self) -> int:
        return int(self.key_C.size)

    def row_sums(self, column: int) -> np.ndarray:
        """Sum of ``values[column]`` per context (C,)."""
        v = self.values[column]
        if v.size == 0:
            return np.zeros(self.num_rows)
        return np.add.reduceat(v, self.indptr_C1[:-1])

    def find(self, query_Q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row index, found) for each query key; row index is meaningless where not found."""
        query_Q = np.asarray(query_Q, dtype=np.int64)
        if self.num_rows == 0:
            return np.zeros(query_Q.size, np.int64), np.zeros(query_Q.size, bool)
        row = np.searchsorted(self.key_C, query_Q)
        row_c = np.minimum(row, self.num_rows - 1)
        return row_c, self.key_C[row_c] == query_Q

    def dense(self, rows_Q: np.ndarray, found_Q: np.ndarray, num_experts: int,
              column: int) -> np.ndarray:
        """out_QE: ``values[column]`` of the found rows spread over experts; 0 elsewhere."""
        out = np.zeros((rows_Q.size, num_experts))
        hit = np.flatnonzero(found_Q)
        if hit.size == 0:
            return out
        lo = self.indptr_C1[rows_Q[hit]]
        lens = self.indptr_C1[rows_Q[hit] + 1] - lo
        # Entry indices of every hit row, concatenated: lo repeated + a running offset.
        first = np.cumsum(lens) - lens
        idx = np.repeat(lo - first, lens) + np.arange(int(lens.sum()))
        out[np.repeat(hit, lens), self.expert_X[idx]] = self.values[column][idx]
        return out
