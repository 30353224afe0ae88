"""Ready-made in-process engines (what the benchmarks compare), built by the composition
root like every other engine."""

from __future__ import annotations

from typing import Any

from moefleet.compose import StackOptions
from moefleet.compose.root import OpenedEngine, in_process_engine
from moefleet.experts.brownout_control import BrownoutSpec


def brownout_engine(adapter: Any, *, ways: int | None, threshold: float = 1.0,
                    mode: str = "partial", salc: Any = None, kernel: str = "auto",
                    united_kernel: str = "loop", wrap: Any = None, distill: Any = None,
                    **options: Any) -> OpenedEngine:
    """An in-process engine with brownout (``ways`` None: zero brownout, same kernel, so
    comparisons differ only in routing); ``salc`` sets the threshold per step."""
    spec = None if ways is None else BrownoutSpec(ways=ways, mode=mode, threshold=threshold)
    return in_process_engine(adapter, stack=StackOptions(
        kernel=kernel, brownout=spec, salc=salc, united_kernel=united_kernel,  # type: ignore[arg-type]
        wrap=wrap, distill=distill), **options)


def build_engine(adapter: Any, *, kernel: str = "auto", experts: Any = None,
                 **options: Any) -> Any:
    """A plain in-process engine (``experts``: in-process experts of one's own instead of
    the kernel; retries still wrap them)."""
    return opened_engine(adapter, kernel=kernel, experts=experts, **options).engine


def opened_engine(adapter: Any, *, kernel: str = "auto", experts: Any = None,
                  **options: Any) -> OpenedEngine:
    return in_process_engine(adapter, stack=StackOptions(
        kernel=kernel, local=experts), **options)  # type: ignore[arg-type]
