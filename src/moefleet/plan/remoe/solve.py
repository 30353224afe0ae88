"""Remoe's planning steps: MMP (Alg. 2), remote selection (IV-D), the remote memory
subproblem by Lagrangian duality (IV-E) and replicas by LPT (IV-F).

Shape legend: L MoE layers, E routed experts per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moefleet.plan.remoe.model import (
    Layout,
    lpt,
    main_need_mb,
    prefill_layer,
    remote_decode_s,
    remote_need_mb,
)
from moefleet.plan.remoe.problem import InfeasibleError, RemoeProblem, theorem1_bound

GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def _wire(p: RemoeProblem) -> float:
    return 2.0 * p.token_bytes / p.transfer_bytes_s


@dataclass(frozen=True)
class MmpResult:
    b: float  # remote ratio
    remote_per_layer: int  # b·E
    main_mb: int
    ttft_wc_s: float  # worst case (Theorem 1, z_max replicas, largest remote memory)
    tpot_wc_s: float


def worst_case(p: RemoeProblem, r: int, main_mb: float) -> tuple[float, float]:
    """MMP lines 4-9: worst-case TTFT and TPOT with r remote experts per layer, the main
    function at ``main_mb`` and remote functions at the largest option with z_max
    replicas; loads from Corollary 1 (95%)."""
    E, K = p.num_experts, p.top_k
    t_loc, y = p.expert_s(p.gb(main_mb)), p.gb(p.remote_memory_mb[-1])
    unit, z = p.expert_s(y) + _wire(p), p.max_replicas
    unit_pre = p.expert_s(y) * p.prefill_factor + _wire(p)
    n_pre, n_dec = p.n_in * K, p.n_out * K
    loc_pre = theorem1_bound(n_pre, E, E - r) * t_loc * p.prefill_factor if r < E else 0.0
    rem_pre = 0.0
    if r:  # Theorem 4 with the worst-case group load in place of its expectation
        one, grp = theorem1_bound(n_pre, E, 1), theorem1_bound(n_pre, E, r)
        rem_pre = (z - 1) / z * one * unit_pre + grp * unit_pre / z + p.invoke_overhead_s
    loc_dec = theorem1_bound(n_dec, E, E - r) / p.n_out * t_loc if r < E else 0.0
    rem_dec = theorem1_bound(n_dec, E, r) / p.n_out * unit + p.invoke_overhead_s if r else 0.0
    L = p.num_layers
    # cold: the main loads L·(E − r) experts; z_max replicas hold ceil(r / z) each
    ttft = (p.cold_s(L * (E - r), -(-r // z))
            + L * (p.n_in * p.nonexpert_prefill_token_s + 2 * p.swap_s(p.n_in)
                   + max(loc_pre, rem_pre)))
    tpot = L * (p.nonexpert_token_s + 2 * p.swap_s(K) + max(loc_dec, rem_dec))
    return ttft, tpot


def mmp(p: RemoeProblem) -> MmpResult:
    """Alg. 2: lower b from 1 by ε until the worst-case TTFT and TPOT hold; the main
    function gets the smallest option >= max(M_min + M_e(b), M_cal)."""
    E = p.num_experts
    m_cal = p.remote_memory_mb[-1]  # local experts at least as fast as remote ones
    steps = round(1.0 / p.epsilon)
    best = (math.inf, math.inf)
    for i in range(steps + 1):
        b = 1.0 - i / steps
        r = round(b * E)
        remote = np.zeros((p.num_layers, E), bool)
        remote[:, :r] = True  # only the count matters for the memory here
        need = max(main_need_mb(p, "remoe", remote), m_cal)
        if need > p.main_memory_mb[-1]:
            continue
        main_mb = p.round_main(need)
        ttft, tpot = worst_case(p, r, main_mb)
        fast = worst_case(p, r, p.main_memory_mb[-1])
        best = (min(best[0], fast[0]), min(best[1], fast[1]))
        if ttft <= p.ttft_slo_s and tpot <= p.tpot_slo_s:
            return MmpResult(b, r, main_mb, ttft, tpot)
    raise InfeasibleError(
        f"infeasible: the fastest layout gives TTFT {best[0]:.4g} s / TPOT {best[1]:.4g} s "
        f"(worst case, 95%); the SLOs are TTFT {p.ttft_slo_s:.4g} s / TPOT "
        f"{p.tpot_slo_s:.4g} s",
        f"raise the SLOs to at least TTFT {best[0]:.4g} s and TPOT {best[1]:.4g} s, or use "
        "a platform with larger functions")


def select_remote(p: RemoeProblem, r: int) -> np.ndarray:
    """IV-D: the r experts of each layer with the lowest utility become remote (x_LE)."""
    x = np.zeros((p.num_layers, p.num_experts), bool)
    if r:
        order = np.argsort(p.utility_LE, axis=1, kind="stable")[:, :r]
        np.put_along_axis(x, order, True, axis=1)
    return x


@dataclass(frozen=True)
class MemoryResult:
    y_gb: np.ndarray  # continuous optimum y~ (GB); NaN where a layer has no remote experts
    remote_mb: tuple[int, ...]  # rounded up to the options (0: no remote experts)
    lam: float  # λ* of the TPOT constraint
    primal: float  # P2 at y~
    dual: float  # the dual function at λ*
    convex: bool  # Theorem 2: θ2 >= 2c_c/H_w
    theta2: float
    convexity_bound: float  # 2c_c/H_w


def _inner(p: RemoeProblem, lam: float, share: np.ndarray, loc_dec: np.ndarray,
           lo: np.ndarray, hi: float, hw: float) -> np.ndarray:
    """argmin over [lo, hi] of f_l(y) + λ·c_l(y) for every layer at once: vectorised
    golden section (exact for the convex case), checked against a grid of 64 points so
    a non-convex g (Theorem 2 failing) still gets a good point."""
    def obj(y: np.ndarray) -> np.ndarray:
        r = remote_decode_s(p, share, y)
        return ((1 + p.eta) * p.n_out * r * (hw + p.cpu_rate(y))
                + lam * np.maximum(loc_dec, r))

    a, b = lo.copy(), np.full_like(lo, hi)
    c, d = b - GOLDEN * (b - a), a + GOLDEN * (b - a)
    fc, fd = obj(c), obj(d)
    for _ in range(60):
        left = fc < fd
        b = np.where(left, d, b)
        a = np.where(left, a, c)
        c_new, d_new = b - GOLDEN * (b - a), a + GOLDEN * (b - a)
        c, d = c_new, d_new
        fc, fd = obj(c), obj(d)
    best = (a + b) / 2
    grid = lo[:, None] + (hi - lo)[:, None] * np.linspace(0, 1, 64)[None, :]
    g_obj = np.stack([obj(grid[:, j]) for j in range(grid.shape[1])], axis=1)
    j = np.argmin(g_obj, axis=1)
    alt = grid[np.arange(len(lo)), j]
    return np.where(g_obj[np.arange(len(lo)), j] < obj(best), alt, best)


def solve_memory(p: RemoeProblem, x: np.ndarray, main_mb: int,
                 gpu_gb: float) -> MemoryResult:
    """IV-E: minimise P2 = (1+η)·Σ_l n_out·r_l(y_l)·(H_w + c_c·y_l) subject to the TPOT
    constraint Σ_l (t^f + 2τ_sw + max(local_l, r_l(y_l))) <= TPOT and y_l in
    [max(m_1, need_l), m_V], by the dual: λ* is 0 when the unconstrained optimum meets
    TPOT, else the root of the constraint in λ (scipy brentq; y(λ) is the per-layer
    minimiser of the Lagrangian); y~ is rounded up to the remote memory options."""
    from scipy.optimize import brentq

    L = p.num_layers
    has: np.ndarray = np.asarray(x.any(axis=1), bool)
    share = np.sum(p.s_LE * x, axis=1)
    t_loc = p.expert_s(p.gb(main_mb))
    loc_dec = p.top_k * np.sum(p.s_LE * ~x, axis=1) * t_loc
    hw = p.gpu_price_gb_s * gpu_gb + p.cpu_rate(p.gb(main_mb))
    bound = 2 * p.cpu_price_gb_s / hw
    theta2 = p.law.theta2
    fixed = L * (p.nonexpert_token_s + 2 * p.swap_s(p.top_k)) + float(np.sum(loc_dec[~has]))
    budget = p.tpot_slo_s - fixed
    hi = p.gb(p.remote_memory_mb[-1])
    need = np.array([remote_need_mb(p, x[li], li) for li in range(L)]) / 1024.0
    lo = np.maximum(p.gb(p.remote_memory_mb[0]), need)
    if np.any(lo[has] > hi + 1e-12):
        li = int(np.argmax(np.where(has, lo, 0)))
        raise InfeasibleError(
            f"infeasible: layer {li}'s remote experts need {lo[li] * 1024:.0f} MB, the "
            f"largest remote option is {p.remote_memory_mb[-1]} MB",
            "offer larger remote functions or lower the remote ratio")
    idx = np.flatnonzero(has)
    s_h, ld_h, lo_h = share[idx], loc_dec[idx], np.minimum(lo[idx], hi)

    def y_of(lam: float) -> np.ndarray:
        return _inner(p, lam, s_h, ld_h, lo_h, hi, hw)

    def slack(lam: float) -> float:
        y = y_of(lam)
        return float(np.sum(np.maximum(ld_h, remote_decode_s(p, s_h, y)))) - budget

    def primal(y: np.ndarray) -> float:
        r = remote_decode_s(p, s_h, y)
        return float(np.sum((1 + p.eta) * p.n_out * r * (hw + p.cpu_rate(y))))

    lam = 0.0
    if idx.size and slack(0.0) > 0:
        top = float(np.sum(np.maximum(ld_h, remote_decode_s(p, s_h, np.full_like(s_h, hi)))))
        if top > budget * (1 + 1e-9):
            raise InfeasibleError(
                f"infeasible: with the largest remote memory the TPOT is "
                f"{(top + fixed):.4g} s, the SLO {p.tpot_slo_s:.4g} s",
                "raise the TPOT SLO or lower the remote ratio")
        hi_lam = 1.0
        while slack(hi_lam) > 0 and hi_lam < 1e30:
            hi_lam *= 4.0
        lam = float(brentq(slack, 0.0, hi_lam, xtol=1e-12 * hi_lam, rtol=1e-10))
        if slack(lam) > 0:  # the root can sit a hair on the infeasible side: bisect to
            lo_lam = lam      # the feasible one (slack is non-increasing in λ)
            for _ in range(60):
                mid = (lo_lam + hi_lam) / 2
                lo_lam, hi_lam = (mid, hi_lam) if slack(mid) > 0 else (lo_lam, mid)
            lam = hi_lam
    y_h = y_of(lam) if idx.size else np.zeros(0)
    prim = primal(y_h)
    dual = prim + lam * slack(lam) if idx.size else 0.0
    y_all = np.full(L, np.nan)
    y_all[idx] = y_h
    mb = []
    for li in range(L):
        if not has[li]:
            mb.append(0)
            continue
        want = y_all[li] * 1024.0
        mb.append(next(m for m in p.remote_memory_mb if m >= want - 1e-6))
    return MemoryResult(y_all, tuple(mb), lam, prim, dual, theta2 >= bound, theta2, bound)


def _groups(p: RemoeProblem, li: int, remote_E: np.ndarray, z: int) -> tuple[tuple[int, ...], ...]:
    ids = np.flatnonzero(remote_E)
    if ids.size == 0:
        return ()
    bins = lpt(p.prefill_tokens_LE[li][ids], min(z, ids.size))
    return tuple(tuple(int(ids[i]) for i in sorted(b)) for b in bins if b)


def theorem4_bound(p: RemoeProblem, li: int, remote_E: np.ndarray, y_gb: float,
                   z: int) -> float:
    """Theorem 4: the slowest of z replicas with 95% probability."""
    n_up = theorem1_bound(p.n_in * p.top_k, p.num_experts, 1)
    unit = p.expert_s(y_gb) * p.prefill_factor + _wire(p)
    total = float(np.sum(p.prefill_tokens_LE[li][remote_E])) * unit
    return (z - 1) / z * n_up * unit + total / z + p.invoke_overhead_s


def choose_replicas(p: RemoeProblem, x: np.ndarray, main_mb: int, remote_mb: tuple[int, ...],
                    rate_main: float) -> tuple[list[int], int]:
    """IV-F2: start from the payload-feasible z_l, add a replica to the layer with the
    largest potential (eq. 15) until the worst-case TTFT (Theorem 4) holds, then while
    some potential is positive. Returns (z, steps). ``rate_main`` = c_g·M_g + c_c·w."""
    L, t_loc = p.num_layers, p.expert_s(p.gb(main_mb)) * p.prefill_factor
    y = [p.gb(m) for m in remote_mb]
    z = [0] * L
    memo: dict[tuple[int, int], tuple[tuple[int, ...], ...]] = {}

    def grp_of(li: int, zl: int) -> tuple[tuple[int, ...], ...]:
        if (li, zl) not in memo:  # LPT is the planner's inner loop: once per (layer, z)
            memo[li, zl] = _groups(p, li, x[li], zl)
        return memo[li, zl]

    for li in range(L):
        if not x[li].any():
            continue
        z[li] = 1
        sizes = p.prefill_tokens_LE[li] * p.token_bytes
        while True:
            grp = grp_of(li, z[li])
            if max(sum(sizes[k] for k in g) for g in grp) <= p.payload_bytes:
                break
            if z[li] >= min(p.max_replicas, int(x[li].sum())):
                raise InfeasibleError(
                    f"infeasible: layer {li}'s remote tokens exceed the payload limit "
                    f"({p.payload_bytes:.0f} B) even with {z[li]} replicas",
                    "raise max replicas or shorten the prompts")
            z[li] += 1

    def layer_cost(li: int, zl: int) -> tuple[float, float]:
        t, zt = prefill_layer(p, li, x[li], t_loc, y[li], grp_of(li, zl))
        return t, rate_main * t + p.cpu_rate(y[li]) * sum(zt)

    def potential(li: int) -> float:
        cap = min(p.max_replicas, int(x[li].sum()))
        if not x[li].any() or z[li] >= cap:
            return -math.inf
        return layer_cost(li, z[li])[1] - layer_cost(li, z[li] + 1)[1]

    fixed = p.n_in * p.nonexpert_prefill_token_s + 2 * p.swap_s(p.n_in)
    n_loc_up = [theorem1_bound(p.n_in * p.top_k, p.num_experts, int((~x[li]).sum()))
                if (~x[li]).any() else 0.0 for li in range(L)]

    def ttft_wc() -> float:
        biggest = max((len(g) for li in range(L) if z[li] for g in grp_of(li, z[li])),
                      default=0) if p.load_bytes_s > 0 else 0
        cold = p.cold_s(float(np.sum(~x)), biggest)
        return cold + sum(fixed + max(n_loc_up[li] * t_loc,
                                      theorem4_bound(p, li, x[li], y[li], z[li])
                                      if z[li] else 0.0) for li in range(L))

    steps = 0
    pots = [potential(li) for li in range(L)]
    while ttft_wc() > p.ttft_slo_s or max(pots, default=-math.inf) > 0:
        best = int(np.argmax(pots))
        if pots[best] == -math.inf:
            break  # every layer at z_max: MMP's worst case already allowed for this
        z[best] += 1
        pots[best] = potential(best)
        steps += 1
    return z, steps


def build_layout(p: RemoeProblem, x: np.ndarray, main_mb: int, remote_mb: tuple[int, ...],
                 z: list[int]) -> Layout:
    groups = tuple(_groups(p, li, x[li], z[li]) for li in range(p.num_layers))
    return Layout("remoe", main_mb, x, remote_mb, groups)
