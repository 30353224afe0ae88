"""Deployment planning. ``DeploymentPlan`` is the shared plan format."""

from moefleet.plan.plan import (
    CODE_METHODS,
    METHOD_CODES,
    DeploymentPlan,
    ExpertConfig,
    LayerPlan,
    Method,
    PlanError,
    expert_function,
    segment_function,
)

__all__ = [
    "CODE_METHODS",
    "METHOD_CODES",
    "DeploymentPlan",
    "ExpertConfig",
    "LayerPlan",
    "Method",
    "PlanError",
    "expert_function",
    "segment_function",
]
