"""Planner names for the CLI and configs: ``get_planner("ods")``."""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable
from typing import Any

from moefleet.errors import UnknownNameError
from moefleet.plan.base import Planner
from moefleet.plan.baselines import LambdaMLPlanner, RandomPlanner
from moefleet.plan.miqcp import MiqcpPlanner
from moefleet.plan.ods import OdsPlanner

PLANNERS: dict[str, Callable[..., Planner]] = {
    "ods": OdsPlanner,
    "ods-paper": functools.partial(OdsPlanner, polish=False, refine=False),
    "miqcp": MiqcpPlanner,
    "random": RandomPlanner,
    "lambdaml": LambdaMLPlanner,
}


def planner_names() -> list[str]:
    return list(PLANNERS)


def get_planner(name: str, time_limit_s: float | None = None, **options: Any) -> Planner:
    """A planner by name; ``time_limit_s`` goes to the solvers that take one."""
    if name not in PLANNERS:
        close = difflib.get_close_matches(name, PLANNERS, n=1)
        raise UnknownNameError(
            f"unknown planning policy '{name}'",
            (f"did you mean '{close[0]}'? " if close else "")
            + f"known policies: {', '.join(PLANNERS)}",
        )
    cls = PLANNERS[name]
    if time_limit_s is not None and name in ("ods", "ods-paper", "miqcp"):
        options["time_limit_s"] = time_limit_s
    return cls(**options)
