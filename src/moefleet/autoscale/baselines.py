"""Baseline autoscaling policies from the sMoE evaluation (our reading, our code).

- :class:`HPAPolicy`: the Kubernetes horizontal pod autoscaler as OpenFaaS uses it:
  desired = ceil(current replicas x metric per replica / target), the metric being
  mean in-flight calls (``"concurrency"``) or calls per second (``"rps"``). Memory and
  concurrency stay as they are.
- :class:`ElasticMoEPolicy`: per-expert token-load scaling: desired replicas =
  ceil(token rate / (target utilisation x tokens one replica serves per second)). A
  replica's service rate is measured (tokens / busy seconds, so call overheads count)
  when the function ran in the interval, else taken from the compute profile.

Both are stateless and meant to be wrapped in :class:`~moefleet.control.Bounded`
(bounds, hysteresis, delays); :func:`make_policy` does that with sensible defaults.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Literal

from moefleet.autoscale.errors import AutoscaleError
from moefleet.control import (
    Bounded,
    Decisions,
    FunctionMetrics,
    MetricsSnapshot,
    PolicyState,
    ScalingBounds,
    ScalingController,
    StaticPolicy,
)
from moefleet.errors import UnknownNameError

POLICIES = ("static", "hpa", "elasticmoe")


class HPAPolicy(ScalingController):
    """Replicas proportional to load per replica (k8s HPA rule, no memory changes)."""

    name = "hpa"

    def __init__(self, target: float = 1.0,
                 metric: Literal["concurrency", "rps"] = "concurrency") -> None:
        if not (math.isfinite(target) and target > 0):
            raise AutoscaleError(f"HPA target must be > 0, got {target!r}")
        if metric not in ("concurrency", "rps"):
            raise AutoscaleError(f"HPA metric must be 'concurrency' or 'rps', got {metric!r}")
        self.target = target
        self.metric = metric

    def _load(self, m: FunctionMetrics) -> float:
        # Total load of the function; queued calls count as wanted concurrency.
        if self.metric == "rps":
            return m.calls_per_s
        return m.mean_concurrency + m.queued

    def decide(self, snapshot: MetricsSnapshot, state: PolicyState) -> tuple[Decisions,
                                                                             PolicyState]:
        out: Decisions = {}
        for name, m in snapshot.functions.items():
            current = m.config.replicas
            # HPA's rule ceil(current * (load/current) / target) == ceil(load / target).
            desired = max(1, math.ceil(self._load(m) / self.target - 1e-9))
            if desired != current:
                out[name] = replace(m.config, replicas=desired)
        return out, state


class ElasticMoEPolicy(ScalingController):
    """Replicas proportional to each function's token load (experts and segments)."""

    name = "elasticmoe"

    def __init__(self, target_utilisation: float = 0.7) -> None:
        if not (0 < target_utilisation <= 1):
            raise AutoscaleError(
                f"target_utilisation must be in (0, 1], got {target_utilisation!r}")
        self.target_utilisation = target_utilisation

    @staticmethod
    def service_tokens_per_s(m: FunctionMetrics) -> float:
        """Tokens one replica serves per second: measured if possible, else profiled."""
        if m.tokens > 0 and m.busy_s > 0:
            return m.tokens / m.busy_s
        return m.capacity_tokens_per_s

    def decide(self, snapshot: MetricsSnapshot, state: PolicyState) -> tuple[Decisions,
                                                                             PolicyState]:
        out: Decisions = {}
        for name, m in snapshot.functions.items():
            rate = self.service_tokens_per_s(m)
            if rate <= 0:
                continue
            need = m.tokens_per_s / (self.target_utilisation * rate)
            desired = max(1, math.ceil(need - 1e-9))
            if desired != m.config.replicas:
                out[name] = replace(m.config, replicas=desired)
        return out, state


def make_policy(
    name: str,
    bounds: ScalingBounds | None = None,
    *,
    upscale_delay_s: float = 0.0,
    downscale_delay_s: float = 60.0,
    tolerance: float = 0.1,
) -> ScalingController:
    """A policy by name (``static``, ``hpa``, ``elasticmoe``), wrapped in the shared
    bounds/hysteresis/delay rules (``static`` is returned bare: it never decides)."""
    key = name.strip().lower()
    inner: ScalingController
    if key == "static":
        return StaticPolicy()
    if key == "hpa":
        inner = HPAPolicy()
    elif key == "elasticmoe":
        inner = ElasticMoEPolicy()
    else:
        raise UnknownNameError(f"unknown autoscale policy {name!r}",
                               f"use one of: {', '.join(POLICIES)}")
    return Bounded(inner, bounds, upscale_delay_s=upscale_delay_s,
                         downscale_delay_s=downscale_delay_s, tolerance=tolerance)
