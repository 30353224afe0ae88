"""Autoscaling: the policy interface (``base``) and baseline policies (``baselines``).

Policies are pure functions of a metrics snapshot; the simulator (``moefleet.sim``) and
the runtime apply their decisions. The sMoE RL policy implements the same interface.
"""

from moefleet.autoscale.base import (
    AutoscaleError,
    AutoscalePolicy,
    BoundedPolicy,
    Controller,
    Decisions,
    FunctionConfig,
    FunctionMetrics,
    LayerMetrics,
    MetricsSnapshot,
    PolicyState,
    ScalingBounds,
    StaticPolicy,
)
from moefleet.autoscale.baselines import POLICIES, ElasticMoEPolicy, HPAPolicy, make_policy

__all__ = [
    "POLICIES",
    "AutoscaleError",
    "AutoscalePolicy",
    "BoundedPolicy",
    "Controller",
    "Decisions",
    "ElasticMoEPolicy",
    "FunctionConfig",
    "FunctionMetrics",
    "HPAPolicy",
    "LayerMetrics",
    "MetricsSnapshot",
    "PolicyState",
    "ScalingBounds",
    "StaticPolicy",
    "make_policy",
]
