"""Per-layer cost/latency frontiers: the exact decomposition behind the fast solvers.

Why this is exact. With the method a of a layer fixed, problem (12) couples experts only
through the layer latency, a max over replicas (eqs. 7, 9, 11), and couples layers only
through Σ_e latency ≤ budget (12d). So for a cap τ on max_i t_rep (and, for a=3, a cap ρ on
max_i r; for a=1, the layer's β) every expert independently takes its cheapest option
(memory j, replicas g) with t_rep ≤ τ (and r ≤ ρ). Sweeping τ over every t_rep value that
occurs yields every layer (latency, cost) pair an optimal solution can use; keeping the
non-dominated ones gives the layer's Pareto frontier. Combining layers is then a
multiple-choice knapsack (:mod:`moefleet.plan.combine`).

Exactness holds when every β (a=1) and every ρ (a=3) is enumerated: we do that when there
are at most ``exact_limit`` candidate values, otherwise a geometric grid of at most
``grid`` values (fewer for big layers, see ``WORK_CELLS``; the end points always) is used,
and the frontier is flagged ``exact=False`` (every point is still a real, feasible
configuration). β > max r is never better than β = max r (fewer blocks
are impossible, t_blk and t_tail only grow), so β ranges over 1..max d.

Shapes: ``U`` distinct token counts d among the layer's active experts (experts with the
same d have the same options; ``mult`` counts them), ``J`` memory options, ``G`` replica
counts, ``K = J·G`` options, ``V`` variants (β or ρ values).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moefleet.plan.costmodel import (
    Rates,
    direct_fits,
    head_s,
    layer_latency,
    memory_need_bytes,
    n_blocks,
    price_table,
    replica_cost,
    replica_time,
)
from moefleet.plan.problem import MB, PlanningProblem
from moefleet.plan.transfers import layer_transfer_usd

EXACT_LIMIT = 64  # enumerate every β / ρ when there are at most this many
GRID = 24  # otherwise this many grid values
COST_RTOL = 1e-9  # relative cost differences below this are float noise
# Large layers get fewer grid values: at most this many (variant, option) cells per sweep,
# but never fewer than MIN_GRID values (speed knob; exactness is flagged either way).
WORK_CELLS = 500_000
MIN_GRID = 8


@dataclass(frozen=True)
class Frontier:
    """Non-dominated (latency, cost) points of one layer under one method.

    ``latency_s`` ascends, ``cost_usd`` strictly descends; point k is reached with a cap
    ``tau_s[k]`` on max t_rep and variant ``variant[k]`` (β for a=1, ρ for a=3, 0 for a=2).
    Empty arrays: the method is infeasible for this layer.
    """

    method: int
    latency_s: np.ndarray
    cost_usd: np.ndarray
    tau_s: np.ndarray
    variant: np.ndarray
    exact: bool

    def __len__(self) -> int:
        return len(self.latency_s)


@dataclass(frozen=True)
class ExpertChoice:
    memory_mb: int
    replicas: int


class LayerTables:
    """Option tables of one layer: r, feasibility, U, prices over (U, J, G)."""

    def __init__(self, problem: PlanningProblem, li: int, rates: Rates | None = None) -> None:
        rates = rates or Rates.of(problem)
        self.p, self.li, self.rates = problem, li, rates
        d = problem.counts(li)
        self.d = d
        self.active = d > 0
        self.ud, self.inv, self.mult = np.unique(d[self.active], return_inverse=True,
                                                 return_counts=True)
        g = np.arange(1, problem.max_replicas + 1)
        self.g = g
        self.mem = np.asarray(problem.memory_options_mb)
        self.r_UG = -(-self.ud[:, None] // g[None, :])  # ceil(d/g)
        need = memory_need_bytes(problem, li, self.r_UG)
        # g ≤ d: more replicas than tokens only adds billed heads (r stays 1).
        self.ok_UJG = (need[:, None, :] <= self.mem[None, :, None] * MB) & (
            g[None, None, :] <= self.ud[:, None, None]
        )
        self.u_J = problem.per_token_s_LJ[li]
        self.price_J = price_table(problem)
        self.head = head_s(rates, problem.expert_param_bytes[li])
        self.payload_UG = direct_fits(problem, self.r_UG)

    def options(self, method: int, beta: np.ndarray | int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(t_rep, expert cost) over (V, U, J, G); infeasible options are inf."""
        b = np.asarray(beta).reshape(-1, 1, 1, 1)
        r = self.r_UG[None, :, None, :]
        u = self.u_J[None, None, :, None]
        t = replica_time(method, r, u, self.head, b, self.rates, self.p.bytes_in,
                         self.p.bytes_out)
        nblk = n_blocks(r, b) if method == 1 else 1
        t = np.broadcast_to(t, (b.shape[0], *self.ok_UJG.shape))
        g = self.g[None, None, None, :]
        c = g * replica_cost(method, t, nblk, self.price_J[None, None, :, None], self.rates)
        ok = self.ok_UJG[None]
        if method == 3:
            ok = ok & self.payload_UG[None, :, None, :]
        return np.where(ok, t, np.inf), np.where(ok, c, np.inf)

    def empty_latency(self, method: int) -> float:
        return layer_latency(method, 0.0, 0, 0.0, self.p.load_s(self.li), self.rates,
                             self.p.bytes_out)

    def latency(self, method: int, tau: np.ndarray, rho: np.ndarray) -> np.ndarray:
        rates, p = self.rates, self.p
        if method in (1, 2):
            return (np.maximum(tau, p.load_s(self.li)) + rates.acc_s
                    + float(self.d.sum()) * p.bytes_out / rates.bs)
        return tau + rho * p.bytes_out / rates.bf + p.load_s(self.li)


def _variants(values: np.ndarray, exact_limit: int, grid: int) -> tuple[np.ndarray, bool]:
    vals = np.unique(values)
    if len(vals) <= exact_limit:
        return vals, True
    idx = np.unique(np.round(np.geomspace(1, len(vals), grid)).astype(int) - 1)
    return vals[idx], False


def _prepare(
    t: np.ndarray, c: np.ndarray, r: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(V, U, J, G) option tables -> (V, U, J·G) rows sorted by t; ``r`` travels along."""
    v_n, u_n = t.shape[:2]
    t2, c2 = t.reshape(v_n * u_n, -1), c.reshape(v_n * u_n, -1)
    order = np.argsort(t2, axis=1)
    ts, cs = np.take_along_axis(t2, order, 1), np.take_along_axis(c2, order, 1)
    rs = None
    if r is not None:
        r2 = np.broadcast_to(r, t.shape).reshape(v_n * u_n, -1)
        rs = np.take_along_axis(r2, order, 1).reshape(v_n, u_n, -1)
    return ts.reshape(v_n, u_n, -1), cs.reshape(v_n, u_n, -1), rs


def _sweep(ts: np.ndarray, cs: np.ndarray, mult: np.ndarray) -> tuple[np.ndarray, ...]:
    """For each variant v and each cap τ among the t values: Σ_u mult_u · (cheapest cost
    of row u with t ≤ τ), where every row has an option. Rows of (V, U, K) must be sorted
    by t. Returns (v, τ, cost) arrays."""
    v_n, u_n = ts.shape[0], ts.shape[1]
    ts = ts.reshape(v_n * u_n, -1)
    cs = cs.reshape(v_n * u_n, -1)
    # Per row (variant, expert group), the options that are strictly cheaper than every
    # faster one: the only moments the group's cheapest feasible cost changes.
    front = np.empty(cs.shape, dtype=bool)
    front[:, 0] = np.isfinite(cs[:, 0])
    front[:, 1:] = cs[:, 1:] < np.minimum.accumulate(cs, axis=1)[:, :-1]
    rows, cols = np.nonzero(front)  # row-major: ascending t within a row
    tf, cf = ts[rows, cols], cs[rows, cols]
    first = np.ones(len(rows), dtype=bool)
    first[1:] = rows[1:] != rows[:-1]
    prev = np.where(first, 0.0, np.concatenate([[0.0], cf[:-1]]))
    w = mult[rows % u_n]
    var = rows // u_n
    o = np.lexsort((tf, var))
    tf, var = tf[o], var[o]
    delta, arrive = ((cf - prev) * w)[o], (first * w)[o]
    # Running sums restart at each variant: subtract the sum before the variant's start.
    start = np.ones(len(o), dtype=bool)
    start[1:] = var[1:] != var[:-1]
    cost, count = np.cumsum(delta), np.cumsum(arrive)
    s_idx = np.maximum.accumulate(np.where(start, np.arange(len(o)), 0))
    cost = cost - (cost[s_idx] - delta[s_idx])
    count = count - (count[s_idx] - arrive[s_idx])
    last = np.ones(len(o), dtype=bool)
    last[:-1] = (tf[1:] != tf[:-1]) | (var[1:] != var[:-1])
    ok = (count == mult.sum()) & last
    return var[ok], tf[ok], cost[ok]


def cheaper_than_before(c: np.ndarray) -> np.ndarray:
    """Mask of the points (sorted by latency, then cost) strictly cheaper than every earlier
    one by more than ``COST_RTOL``: costs summed from differences carry float noise, and a
    "cheaper" point within noise of a faster one is the same point, only slower."""
    keep = np.ones(len(c), dtype=bool)
    keep[1:] = c[1:] < np.minimum.accumulate(c)[:-1] * (1 - COST_RTOL)
    return keep


def _pareto(lat: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """Indices of the non-dominated points, latency ascending, cost strictly descending."""
    order = np.lexsort((cost, lat))
    return order[cheaper_than_before(cost[order])]


def layer_frontier(
    tab: LayerTables, method: int, exact_limit: int = EXACT_LIMIT, grid: int = GRID
) -> Frontier:
    """The (latency, cost) frontier of the layer of ``tab`` under ``method``; costs include
    the layer's segment/coordinator requests under the method (a constant, transfers)."""
    moved = layer_transfer_usd(tab.p, tab.li, method, tab.rates.per_put, tab.rates.per_get)
    if not tab.active.any():
        one = np.ones(1)
        if memory_need_bytes(tab.p, tab.li, 0) > tab.mem[-1] * MB:  # not even deployable
            return Frontier(method, *(np.zeros(0),) * 4, True)
        return Frontier(method, one * tab.empty_latency(method), one * moved, np.zeros(1),
                        one, True)
    exact = True
    cells = tab.r_UG.size * len(tab.mem)
    grid = min(grid, max(MIN_GRID, WORK_CELLS // max(cells, 1)))
    if method == 1:
        var, exact = _variants(np.arange(1, int(tab.ud.max()) + 1), exact_limit, grid)
        ts, cs, _ = _prepare(*tab.options(1, var))
    elif method == 2:
        var = np.zeros(1, dtype=np.int64)
        ts, cs, _ = _prepare(*tab.options(2))
    else:
        t1, c1 = tab.options(3)
        feas = np.isfinite(t1[0]).any(axis=1)  # (U, G): some memory holds it
        var, exact = _variants(tab.r_UG[feas], exact_limit, grid)
        if len(var) == 0:  # no replica count fits memory and payload
            return Frontier(method, *(np.zeros(0),) * 4, True)
        # t_rep does not depend on ρ: sort once, then mask r > ρ per variant.
        t0, c0, r0 = _prepare(t1, c1, tab.r_UG[None, :, None, :])
        assert r0 is not None
        fits = r0 <= var.reshape(-1, 1, 1)
        ts = np.broadcast_to(t0, fits.shape)
        cs = np.where(fits, c0, np.inf)
    vi, tau, cost = _sweep(ts, cs, tab.mult)
    variant = var[vi] if len(vi) else np.zeros(0)
    lat = tab.latency(method, tau, variant.astype(float))
    keep = _pareto(lat, cost) if len(lat) else np.zeros(0, dtype=np.int64)
    return Frontier(method, lat[keep], cost[keep] + moved, tau[keep], variant[keep], exact)


def choose_experts(
    tab: LayerTables, method: int, tau: float, variant: int
) -> tuple[int, list[ExpertChoice]]:
    """Reconstruct a frontier point: β (clamped to max r, eq. 12e) and each expert's
    cheapest option with t_rep ≤ τ (and r ≤ ρ for a=3); ties go to the faster option,
    then the smaller memory. Inactive experts get the smallest memory holding P."""
    problem, li = tab.p, tab.li
    beta = int(variant) if method == 1 else 1
    choices: list[ExpertChoice] = []
    pick_u: list[tuple[int, int]] = []
    if tab.active.any():
        t, c = tab.options(method, beta)
        t, c = t[0], c[0]
        ok = t <= tau * (1 + 1e-12) + 1e-15
        if method == 3:
            ok &= (tab.r_UG <= variant)[:, None, :]
        for u in range(len(tab.ud)):
            cu = np.where(ok[u], c[u], np.inf).ravel()
            if not np.isfinite(cu).any():
                raise ValueError(f"no option of layer {li} meets tau={tau}")  # solver bug
            k = int(np.lexsort((t[u].ravel(), cu))[0])
            pick_u.append(divmod(k, len(tab.g)))
    idle_need = memory_need_bytes(problem, li, 0)
    fitting = [int(m) for m in tab.mem if idle_need <= m * MB]
    idle_mem = fitting[0] if fitting else int(tab.mem[-1])
    active_rank = np.cumsum(tab.active) - 1
    r_max = 0
    for i, on in enumerate(tab.active):
        if not on:
            choices.append(ExpertChoice(idle_mem, 1))
            continue
        j, gi = pick_u[int(tab.inv[active_rank[i]])]
        choices.append(ExpertChoice(int(tab.mem[j]), int(tab.g[gi])))
        r_max = max(r_max, int(tab.r_UG[tab.inv[active_rank[i]], gi]))
    if method == 1 and r_max:
        beta = min(beta, r_max)
    return beta, choices
