"""Seam 3, control: one controller shape and one wrapper family.

- :mod:`.base`: the generic :class:`Controller` protocol (``decide(window, state) ->
  (decision, state)``, pure) and :class:`ControlError`;
- :mod:`.scaling`: scaling controllers — :class:`MetricsSnapshot` in, function
  :class:`FunctionConfig` decisions out — and their :class:`ScalingBounds`;
- :mod:`.wrappers`: :class:`Bounded` (bounds, hysteresis, up/down delays),
  :class:`Deferred` (a start time), :class:`MemoryFloor`;
- :mod:`.replay`: :class:`Replayed`, a run's applied decisions decided again.

SALC (:mod:`moefleet.brownout.salc`) is a controller of the same shape over latency
windows. A low layer: imports only :mod:`moefleet.errors`.
"""

from moefleet.control.base import APPLY_DELAY_S, ControlError, Controller
from moefleet.control.replay import Replayed
from moefleet.control.scaling import (
    Decisions,
    FunctionConfig,
    FunctionMetrics,
    LayerMetrics,
    MetricsSnapshot,
    PolicyState,
    ScalingBounds,
    ScalingController,
    StaticPolicy,
    layer_metrics,
)
from moefleet.control.wrappers import Bounded, BoundedState, Deferred, MemoryFloor, Wrapped

__all__ = [
    "APPLY_DELAY_S",
    "Bounded",
    "BoundedState",
    "ControlError",
    "Controller",
    "Decisions",
    "Deferred",
    "FunctionConfig",
    "FunctionMetrics",
    "LayerMetrics",
    "MemoryFloor",
    "MetricsSnapshot",
    "PolicyState",
    "Replayed",
    "ScalingBounds",
    "ScalingController",
    "StaticPolicy",
    "Wrapped",
    "layer_metrics",
]
