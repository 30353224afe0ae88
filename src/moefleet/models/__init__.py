"""MoE model adapters, standalone experts, the model zoo.

Public API: :class:`MoEModelAdapter`, :func:`load_adapter`, :mod:`moefleet.models.zoo`.
"""

from moefleet.models.base import ExpertFn, ForwardContext, ModelSummary, MoEModelAdapter
from moefleet.models.registry import load_adapter, register_architecture, supported_architectures

__all__ = [
    "ExpertFn",
    "ForwardContext",
    "MoEModelAdapter",
    "ModelSummary",
    "load_adapter",
    "register_architecture",
    "supported_architectures",
]
