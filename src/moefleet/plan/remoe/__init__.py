"""Remoe (GPU main function + CPU local experts + remote expert functions), the planner.

- :mod:`.problem`: ``RemoeProblem``, the fitted time law T(y), Theorem 1's bound;
- :mod:`.model`: eqs. 1-10 (``evaluate``) and LPT;
- :mod:`.solve`: MMP (Alg. 2), utility selection, the Lagrangian memory subproblem
  (Theorem 2 checked), replicas (Theorem 4, eq. 15);
- :mod:`.planner`: ``plan_policy(problem, "remoe"|"cpu"|"gpu"|"mix"|"fetch")``;
- :mod:`.shapes`: model shapes and timing for building problems from a platform;
- :mod:`.sensitivity`: which input, scaled by how much, reaches a cost ratio vs GPU-only.

The simulator of these layouts is :mod:`moefleet.sim.remoe`.
"""

from moefleet.plan.remoe.model import KINDS, Estimate, Layout, evaluate, lpt
from moefleet.plan.remoe.planner import (
    POLICIES,
    RemoeResult,
    plan_baseline,
    plan_policy,
    plan_remoe,
)
from moefleet.plan.remoe.problem import (
    RemoeError,
    RemoeProblem,
    TimeLaw,
    fit_time_law,
    theorem1_bound,
)
from moefleet.plan.remoe.solve import mmp, select_remote, solve_memory

__all__ = [
    "KINDS",
    "POLICIES",
    "Estimate",
    "Layout",
    "RemoeError",
    "RemoeProblem",
    "RemoeResult",
    "TimeLaw",
    "evaluate",
    "fit_time_law",
    "lpt",
    "mmp",
    "plan_baseline",
    "plan_policy",
    "plan_remoe",
    "select_remote",
    "solve_memory",
    "theorem1_bound",
]
