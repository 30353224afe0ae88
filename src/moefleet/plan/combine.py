"""Choose one frontier point per layer: min Σ cost subject to Σ latency ≤ budget.

This is the multiple-choice knapsack left after :mod:`moefleet.plan.frontier` (eq. 12d is
the only constraint across layers). Two stages:

1. **Lagrangian + greedy fill**: for a multiplier μ each layer takes the point minimising
   cost + μ·latency; bisection finds the smallest μ whose choice meets the budget; the
   leftover latency is then spent greedily on the moves with the largest saving. The dual
   value Σ_e min(cost + μ·latency) − μ·budget is a lower bound on the optimum.
2. **exact Pareto merge**: fold layers in one at a time, keeping only non-dominated
   (latency, cost) partial sums that can still meet the budget (remaining layers at their
   fastest) and whose Lagrangian completion bound does not exceed stage 1's cost. Both
   prunings are exact, so the result is optimal. It gives up (returning stage 1's
   solution, ``exact=False``, with its certified ``lower_bound``) if a step would pair more
   than ``pair_cap`` candidates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moefleet.plan.frontier import cheaper_than_before

PAIR_CAP = 2_000_000  # candidate (partial, point) pairs per merge step before giving up


@dataclass(frozen=True)
class Selection:
    """Chosen point per layer; ``lower_bound`` ≤ the optimum (= cost when exact)."""

    points: list[int]
    cost: float
    latency: float
    exact: bool
    lower_bound: float


def choose(
    latencies: Sequence[np.ndarray], costs: Sequence[np.ndarray], budget: float,
    pair_cap: int = PAIR_CAP,
) -> Selection | None:
    """Cheapest combination with Σ latency ≤ budget, or None if even the fastest misses.

    Each layer's arrays must be a frontier (latency ascending, cost descending). The
    Lagrangian solution is computed first; its cost bounds the exact merge from above and
    its multiplier bounds every partial sum from below, which prunes most of the merge.
    """
    if any(len(lat) == 0 for lat in latencies):
        return None
    fastest = sum(float(lat[0]) for lat in latencies)
    if fastest > budget * (1 + 1e-12) + 1e-12:
        return None
    lag, mu = _lagrangian(latencies, costs, budget)
    if lag.cost <= lag.lower_bound * (1 + 1e-12):
        return Selection(lag.points, lag.cost, lag.latency, True, lag.cost)
    exact = _merge(latencies, costs, budget, pair_cap, lag.cost, mu)
    return exact if exact is not None else lag


def _merge(
    lats: Sequence[np.ndarray], costs: Sequence[np.ndarray], budget: float, pair_cap: int,
    upper: float, mu: float,
) -> Selection | None:
    eps = budget * 1e-12 + 1e-12
    n = len(lats)
    # Fastest completion (latency pruning) and Lagrangian completion bound (cost pruning):
    # any completion of the layers after e with Σ l ≤ B − L costs at least
    # Σ_{e'>e} min(c + μ·l) − μ·(B − L).
    rest_l = np.zeros(n)
    rest_d = np.zeros(n)
    for e in range(n - 2, -1, -1):
        rest_l[e] = rest_l[e + 1] + float(lats[e + 1][0])
        rest_d[e] = rest_d[e + 1] + float(np.min(costs[e + 1] + mu * lats[e + 1]))
    cap_c = upper * (1 + 1e-9) + 1e-18
    acc_l = np.zeros(1)
    acc_c = np.zeros(1)
    back: list[tuple[np.ndarray, np.ndarray]] = []  # per layer: (parent index, point index)
    for e, (lat, cost) in enumerate(zip(lats, costs, strict=True)):
        if len(acc_l) * len(lat) > pair_cap:
            return None
        pl = (acc_l[:, None] + lat[None, :]).ravel()
        pc = (acc_c[:, None] + cost[None, :]).ravel()
        ok = (pl <= budget - rest_l[e] + eps) & (
            pc + rest_d[e] - mu * (budget - pl) <= cap_c
        )
        idx = np.nonzero(ok)[0]
        order = idx[np.lexsort((pc[idx], pl[idx]))]
        sel = order[cheaper_than_before(pc[order])]
        if len(sel) == 0:
            return None  # numerical corner: fall back to the Lagrangian solution
        parent, point = np.divmod(sel, len(lat))
        back.append((parent, point))
        acc_l, acc_c = pl[sel], pc[sel]
    best = int(np.argmin(acc_c))
    points = [0] * n
    idx_b = best
    for e in range(n - 1, -1, -1):
        parent, point = back[e]
        points[e] = int(point[idx_b])
        idx_b = int(parent[idx_b])
    return Selection(points, float(acc_c[best]), float(acc_l[best]), True, float(acc_c[best]))


class _Flat:
    """All layers' points in one array (layer-major), for vectorised per-layer argmins."""

    def __init__(self, lats: Sequence[np.ndarray], costs: Sequence[np.ndarray]) -> None:
        sizes = np.array([len(x) for x in lats])
        self.starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        self.layer = np.repeat(np.arange(len(lats)), sizes)
        self.lat = np.concatenate(lats)
        self.cost = np.concatenate(costs)

    def pick(self, mu: float) -> np.ndarray:
        """Global index of each layer's argmin cost + μ·latency (ties: the faster point)."""
        vals = self.cost + mu * self.lat
        mins = np.minimum.reduceat(vals, self.starts)
        idx = np.flatnonzero(vals <= mins[self.layer])
        first = np.ones(len(idx), dtype=bool)
        first[1:] = self.layer[idx[1:]] != self.layer[idx[:-1]]
        return idx[first]

    def dual(self, mu: float, budget: float) -> float:
        vals = self.cost + mu * self.lat
        return float(np.minimum.reduceat(vals, self.starts).sum()) - mu * budget


def _lagrangian(
    lats: Sequence[np.ndarray], costs: Sequence[np.ndarray], budget: float
) -> tuple[Selection, float]:
    """Feasible greedy-filled Lagrangian solution and the multiplier of its dual bound."""
    flat = _Flat(lats, costs)
    lo, hi = 0.0, 1.0
    pts = flat.pick(lo)
    if flat.lat[pts].sum() > budget:
        # Above the steepest slope (c_0 - c_k)/(L_k - L_0) every layer takes its fastest
        # point, which fits (checked by choose); bisect between 0 and there.
        for lat, c in zip(lats, costs, strict=True):
            if len(lat) > 1:
                hi = max(hi, 2.0 * float(np.max((c[0] - c[1:]) / (lat[1:] - lat[0]))))
        for _ in range(64):
            mid = 0.5 * (lo + hi)
            if flat.lat[flat.pick(mid)].sum() <= budget:
                hi = mid
            else:
                lo = mid
        pts = flat.pick(hi)
        if flat.lat[pts].sum() > budget:
            pts = flat.starts.copy()
    mu = lo if flat.dual(lo, budget) >= flat.dual(hi, budget) else hi
    lower = flat.dual(mu, budget)
    pts = _greedy_fill(flat, pts, budget)
    cost = float(flat.cost[pts].sum())
    local = [int(k) for k in pts - flat.starts]
    return Selection(local, cost, float(flat.lat[pts].sum()), False, min(lower, cost)), mu


def _greedy_fill(flat: _Flat, pts: np.ndarray, budget: float) -> np.ndarray:
    """Spend leftover latency on the single move with the largest saving, repeatedly."""
    pts = pts.copy()
    for _ in range(20 * len(pts) + 20):
        slack = budget - float(flat.lat[pts].sum())
        cur = pts[flat.layer]
        fits = flat.lat - flat.lat[cur] <= slack
        saving = np.where(fits, flat.cost[cur] - flat.cost, 0.0)
        best = int(np.argmax(saving))
        if saving[best] <= 0:
            break
        pts[flat.layer[best]] = best
    return pts
