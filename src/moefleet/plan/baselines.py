"""Baselines of the ODS/BO evaluation: random method choice, LambdaML, the CPU cluster.

- ``RandomPlanner``: each MoE layer draws its method uniformly (seeded); memory, replicas
  and β are then optimised for that method vector (the paper's "random selection" of the
  communication method); redraws up to ``tries`` times when a draw cannot meet the SLO.
- ``LambdaMLPlanner``: every expert function gets the platform's baseline memory
  (``PlatformSpec.baseline_memory()``, 3008 MB on aws-lambda-2020), one replica, and no
  prediction: each layer is sized for the worst case, all ``tokens`` of the batch going to
  one expert, so a layer uses direct invocation when that payload fits the limit and
  object storage (a=2) otherwise. Its cost is then evaluated on the problem's counts.
- :func:`cpu_cluster_cost`: the same batch on a rented CPU server (``cpu-cluster``),
  billed per started hour with idle time included; time from the compute profile with
  every expert of a layer running concurrently on cores / experts cores (at least one).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from moefleet.errors import MoefleetError
from moefleet.plan.base import (
    METHODS,
    Frontiers,
    LayerChoice,
    Planner,
    build_plan,
    infeasible_for,
)
from moefleet.plan.costmodel import direct_fits
from moefleet.plan.frontier import ExpertChoice
from moefleet.plan.plan import DeploymentPlan
from moefleet.plan.problem import InfeasibleError, PlanningProblem
from moefleet.platform.billing import bill_cluster
from moefleet.platform.specs import PlatformSpec
from moefleet.profiles.model import ComputeProfile


class RandomPlanner(Planner):
    """Random method per layer, the rest optimised (deterministic for a seed)."""

    name = "random"

    def __init__(self, tries: int = 20) -> None:
        self.tries = tries

    def plan(self, problem: PlanningProblem, seed: int = 0) -> DeploymentPlan:
        t0 = time.perf_counter()
        fr = Frontiers(problem)
        fr.check_feasible()
        rng = np.random.default_rng(seed)
        for attempt in range(1, self.tries + 1):
            vector = rng.choice(np.array(METHODS), size=problem.num_moe_layers)
            sol = fr.solve([[int(a)] for a in vector])
            if sol is not None:
                meta = {"algorithm": "random", "seed": seed, "draws": attempt,
                        "methods": [int(a) for a in vector]}
                plan, _ = build_plan(problem, fr.plan_of(sol), self.name, meta, t0)
                return plan
        raise InfeasibleError(
            f"infeasible: {self.tries} random method draws (seed {seed}) all miss the SLO",
            "raise the SLO, try another --seed, or use --policy ods",
        )


class LambdaMLPlanner(Planner):
    """Fixed baseline memory, no replicas, worst-case sizing (no prediction)."""

    name = "lambdaml"

    def plan(self, problem: PlanningProblem, seed: int = 0) -> DeploymentPlan:
        t0 = time.perf_counter()
        Frontiers(problem).check_feasible()  # the same message as every planner
        mem = problem.platform.baseline_memory()
        worst = problem.tokens * max(problem.bytes_in, problem.bytes_out)
        method = 3 if direct_fits(problem, problem.tokens) else 2
        layers = [
            LayerChoice(method, 1, [ExpertChoice(mem, 1)] * e) for e in problem.num_experts
        ]
        meta = {"algorithm": "lambdaml", "memory_mb": mem, "method": method,
                "worst_case_payload_bytes": worst}
        plan, est = build_plan(problem, layers, self.name, meta, t0)
        if not est.feasible:
            raise infeasible_for("LambdaML", est, problem)
        return plan


@dataclass(frozen=True)
class ClusterEstimate:
    """One batch on a rented cluster (seconds, USD)."""

    platform: str
    wall_s: float  # whole model: segments + MoE layers
    moe_s: float  # MoE layers only
    billed_s: float
    cost_usd: float  # as billed: started hours, idle included (bill_cluster)
    moe_prorated_usd: float  # MoE seconds x hourly price / 3600: a fully busy server

    def to_dict(self) -> dict[str, float | str]:
        return asdict(self)


def cpu_cluster_cost(
    problem: PlanningProblem, profile: ComputeProfile, cluster: PlatformSpec
) -> ClusterEstimate:
    """What the problem's batch costs on ``cluster`` (a ``kind: cluster`` spec)."""
    hourly = cluster.hourly
    if hourly is None:
        raise MoefleetError(
            f"platform '{cluster.name}' is not a rented cluster", "use e.g. 'cpu-cluster'"
        )
    cores = float(hourly.cores)
    moe_s = 0.0
    for li, layer in enumerate(problem.moe_layers):
        d = problem.counts(li)
        v = max(1.0, cores / len(d))  # all experts of the layer at once, cores shared
        moe_s += max(profile.expert_time_s(layer, int(n), v) for n in d)
    seg_s = sum(profile.segment_time_s(b, problem.tokens, cores)
                for b in range(problem.num_blocks))
    wall = moe_s + seg_s
    bill = bill_cluster(cluster, wall_s=wall)
    return ClusterEstimate(
        platform=cluster.name,
        wall_s=wall,
        moe_s=moe_s,
        billed_s=bill.billed_s,
        cost_usd=bill.cost,
        moe_prorated_usd=moe_s / 3600.0 * hourly.price_per_hour,
    )
