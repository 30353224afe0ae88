"""Problem (12) as one MIQCP, solved by SCIP (pyscipopt) or Gurobi: the reference solver.

This is the literal formulation (the paper's "MIQCP" baseline, and ODS's per-method
solves with ``backend="scip"``). It is slow beyond small instances, which is why ODS
uses :mod:`moefleet.plan.frontier` by default; tests check both agree where SCIP finishes.

Variables, per MoE layer e: method one-hot m[e,a]; per active expert i (d > 0) and
method a, a one-hot q[e,i,a,(j,g)] over the (memory, replicas) pairs that satisfy the
memory rule (12c) — and the payload rule (12f) for a=3 — with Σ q = m[e,a]. (A pair
one-hot is the product x[e,i,j]·y[e,i,g] of the paper's two one-hots, linearised.)
For a=2, 3 t_rep and the billed cost of a pair are constants, so they enter linearly. For
a=1: β_e integer in 1..max d; nblk_i integer with nblk_i·β_e ≥ r (quadratic, eq. 6's
ceil); P_i ≥ nblk_i·β_e (quadratic); t_rep = Σ q·(T_head + T_acc) + T_acc·nblk +
Σ κ_j·(q·P) + β·D_out/B_s with κ_j = max(D_in/B_s + U_j, D_out/B_s), products with a
binary linearised by big-M; billed seconds = granularity × integer k_i ≥ t_rep (≥ t_rep −
T_warm with ``warm_instances``, whose T_head and T_load come from the shared helpers). Layer
latency maxima (eqs. 7, 9, 11) become auxiliaries A[e,a] ≥ t_rep and A[e,a] ≥ m·T_load;
Σ_e latency ≤ T_limit − Σ T^NE (12d). The objective is the cost model's cost exactly.

Backends are imported lazily; without pyscipopt (and gurobipy) planning with this module
raises ``MissingExtraError("pyscipopt", "plan")``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moefleet.errors import MissingExtraError
from moefleet.plan.base import METHODS, Frontiers, LayerChoice, Planner, build_plan
from moefleet.plan.costmodel import PARAM_GETS, Rates
from moefleet.plan.frontier import ExpertChoice, LayerTables, choose_experts
from moefleet.plan.plan import DeploymentPlan
from moefleet.plan.problem import InfeasibleError, PlanningProblem
from moefleet.plan.transfers import layer_transfer_usd


class _Model:
    """The few modelling calls we need, over SCIP or Gurobi."""

    def __init__(self, solver: str, time_limit_s: float, seed: int) -> None:
        self.kind = _pick_solver(solver)
        if self.kind == "gurobi":
            import gurobipy as gp

            self.gp = gp
            self.m: Any = gp.Model()
            self.m.Params.OutputFlag = 0
            self.m.Params.TimeLimit = time_limit_s
            self.m.Params.NonConvex = 2
            self.m.Params.Seed = seed
        else:
            import pyscipopt as scip

            self.m = scip.Model()
            self.m.hideOutput()
            self.m.setParam("limits/time", time_limit_s)
            self.m.setParam("randomization/randomseedshift", seed)

    def var(self, vtype: str, lb: float = 0.0, ub: float | None = None) -> Any:
        if self.kind == "gurobi":
            t = {"B": self.gp.GRB.BINARY, "I": self.gp.GRB.INTEGER, "C": self.gp.GRB.CONTINUOUS}
            return self.m.addVar(lb=lb, ub=self.gp.GRB.INFINITY if ub is None else ub,
                                 vtype=t[vtype])
        return self.m.addVar(vtype=vtype, lb=lb, ub=ub)

    def cons(self, c: Any) -> None:
        (self.m.addConstr if self.kind == "gurobi" else self.m.addCons)(c)

    def solve(self, objective: Any) -> bool:
        """Minimise; True when a feasible solution was found."""
        if self.kind == "gurobi":
            self.m.setObjective(objective, self.gp.GRB.MINIMIZE)
            self.m.optimize()
            return bool(self.m.SolCount > 0)
        self.m.setObjective(objective, "minimize")
        self.m.optimize()
        return bool(self.m.getNSols() > 0)

    def val(self, v: Any) -> float:
        return float(v.X) if self.kind == "gurobi" else float(self.m.getVal(v))

    def status(self) -> tuple[str, float]:
        if self.kind == "gurobi":
            return str(self.m.Status), float(getattr(self.m, "MIPGap", math.nan))
        return str(self.m.getStatus()), float(self.m.getGap())


def _pick_solver(solver: str) -> str:
    if solver in ("auto", "gurobi"):
        try:
            import gurobipy  # noqa: F401

            return "gurobi"
        except ImportError:
            if solver == "gurobi":
                raise MissingExtraError("gurobipy", "plan") from None
    try:
        import pyscipopt  # noqa: F401
    except ImportError:
        raise MissingExtraError("pyscipopt", "plan") from None
    return "scip"


@dataclass(frozen=True)
class MiqcpResult:
    layers: list[LayerChoice] | None  # None: no feasible solution found
    status: str
    gap: float
    solver: str
    solve_s: float


def solve_miqcp(
    problem: PlanningProblem, allowed: Sequence[Sequence[int]], time_limit_s: float = 60.0,
    seed: int = 0, solver: str = "auto",
) -> MiqcpResult:
    """Solve (12) with layer e's method restricted to ``allowed[e]``."""
    t0 = time.perf_counter()
    mdl = _Model(solver, time_limit_s, seed)
    rates = Rates.of(problem)
    # a=1's parameter GETs (requests_per_replica); none when instances hold their weights.
    param_get = 0.0 if rates.warm_instances else PARAM_GETS * rates.per_get
    cost_terms: list[Any] = []
    lat_terms: list[Any] = []
    layer_vars: list[dict[str, Any]] = []
    for li, methods in enumerate(allowed):
        tab = LayerTables(problem, li, rates)
        m = {a: mdl.var("B") for a in methods}
        mdl.cons(sum(m.values()) == 1)
        info: dict[str, Any] = {"m": m, "q": {}, "beta": None, "tab": tab}
        cost_terms += [layer_transfer_usd(problem, li, a, rates.per_put, rates.per_get) * m[a]
                       for a in methods]  # the segments' requests (frontier does the same)
        if not tab.active.any():
            lat_terms += [tab.empty_latency(a) * m[a] for a in methods]
            layer_vars.append(info)
            continue
        rows = tab.inv  # active expert -> row of the tables
        sum_d = float(tab.d.sum())
        for a in methods:
            const = rates.acc_s + sum_d * problem.bytes_out / rates.bs if a in (1, 2) else 0.0
            big_a = mdl.var("C")
            mdl.cons(big_a >= problem.load_s(li) * m[a] if a in (1, 2) else big_a >= 0)
            lat_terms += [big_a, const * m[a]]
            if a == 3:
                big_r = mdl.var("C")
                lat_terms += [big_r * (problem.bytes_out / rates.bf), problem.load_s(li) * m[a]]
            t_tab, c_tab = tab.options(a, 1)
            if a == 1:
                beta_max = int(tab.ud.max())
                beta = mdl.var("I", 1, beta_max)
                tail = mdl.var("C")
                mdl.cons(tail >= (beta - beta_max * (1 - m[a])) * (problem.bytes_out / rates.bs))
                info["beta"] = beta
            for i, row in enumerate(rows):
                opts = list(zip(*np.nonzero(np.isfinite(t_tab[0, row])), strict=True))
                q = {(int(j), int(g)): mdl.var("B") for j, g in opts}
                info["q"][(a, i)] = q
                mdl.cons(sum(q.values()) == m[a])  # no options: forces m[a] = 0
                if not q:
                    continue
                r = {o: int(tab.r_UG[row, o[1]]) for o in q}
                if a in (2, 3):
                    mdl.cons(big_a >= sum(float(t_tab[0, row, j, g]) * v
                                          for (j, g), v in q.items()))
                    cost_terms += [float(c_tab[0, row, j, g]) * v for (j, g), v in q.items()]
                    if a == 3:
                        mdl.cons(big_r >= sum(r[o] * v for o, v in q.items()))
                    continue
                d_i = int(tab.ud[row])
                nblk = mdl.var("I", 0, d_i)
                p_max = 2.0 * beta_max
                prod = mdl.var("C", 0, p_max)
                mdl.cons(nblk * beta >= sum(r[o] * v for o, v in q.items()))
                mdl.cons(prod >= nblk * beta)
                kappa = {o: max(problem.bytes_in / rates.bs + float(tab.u_J[o[0]]),
                                problem.bytes_out / rates.bs) for o in q}
                t_rep = (sum((tab.head + rates.acc_s) * v for v in q.values())
                         + rates.acc_s * nblk + tail)
                for o, v in q.items():
                    w = mdl.var("C")
                    mdl.cons(w >= prod - p_max * (1 - v))
                    t_rep = t_rep + kappa[o] * w
                mdl.cons(big_a >= t_rep)
                t_max = (tab.head + 2 * rates.acc_s + d_i * rates.acc_s + p_max * max(
                    kappa.values()) + beta_max * problem.bytes_out / rates.bs)
                k_max = math.ceil(t_max / rates.gran_s) + 1
                k = mdl.var("I", 0, k_max)
                if rates.warm_instances:  # the handler is billed, not the warm start
                    mdl.cons(rates.gran_s * k >= t_rep - rates.unbilled_s * sum(q.values()))
                else:
                    mdl.cons(rates.gran_s * k >= t_rep)
                mdl.cons(rates.gran_s * k >= rates.min_billed_s * sum(q.values()))
                for (j, gi), v in q.items():
                    g = int(tab.g[gi])  # gi indexes the replica counts 1..G
                    u, z = mdl.var("C"), mdl.var("C")
                    mdl.cons(u >= k - k_max * (1 - v))
                    mdl.cons(z >= nblk - d_i * (1 - v))
                    cost_terms += [
                        g * float(tab.price_J[j]) * rates.gran_s * u,
                        g * (rates.per_request + param_get) * v,
                        g * 2 * (rates.per_put + rates.per_get) * z,
                    ]
        layer_vars.append(info)
    mdl.cons(sum(lat_terms) <= problem.slo_s - problem.fixed_latency_s)
    found = mdl.solve(sum(cost_terms))
    status, gap = mdl.status()
    layers = _extract(problem, mdl, layer_vars, rates) if found else None
    return MiqcpResult(layers, status, gap, mdl.kind, time.perf_counter() - t0)


def _extract(
    problem: PlanningProblem, mdl: _Model, layer_vars: list[dict[str, Any]], rates: Rates
) -> list[LayerChoice]:
    out = []
    for info in layer_vars:
        a = max(info["m"], key=lambda k: mdl.val(info["m"][k]))
        tab = info["tab"]
        if not tab.active.any():
            _, experts = choose_experts(tab, a, 0.0, 1)
            out.append(LayerChoice(a, 1, experts))
            continue
        idle = choose_experts(tab, 2, np.inf, 0)[1]
        experts, active_i, r_max = list(idle), 0, 0
        for i, on in enumerate(tab.active):
            if not on:
                continue
            q = info["q"][(a, active_i)]
            j, g = max(q, key=lambda o: mdl.val(q[o]))
            experts[i] = ExpertChoice(int(tab.mem[j]), int(tab.g[g]))
            r_max = max(r_max, int(tab.r_UG[tab.inv[active_i], g]))
            active_i += 1
        beta = round(mdl.val(info["beta"])) if a == 1 else 1
        out.append(LayerChoice(a, max(1, min(beta, r_max)), experts))
    return out


class MiqcpPlanner(Planner):
    """The whole of problem (12), methods included, in one MIQCP with a time limit.

    Returns the best solution found within ``time_limit_s`` (``meta.status`` says whether
    SCIP proved it optimal, ``meta.gap`` its relative gap)."""

    name = "miqcp"

    def __init__(self, time_limit_s: float = 60.0, solver: str = "auto") -> None:
        self.time_limit_s, self.solver = time_limit_s, solver

    def plan(self, problem: PlanningProblem, seed: int = 0) -> DeploymentPlan:
        t0 = time.perf_counter()
        Frontiers(problem).check_feasible()
        res = solve_miqcp(problem, [METHODS] * problem.num_moe_layers, self.time_limit_s,
                          seed, self.solver)
        if res.layers is None:
            raise InfeasibleError(
                f"infeasible: the MIQCP solver found no feasible plan within "
                f"{self.time_limit_s:g} s (status {res.status})",
                "raise --time-limit or the SLO, or use --policy ods",
            )
        meta = {"algorithm": "miqcp", "solver": res.solver, "status": res.status,
                "gap": res.gap if math.isfinite(res.gap) else None,
                "time_limit_s": self.time_limit_s}
        plan, _ = build_plan(problem, res.layers, self.name, meta, t0)
        return plan
