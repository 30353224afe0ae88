"""Engines for tests, through the composition root (``compose.in_process_engine``)."""

from __future__ import annotations

from typing import Any

from moefleet.compose import StackOptions
from moefleet.compose.root import OpenedEngine, in_process_engine
from moefleet.engine import Engine


def opened_engine(adapter: Any, *, experts: Any = None, kernel: str = "auto",
                  **options: Any) -> OpenedEngine:
    """An in-process engine; ``experts`` replaces the adapter's kernel as the stack's
    in-process experts (retries still wrap it)."""
    return in_process_engine(adapter, stack=StackOptions(kernel=kernel,  # type: ignore[arg-type]
                                                         local=experts), **options)


def build_engine(adapter: Any, *, experts: Any = None, kernel: str = "auto",
                 **options: Any) -> Engine:
    return opened_engine(adapter, experts=experts, kernel=kernel, **options).engine
