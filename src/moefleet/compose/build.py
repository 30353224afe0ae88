"""Building engines (transitional: the composition root, ``open_engine``, replaces these).

BrownoutServe inside the engine: one call from a model to a brownout engine.

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

from moefleet.brownout.distill import DistillConfig, distill
from moefleet.brownout.groups import Grouping, index_groups
from moefleet.brownout.salc import SALC
from moefleet.brownout.united import UnitedExperts
from moefleet.engine import Engine
from moefleet.engine.build import check_engine_args, resolve_device
from moefleet.engine.runner import LocalRunner
from moefleet.experts.brownout import BrownoutExperts
from moefleet.experts.brownout_control import BrownoutControl
from moefleet.experts.brownout_hook import SALCHook
from moefleet.experts.kernels import Kernel, in_process_experts
from moefleet.experts.retry import RetryingExperts
from moefleet.models.base import ExpertFn, MoEModelAdapter
from moefleet.runtime.retry import POLICIES


def build_engine(adapter: MoEModelAdapter, *, device: str = "cpu", kernel: Kernel = "auto",
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 kv_budget_bytes: int | None = None, experts: ExpertFn | None = None,
                 **engine_kw: Any) -> Engine:
    """An engine over ``adapter``: experts in process with ``kernel``, or through
    ``experts`` (any ExpertFn: brownout routing, remote functions ...)."""
    dev = check_engine_args(device, max_num_seqs, max_num_batched_tokens)
    if dev.type != "cpu":
        adapter.model.to(dev)
    stack = RetryingExperts(experts or in_process_experts(adapter, kernel), POLICIES["engine"])
    runner = LocalRunner(adapter, experts=stack,
                         kv_budget_bytes=kv_budget_bytes, max_num_seqs=max_num_seqs)
    return Engine(runner, tokenizer=adapter.tokenizer, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=max_num_batched_tokens, **engine_kw)


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
    inner = in_process_experts(adapter, kernel)
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

