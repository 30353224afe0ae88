"""The ``Planner`` interface, shared plan assembly and the frontier cache.

A planner turns a :class:`PlanningProblem` into a :class:`DeploymentPlan` whose
``predicted`` dict carries the analytical model's numbers for that plan (``cost_usd``,
``latency_s``, ``compute_usd``, ``request_usd``, ``storage_usd``, ``segment_cost_usd``,
``slo_s``, ``solve_s``) and whose ``meta`` says how it was found. Contract (tests/contracts):
the returned plan is feasible under :func:`moefleet.plan.costmodel.evaluate`, the same
seed gives the same plan, and an SLO no plan can meet raises :class:`InfeasibleError`
naming the fastest plan's latency and what binds it.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moefleet.plan.combine import Selection, choose
from moefleet.plan.costmodel import Estimate, Rates, evaluate
from moefleet.plan.frontier import (
    EXACT_LIMIT,
    GRID,
    ExpertChoice,
    Frontier,
    LayerTables,
    cheaper_than_before,
    choose_experts,
    layer_frontier,
)
from moefleet.plan.plan import CODE_METHODS, DeploymentPlan, ExpertConfig, LayerPlan
from moefleet.plan.problem import InfeasibleError, PlanningProblem

METHODS = (1, 2, 3)


class Planner(ABC):
    """Makes a deployment plan. ``seed`` feeds every random choice the planner makes."""

    name: str = "planner"

    @abstractmethod
    def plan(self, problem: PlanningProblem, seed: int = 0) -> DeploymentPlan:
        """A plan feasible under the analytical model, or raise InfeasibleError."""


@dataclass(frozen=True)
class LayerChoice:
    """One MoE layer's configuration: method a, β, and (memory, replicas) per expert."""

    method: int
    beta: int
    experts: list[ExpertChoice]


def build_plan(
    problem: PlanningProblem, layers: Sequence[LayerChoice], policy: str,
    meta: dict[str, Any] | None = None, started: float | None = None,
) -> tuple[DeploymentPlan, Estimate]:
    """Assemble the plan and fill ``predicted`` from :func:`evaluate`."""
    plan = DeploymentPlan(
        model=problem.model,
        platform=problem.platform.name,
        segment_memory_mb=[problem.segment_memory_mb] * problem.num_blocks,
        layers=[
            LayerPlan(
                layer=layer, method=CODE_METHODS[lc.method], beta=lc.beta,
                experts=[ExpertConfig(memory_mb=e.memory_mb, replicas=e.replicas)
                         for e in lc.experts],
            )
            for layer, lc in zip(problem.moe_layers, layers, strict=True)
        ],
        policy=policy,
        meta=dict(meta or {}),
    )
    if problem.warm_instances:  # the plan was priced under the warm-instances variant
        plan.meta.setdefault("warm_instances", True)
    est = evaluate(problem, plan)
    plan.predicted = {**est.as_predicted(), "slo_s": problem.slo_s}
    if started is not None:
        plan.predicted["solve_s"] = time.perf_counter() - started
    return plan, est


@dataclass(frozen=True)
class Solution:
    """A decomposition solve: per layer the method and its frontier point."""

    methods: list[int]
    points: list[int]
    selection: Selection


class Frontiers:
    """Lazily computed per-layer frontiers of one problem, with solves on top."""

    def __init__(
        self, problem: PlanningProblem, exact_limit: int = EXACT_LIMIT, grid: int = GRID
    ) -> None:
        self.problem = problem
        self.rates = Rates.of(problem)
        self.exact_limit, self.grid = exact_limit, grid
        self._cache: dict[tuple[int, int], Frontier] = {}
        self._tables: dict[int, LayerTables] = {}

    def tables(self, li: int) -> LayerTables:
        if li not in self._tables:
            self._tables[li] = LayerTables(self.problem, li, self.rates)
        return self._tables[li]

    def get(self, li: int, method: int) -> Frontier:
        key = (li, method)
        if key not in self._cache:
            self._cache[key] = layer_frontier(
                self.tables(li), method, self.exact_limit, self.grid
            )
        return self._cache[key]

    @property
    def exact(self) -> bool:
        """True when every frontier computed so far enumerated all β / ρ values."""
        return all(f.exact for f in self._cache.values())

    @property
    def points(self) -> int:
        """Frontier points computed so far (a size measure for reports)."""
        return sum(len(f) for f in self._cache.values())

    def choice(self, li: int, method: int, k: int) -> LayerChoice:
        f = self.get(li, method)
        beta, experts = choose_experts(self.tables(li), method, float(f.tau_s[k]),
                                       int(f.variant[k]))
        return LayerChoice(method, beta, experts)

    def budget(self) -> float:
        return self.problem.slo_s - self.problem.fixed_latency_s

    def solve(self, allowed: Sequence[Sequence[int]]) -> Solution | None:
        """Cheapest plan with layer e's method among ``allowed[e]`` (None: infeasible)."""
        lats, costs, owners = [], [], []
        for li, methods in enumerate(allowed):
            fr = [self.get(li, a) for a in methods]
            lat = np.concatenate([f.latency_s for f in fr])
            cost = np.concatenate([f.cost_usd for f in fr])
            own = np.concatenate([np.stack([np.full(len(f), f.method), np.arange(len(f))], 1)
                                  for f in fr]).reshape(-1, 2)
            order = np.lexsort((cost, lat))
            sel = order[cheaper_than_before(cost[order])]
            lats.append(lat[sel])
            costs.append(cost[sel])
            owners.append(own[sel])
        s = choose(lats, costs, self.budget())
        if s is None:
            return None
        picks = [owners[e][k] for e, k in enumerate(s.points)]
        return Solution([int(p[0]) for p in picks], [int(p[1]) for p in picks], s)

    def plan_of(self, sol: Solution) -> list[LayerChoice]:
        return [self.choice(li, a, k) for li, (a, k) in enumerate(
            zip(sol.methods, sol.points, strict=True))]

    def check_feasible(self) -> None:
        """Raise InfeasibleError when even the fastest plan misses the SLO."""
        p = self.problem
        best: list[tuple[float, int]] = []
        for li in range(p.num_moe_layers):
            opts = [(float(self.get(li, a).latency_s[0]), a) for a in METHODS
                    if len(self.get(li, a))]
            if not opts:
                raise InfeasibleError(
                    f"infeasible: no configuration holds MoE layer {p.moe_layers[li]}'s experts "
                    f"(binding: memory: {p.expert_param_bytes[li] / 2**20:.1f} MB parameters "
                    f"+ tokens per replica must fit in {max(p.memory_options_mb)} MB with at most "
                    f"{p.max_replicas} replicas)",
                    "allow more replicas (--max-replicas) or a platform with more memory",
                )
            best.append(min(opts))
        fastest = p.fixed_latency_s + sum(b[0] for b in best)
        if fastest <= p.slo_s * (1 + 1e-12):
            return
        slow = int(np.argmax([b[0] for b in best]))
        raise InfeasibleError(
            f"infeasible: the fastest plan takes {fastest:.4g} s, the SLO is {p.slo_s:.4g} s "
            f"(binding: non-MoE segments take {p.fixed_latency_s:.4g} s and MoE layers at "
            f"least {fastest - p.fixed_latency_s:.4g} s; slowest is layer "
            f"{p.moe_layers[slow]} at {best[slow][0]:.4g} s ({CODE_METHODS[best[slow][1]]}) "
            f"with up to {max(p.memory_options_mb)} MB and {p.max_replicas} replicas)",
            f"raise the SLO to at least {fastest:.4g} s, or allow more replicas",
        )


def infeasible_for(planner: str, est: Estimate, problem: PlanningProblem) -> InfeasibleError:
    """The error for a fixed-rule planner whose plan breaks a constraint."""
    return InfeasibleError(
        f"infeasible: the {planner} plan breaks {len(est.violations)} constraint(s): "
        f"{est.violations[0]}" + (f" (latency {est.latency_s:.4g} s)"
                                  if est.latency_s > problem.slo_s else ""),
        "raise the SLO or use --policy ods",
    )
