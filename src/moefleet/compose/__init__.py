"""The composition root: the one place that turns a model, a plan (or none), an expert
stack, a backend and a store into a running engine and its biller (``open_engine``).

Heavy imports load on first use of a name, so ``import moefleet.compose`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moefleet.compose.options import Billing, EngineOptions, StackOptions
    from moefleet.compose.root import OpenedEngine, in_process_engine, open_engine

__all__ = ["Billing", "EngineOptions", "OpenedEngine", "StackOptions", "in_process_engine",
           "open_engine"]

_WHERE = {"Billing": "options", "EngineOptions": "options", "StackOptions": "options",
          "OpenedEngine": "root", "in_process_engine": "root", "open_engine": "root"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"moefleet.compose.{_WHERE[name]}"), name)
    raise AttributeError(name)
