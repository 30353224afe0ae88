"""MoE model adapters, standalone experts, the model zoo.

Public API: :class:`MoEModelAdapter`, :func:`load_adapter`, :class:`ModelShape`,
:mod:`moefleet.models.zoo`.

``ModelShape`` is imported eagerly and is torch-free; everything else loads on first
use, so planning, prediction and simulation can describe a model without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from moefleet.models.shape import ModelShape

if TYPE_CHECKING:
    from moefleet.models.base import ExpertFn, ForwardContext, MoEModelAdapter
    from moefleet.models.registry import (
        load_adapter,
        register_architecture,
        supported_architectures,
    )

_LAZY = {
    "ExpertFn": "moefleet.models.base",
    "ForwardContext": "moefleet.models.base",
    "MoEModelAdapter": "moefleet.models.base",
    "load_adapter": "moefleet.models.registry",
    "register_architecture": "moefleet.models.registry",
    "supported_architectures": "moefleet.models.registry",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ExpertFn",
    "ForwardContext",
    "MoEModelAdapter",
    "ModelShape",
    "load_adapter",
    "register_architecture",
    "supported_architectures",
]
