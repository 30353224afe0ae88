"""Deployment planning. ``DeploymentPlan`` is the shared plan format.

- :mod:`~moefleet.plan.problem`: ``PlanningProblem`` (what a planner is given);
- :mod:`~moefleet.plan.placement`: ``Placement`` (``plan.placement()``), the only
  derivation of function names, experts per function, memory and replicas;
- :mod:`~moefleet.plan.costmodel`: ODS/BO's analytical cost/latency model, ``evaluate``;
- planners (``Planner`` ABC): ``OdsPlanner`` (ODS Alg. 1 over exact per-method solves),
  ``MiqcpPlanner`` (problem (12) in SCIP/Gurobi), ``RandomPlanner``, ``LambdaMLPlanner``;
  ``get_planner(name)``; ``cpu_cluster_cost`` for the rented-CPU baseline.
"""

from moefleet.plan.base import LayerChoice, Planner, build_plan
from moefleet.plan.baselines import (
    ClusterEstimate,
    LambdaMLPlanner,
    RandomPlanner,
    cpu_cluster_cost,
)
from moefleet.plan.costmodel import Estimate, LayerEstimate, evaluate
from moefleet.plan.miqcp import MiqcpPlanner, solve_miqcp
from moefleet.plan.ods import OdsPlanner
from moefleet.plan.placement import PlacedFunction, Placement
from moefleet.plan.plan import (
    CODE_METHODS,
    METHOD_CODES,
    DeploymentPlan,
    ExpertConfig,
    LayerPlan,
    Method,
    PlanError,
)
from moefleet.plan.problem import InfeasibleError, PlanningProblem, candidate_memory_options
from moefleet.plan.registry import PLANNERS, get_planner, planner_names

__all__ = [
    "CODE_METHODS",
    "METHOD_CODES",
    "PLANNERS",
    "ClusterEstimate",
    "DeploymentPlan",
    "Estimate",
    "ExpertConfig",
    "InfeasibleError",
    "LambdaMLPlanner",
    "LayerChoice",
    "LayerEstimate",
    "LayerPlan",
    "Method",
    "MiqcpPlanner",
    "OdsPlanner",
    "PlacedFunction",
    "Placement",
    "PlanError",
    "Planner",
    "PlanningProblem",
    "RandomPlanner",
    "build_plan",
    "candidate_memory_options",
    "cpu_cluster_cost",
    "evaluate",
    "get_planner",
    "planner_names",
    "solve_miqcp",
]
