"""BrownoutServe inside the engine: one call from a model to a brownout engine.

    engine, experts, hook = brownout_engine(adapter, ways=8, threshold=0.4)
    engine, experts, hook = brownout_engine(adapter, ways=8, salc=SALC(0.5, 0.1))

``wrap`` (optional) wraps the ExpertFn the engine calls, e.g. to time the expert path.
``united_kernel`` (``loop`` | ``stacked``) is how the united experts run (routing.py).
``ways=None`` gives the plain engine (zero brownout) with the same kernel, so
comparisons differ only in routing. United experts come from the distillation cache
(distilled on first use, then loaded).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moefleet.brownout.control import BrownoutControl
from moefleet.brownout.distill import DistillConfig, distill
from moefleet.brownout.hook import SALCHook
from moefleet.brownout.routing import BrownoutExperts, Grouping, index_groups
from moefleet.brownout.salc import SALC
from moefleet.brownout.united import UnitedExperts
from moefleet.engine import Engine
from moefleet.engine.build import build_engine, resolve_device
from moefleet.models.base import ExpertFn, MoEModelAdapter
from moefleet.models.local_experts import Kernel, local_experts


def brownout_engine(adapter: MoEModelAdapter, *, ways: int | None, grouping: str = "index",
                    threshold: float = 1.0, mode: str = "partial", salc: SALC | None = None,
                    kernel: Kernel = "auto", distill_config: DistillConfig | None = None,
                    wrap: Callable[[ExpertFn], ExpertFn] | None = None, device: str = "cpu",
                    united_kernel: str = "loop", **engine_kw: Any
                    ) -> tuple[Engine, BrownoutExperts | None, SALCHook | None]:
    # The model moves first: the stacked kernel stacks the expert weights where they
    # are, and united experts are built as copies of the model's (device included).
    dev = resolve_device(device)
    if dev.type != "cpu":
        adapter.model.to(dev)
    engine_kw["device"] = device
    inner = local_experts(adapter, kernel)
    outer = wrap or (lambda fn: fn)  # e.g. a profiler around whatever the engine calls
    if ways is None:
        return build_engine(adapter, experts=outer(inner), **engine_kw), None, None
    if mode == "full":  # drops rare experts' pairs: groups are not used, nothing to distill
        groups: Grouping | UnitedExperts = Grouping(
            ways, "index", {layer: index_groups(adapter.num_experts(layer), ways)
                            for layer in adapter.moe_layers})
    else:
        groups = distill(adapter, ways, grouping, distill_config or DistillConfig())
    # united_kernel "loop" by default: on an H100 the stacked united experts measured no
    # faster (README, "Measured on a real GPU"); a handful of groups is few launches.
    experts = BrownoutExperts(inner, groups, threshold, mode, united_kernel=united_kernel)
    hook = SALCHook(BrownoutControl(salc, experts)) if salc is not None else None
    engine = build_engine(adapter, experts=outer(experts), hooks=[hook] if hook else None,
                          **engine_kw)
    return engine, experts, hook

