"""ODS: Optimal Deployment Selection (ODS/BO Alg. 1, as READING-NOTES reads it).

1. Solve problem (12) three times, every layer fixed to a=1, a=2, a=3 (per-method solves).
2. Per layer take the method whose solve gave that layer the lowest cost; if the summed
   latency misses the end-to-end limit, set the cost of the slowest layer's chosen method
   to infinity and choose again; at most 2|E| rounds.
3. If that fails, return the cheapest of the three single-method solutions.

Per-method solves: ``backend="decomposition"`` (default) uses the exact per-layer
frontiers of :mod:`moefleet.plan.frontier` and the knapsack of :mod:`moefleet.plan.combine`
— the same optimum the MIQCP has whenever ``meta.exact`` is true (all β/ρ enumerated and
the exact merge used), otherwise a feasible plan within the certified gap
``meta.lower_bound_usd``; ``backend="scip"`` solves each per-method MIQCP with
:mod:`moefleet.plan.miqcp` (the paper's literal procedure, slow).

Additions of ours (``meta.result`` names the candidate returned, ``meta.alg1_cost_usd``
what Alg. 1 alone gave):
- ``polish``: re-optimise memory/replicas/β with Alg. 1's method vector fixed (never worse
  than Alg. 1's own combination, which stays a candidate);
- ``refine``: also consider the cheapest single-method solution and the mixed-method
  problem solved directly (union of the per-method frontiers per layer). Alg. 1 loses a
  whole method when one layer cannot use it (e.g. a payload too large for direct
  invocation in one layer wipes out the all-direct solve for every layer), and its
  per-method solves split the latency budget for one method only; on tiny instances
  this costs up to 1.75x the optimum (tests/unit/test_plan_ods.py, benchmarks/ods_solve.py).
  With ``refine`` the result is the optimum of (12) whenever ``meta.exact`` is true.
- When Alg. 1 fails and no single-method solve is feasible, the mixed solve is the
  fallback instead of an error. ``OdsPlanner(polish=False, refine=False)`` (policy
  ``ods-paper``) is Alg. 1 as published, with only that fallback.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import numpy as np

from moefleet.plan.base import (
    METHODS,
    Frontiers,
    LayerChoice,
    Planner,
    build_plan,
)
from moefleet.plan.costmodel import Estimate
from moefleet.plan.frontier import EXACT_LIMIT, GRID
from moefleet.plan.plan import DeploymentPlan
from moefleet.plan.problem import InfeasibleError, PlanningProblem

Backend = Literal["decomposition", "scip"]


class OdsPlanner(Planner):
    """ODS over exact per-method solves (see the module docstring for the guarantees)."""

    name = "ods"

    def __init__(
        self,
        backend: Backend = "decomposition",
        polish: bool = True,
        refine: bool = True,
        time_limit_s: float = 60.0,
        exact_limit: int = EXACT_LIMIT,
        grid: int = GRID,
    ) -> None:
        self.backend, self.polish, self.refine = backend, polish, refine
        self.name = "ods" if refine else "ods-paper"  # the plan's ``policy``
        self.time_limit_s = time_limit_s
        self.exact_limit, self.grid = exact_limit, grid

    # -- per-method / fixed-vector solves ------------------------------------------------
    def _solve(
        self, fr: Frontiers, allowed: list[list[int]], seed: int, info: dict[str, Any]
    ) -> list[LayerChoice] | None:
        if self.backend == "scip":
            from moefleet.plan.miqcp import solve_miqcp

            res = solve_miqcp(fr.problem, allowed, self.time_limit_s, seed)
            info.setdefault("solver_status", []).append(res.status)
            return res.layers
        sol = fr.solve(allowed)
        if sol is None:
            return None
        info["exact"] = info.get("exact", True) and sol.selection.exact
        info["lower_bounds"] = [*info.get("lower_bounds", []), sol.selection.lower_bound]
        return fr.plan_of(sol)

    def plan(self, problem: PlanningProblem, seed: int = 0) -> DeploymentPlan:
        t0 = time.perf_counter()
        fr = Frontiers(problem, self.exact_limit, self.grid)
        fr.check_feasible()
        n_l = problem.num_moe_layers
        info: dict[str, Any] = {}
        per_method: dict[int, tuple[list[LayerChoice], Estimate]] = {}
        for a in METHODS:
            layers = self._solve(fr, [[a]] * n_l, seed, info)
            if layers is not None:
                est = _estimate(problem, layers)
                if est.feasible:
                    per_method[a] = (layers, est)
        vector, rounds = _algorithm1(problem, per_method)
        # Candidates in order of preference on equal cost: the paper's result first.
        candidates: list[tuple[str, list[LayerChoice]]] = []
        if vector is not None:
            candidates.append(("alg1", [per_method[a][0][li] for li, a in enumerate(vector)]))
            if self.polish:
                layers = self._solve(fr, [[a] for a in vector], seed, info)
                if layers is not None:
                    candidates.append(("polish", layers))
        if per_method and (vector is None or self.refine):
            best = min(per_method, key=lambda a: per_method[a][1].cost_usd)
            candidates.append((f"single-method a={best}", per_method[best][0]))
        if self.refine or not candidates:
            layers = self._solve(fr, [list(METHODS)] * n_l, seed, info)
            if layers is not None:
                candidates.append(("mixed", layers))
        scored = [(k, name, ls, _estimate(problem, ls))
                  for k, (name, ls) in enumerate(candidates)]
        scored = [s for s in scored if s[3].feasible]
        if not scored:
            raise InfeasibleError(
                "infeasible: ODS found no plan meeting the SLO although the fastest "
                "configuration does (the per-method solves did not finish)",
                "raise the SLO or --time-limit, or use the decomposition backend",
            )
        _, name, layers, _ = min(scored, key=lambda s: (s[3].cost_usd, s[0]))
        meta: dict[str, Any] = {
            "algorithm": "ods",
            "backend": self.backend,
            "rounds": rounds,
            "result": name,
            "methods": [lc.method for lc in layers],
            "per_method_cost_usd": {str(a): per_method[a][1].cost_usd if a in per_method
                                    else None for a in METHODS},
            "alg1_cost_usd": next((s[3].cost_usd for s in scored if s[1] == "alg1"), None),
            "refine": self.refine,
        }
        if self.backend == "decomposition":
            meta["exact"] = bool(info.get("exact", True) and fr.exact)
            meta["frontier_points"] = fr.points
        if "solver_status" in info:
            meta["solver_status"] = info["solver_status"]
        plan, _ = build_plan(problem, layers, self.name, meta, t0)
        return plan


def _estimate(problem: PlanningProblem, layers: list[LayerChoice]) -> Estimate:
    return build_plan(problem, layers, "ods")[1]


def _algorithm1(
    problem: PlanningProblem, per_method: dict[int, tuple[list[LayerChoice], Estimate]]
) -> tuple[list[int] | None, int]:
    """Alg. 1's selection loop over the per-method solutions; (methods, rounds used)."""
    n_l = problem.num_moe_layers
    cost = np.full((n_l, len(METHODS)), np.inf)
    lat = np.full((n_l, len(METHODS)), np.inf)
    for a, (_, est) in per_method.items():
        cost[:, a - 1] = [le.cost_usd for le in est.layers]
        lat[:, a - 1] = [le.latency_s for le in est.layers]
    rounds = 0
    while rounds <= 2 * n_l:  # 2|E| exclusions, then a last check
        rounds += 1
        if np.isinf(cost).all(axis=1).any():
            return None, rounds
        pick = np.argmin(cost, axis=1)  # first minimum: ties go to the lower method code
        chosen = lat[np.arange(n_l), pick]
        if problem.fixed_latency_s + chosen.sum() <= problem.slo_s * (1 + 1e-12):
            return [int(a) + 1 for a in pick], rounds
        slow = int(np.argmax(chosen))
        cost[slow, pick[slow]] = np.inf
    return None, rounds
