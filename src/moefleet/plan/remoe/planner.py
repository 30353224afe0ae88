"""Remoe's planner and its baselines, and their plan files.

``plan_policy(problem, "remoe")`` (or ``"remoe-sweep"``, see :func:`plan_remoe`) runs
MMP → remote selection → Lagrangian memory → LPT replicas and evaluates the layout
with eqs. 1-10; ``cpu``, ``gpu``, ``mix`` and ``fetch`` are the paper's baselines
(V-C), each sized to the smallest memory that holds it. Every policy raises
:class:`InfeasibleError` when its expected TTFT/TPOT misses the SLOs, unless
``check_slo=False`` (benchmarks compare costs regardless).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moefleet.plan.plan import DeploymentPlan, ExpertConfig, ExpertGroup, LayerPlan, MainFunction
from moefleet.plan.remoe.model import KINDS, Estimate, Kind, Layout, evaluate, main_need_mb
from moefleet.plan.remoe.problem import InfeasibleError, RemoeError, RemoeProblem
from moefleet.plan.remoe.solve import (
    build_layout,
    choose_replicas,
    mmp,
    select_remote,
    solve_memory,
    worst_case,
)

POLICIES: tuple[str, ...] = (*KINDS, "remoe-sweep")


@dataclass
class RemoeResult:
    policy: str
    layout: Layout
    estimate: Estimate
    solve_s: float
    meta: dict[str, Any] = field(default_factory=dict)

    def to_plan(self, p: RemoeProblem, moe_layers: list[int] | None = None) -> DeploymentPlan:
        """The plan file: a ``main`` function and one expert group per layer with remote
        experts; ``layers`` lists every expert with the memory of the function holding it."""
        lay = self.layout
        layers_idx = moe_layers or list(range(p.num_layers))
        groups, layer_plans = [], []
        for li, layer in enumerate(layers_idx):
            mem = [lay.main_mb] * p.num_experts
            rem = [int(e) for e in np.flatnonzero(lay.remote_LE[li])]
            if rem:
                z = len(lay.groups[li])
                groups.append(ExpertGroup(layer=layer, experts=rem,
                                          memory_mb=lay.remote_mb[li], replicas=z,
                                          replica_experts=[list(g) for g in lay.groups[li]]))
                for e in rem:
                    mem[e] = lay.remote_mb[li]
            layer_plans.append(LayerPlan(layer=layer, method="direct", beta=1, experts=[
                ExpertConfig(memory_mb=m, replicas=len(lay.groups[li]) if e in rem else 1)
                for e, m in enumerate(mem)]))
        est = self.estimate
        gpu_note = bool(est.gpu_gb > 0)
        predicted = {"cost_usd": est.cost, "ttft_s": est.ttft_s, "tpot_s": est.tpot_s,
                     "prefill_s": est.pt_s, "decode_s": est.gt_s, "main_cost_usd": est.c_loc,
                     "remote_prefill_cost_usd": est.pc_rem,
                     "remote_decode_cost_usd": est.gc_rem, "ttft_slo_s": p.ttft_slo_s,
                     "tpot_slo_s": p.tpot_slo_s, "solve_s": self.solve_s}
        meta = {"algorithm": f"remoe:{self.policy}", "kind": lay.kind,
                "n_in": p.n_in, "n_out": p.n_out, **self.meta}
        if gpu_note:
            meta["gpu"] = ("GPU emulated: GPU times are modelled, the GPU price is applied "
                           "to them; nothing here ran on a GPU")
        return DeploymentPlan(
            model=p.model, platform=p.platform or "custom", segment_memory_mb=[],
            layers=layer_plans, policy=self.policy if self.policy.startswith("remoe")
            else f"remoe-{self.policy}", predicted=predicted, meta=meta,
            main=MainFunction(memory_mb=lay.main_mb, gpu_gb=float(est.gpu_gb)),
            groups=groups)


def _check(p: RemoeProblem, name: str, est: Estimate, check_slo: bool) -> None:
    if check_slo and est.gpu_gb > p.gpu_card_gb + 1e-9:
        raise InfeasibleError(
            f"infeasible: the {name} layout needs {est.gpu_gb:.0f} GB of GPU memory, one "
            f"GPU of the platform has {p.gpu_card_gb:.0f} GB",
            "use --policy remoe or mix (experts on CPU), or a platform with larger GPUs")
    if check_slo and not est.meets(p):
        raise InfeasibleError(
            f"infeasible: the {name} layout gives TTFT {est.ttft_s:.4g} s / TPOT "
            f"{est.tpot_s:.4g} s; the SLOs are TTFT {p.ttft_slo_s:.4g} s / TPOT "
            f"{p.tpot_slo_s:.4g} s", "raise the SLOs or use --policy remoe")


def _pipeline(p: RemoeProblem, r: int, main_mb: int) -> tuple[Layout, Estimate, Any, list[int],
                                                               int]:
    x = select_remote(p, r)
    gpu_gb = p.gpu_memory_gb()
    mem = solve_memory(p, x, main_mb, gpu_gb)
    rate = p.gpu_price_gb_s * gpu_gb + p.cpu_rate(p.gb(main_mb))
    z, steps = choose_replicas(p, x, main_mb, mem.remote_mb, rate)
    lay = build_layout(p, x, main_mb, mem.remote_mb, z)
    return lay, evaluate(p, lay), mem, z, steps


def plan_remoe(p: RemoeProblem, check_slo: bool = True, sweep: bool = False) -> RemoeResult:
    """MMP → utility selection → Lagrangian memory → LPT replicas (IV-C..IV-F).

    ``sweep`` (ours, not the paper's): MMP returns the *largest* remote ratio b whose
    worst case meets the SLOs, which is not always the cheapest; with ``sweep`` the rest
    of the pipeline also runs at b·{3/4, 1/2, 1/4, 0} (main memory re-sized by MMP's rule,
    worst case re-checked) and the cheapest layout wins."""
    if not p.has_gpu:
        raise RemoeError("Remoe's main function needs a GPU price (gpu_price_gb_s > 0)",
                         "use a GPU platform, or --policy cpu")
    t0 = time.perf_counter()
    m = mmp(p)
    E = p.num_experts
    cands = [m.remote_per_layer]
    if sweep:
        cands += sorted({round(m.remote_per_layer * f) for f in (0.75, 0.5, 0.25, 0.0)}
                        - {m.remote_per_layer}, reverse=True)
    best: tuple[Layout, Estimate, Any, list[int], int] | None = None
    tried = []
    for r in cands:
        main_mb = m.main_mb
        if r != m.remote_per_layer:
            x = select_remote(p, r)
            need = max(main_need_mb(p, "remoe", x), p.remote_memory_mb[-1])
            if need > p.main_memory_mb[-1]:
                continue
            main_mb = p.round_main(need)
            ttft_wc, tpot_wc = worst_case(p, r, main_mb)
            if ttft_wc > p.ttft_slo_s or tpot_wc > p.tpot_slo_s:
                continue
        got = _pipeline(p, r, main_mb)
        tried.append({"b": r / E, "cost_usd": got[1].cost})
        if best is None or got[1].cost < best[1].cost:
            best = got
    assert best is not None  # MMP's own ratio always runs
    lay, est, mem, z, steps = best
    solve_s = time.perf_counter() - t0
    meta = {
        "mmp": {"b": m.b, "remote_per_layer": m.remote_per_layer, "main_mb": m.main_mb,
                "ttft_worst_case_s": m.ttft_wc_s, "tpot_worst_case_s": m.tpot_wc_s},
        "chosen_b": float(lay.remote_LE[0].sum()) / E, "sweep": tried if sweep else None,
        "memory": {"lambda": mem.lam, "primal": mem.primal, "dual": mem.dual,
                   "y_continuous_mb": [None if np.isnan(v) else float(v) * 1024
                                       for v in mem.y_gb],
                   "theorem2_convex": bool(mem.convex), "theta2": mem.theta2,
                   "theorem2_bound": mem.convexity_bound},
        "replicas": {"z": z, "steps": steps},
    }
    _check(p, "Remoe", est, check_slo)
    return RemoeResult("remoe-sweep" if sweep else "remoe", lay, est, solve_s, meta)


def plan_baseline(p: RemoeProblem, kind: Kind, check_slo: bool = True) -> RemoeResult:
    """CPU / GPU / MIX / Fetch (V-C): the smallest main memory that holds the layout."""
    if kind in ("gpu", "mix", "fetch") and not p.has_gpu:
        raise RemoeError(f"the {kind} baseline needs a GPU price (gpu_price_gb_s > 0)",
                         "use a GPU platform, or --policy cpu")
    t0 = time.perf_counter()
    x = np.zeros((p.num_layers, p.num_experts), bool)
    # Fetch: nothing is remote, so every expert stays cached in the main's CPU memory.
    need = main_need_mb(p, kind, x)
    main_mb = p.round_main(need)
    lay = Layout(kind, main_mb, x, (0,) * p.num_layers, ((),) * p.num_layers)
    est = evaluate(p, lay)
    _check(p, kind.upper(), est, check_slo)
    meta: dict[str, Any] = {}
    if est.gpu_gb > p.gpu_card_gb + 1e-9:  # only reachable with check_slo=False
        meta["gpu_over_one_card"] = (f"needs {est.gpu_gb:.0f} GB of GPU memory, one card "
                                     f"has {p.gpu_card_gb:.0f} GB: billed as if it fitted")
    return RemoeResult(kind, lay, est, time.perf_counter() - t0, meta)


def plan_policy(p: RemoeProblem, policy: str, check_slo: bool = True) -> RemoeResult:
    if policy in ("remoe", "remoe-sweep"):
        return plan_remoe(p, check_slo, sweep=policy == "remoe-sweep")
    for kind in KINDS:
        if kind == policy:
            return plan_baseline(p, kind, check_slo)
    raise RemoeError(f"unknown Remoe policy {policy!r}", f"use one of {', '.join(KINDS)}")
