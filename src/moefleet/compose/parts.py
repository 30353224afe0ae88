"""The pieces :mod:`moefleet.compose.root` puts together: the model's device, the brownout
piece and its SALC hook, the plan check, and a deployed plan's runner, stack and biller."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from moefleet.compose.billing import Attributed, InvocationBiller, MainPricing
from moefleet.compose.options import EngineOptions, StackOptions
from moefleet.engine.build import resolve_device
from moefleet.engine.engine import StepHook
from moefleet.engine.runner import InProcessRunner, ModelRunner
from moefleet.errors import MoefleetError
from moefleet.experts.brownout import BrownoutExperts
from moefleet.experts.nest import compose
from moefleet.experts.remote import RemoteExperts
from moefleet.experts.split import held_experts
from moefleet.experts.stack import ExpertStack, find
from moefleet.models.base import MoEModelAdapter
from moefleet.plan import DeploymentPlan
from moefleet.platform import ObjectStore, PlatformSpec
from moefleet.runtime.base import FunctionBackend
from moefleet.runtime.deploy import MAIN_KV_MB, Deployment
from moefleet.runtime.faults import FaultPlan, FaultyBackend
from moefleet.runtime.handlers import MB
from moefleet.runtime.lifecycle import deployed_backend
from moefleet.runtime.segments import SegmentRunner

BrownoutPiece = tuple[Any, float, str, str]


class PlanModelError(MoefleetError):
    """The plan was made for a different model than the one being served."""


def runner_sizes(options: EngineOptions) -> dict[str, Any]:
    """What an in-process runner needs from the options to size its KV cache and choose
    how attention reads it."""
    return {"gpu_memory_utilization": options.gpu_memory_utilization,
            "max_num_batched_tokens": options.max_num_batched_tokens,
            "attention": options.attention}


def move_model(adapter: MoEModelAdapter, device: str) -> torch.device:
    """Put ``adapter``'s model on ``device`` (``auto``: CUDA where torch sees a GPU)."""
    dev = resolve_device(device)
    if dev.type != "cpu":
        adapter.model.to(dev)
    return dev


def brownout_piece(adapter: MoEModelAdapter, stack: StackOptions, device: torch.device,
                   notes: list[str]) -> BrownoutPiece | None:
    """``compose``'s brownout argument for ``stack.brownout``: united experts distilled for
    ``adapter`` (partial brownout; cached) or a grouping (full brownout), on ``device``."""
    spec = stack.brownout
    if spec is None:
        return None
    from moefleet.brownout.distill import DistillConfig, distill
    from moefleet.brownout.groups import Grouping, index_groups

    groups: Any
    if spec.mode == "full":  # drops rare experts' pairs: nothing to distill
        groups = Grouping(spec.ways, "index", {
            layer: index_groups(adapter.num_experts(layer), spec.ways)
            for layer in adapter.moe_layers})
    else:
        groups = distill(adapter, spec.ways, "index", stack.distill or DistillConfig(),
                         progress=stack.distill_progress)
        for mods in groups.modules.values():
            for m in mods:
                m.to(device)
    how = "SALC" if spec.controlled or stack.salc else f"threshold {spec.threshold:g}"
    notes.append(f"brownout: {spec.ways}-way united experts, {spec.mode}, {how}")
    return groups, spec.threshold, spec.mode, stack.united_kernel


def salc_hooks(pieces: ExpertStack, stack: StackOptions) -> list[StepHook]:
    """SALC as a step hook over the stack's brownout router (when SLOs were given)."""
    spec = stack.brownout
    router = find(pieces, BrownoutExperts)
    if spec is None or router is None or not (spec.controlled or stack.salc is not None):
        return []
    from moefleet.experts.brownout_hook import SALCHook

    return [SALCHook(stack.salc or spec.salc(), router)]


def _same_model(a: str, b: str) -> bool:
    if a == b:
        return True
    pa, pb = os.path.expanduser(a), os.path.expanduser(b)
    return os.path.isdir(pa) and os.path.isdir(pb) and os.path.samefile(pa, pb)


def check_plan_model(plan: DeploymentPlan, adapter: MoEModelAdapter, model_ref: str) -> None:
    """Refuse a plan for another model: it names ``plan.model``, which must be what is
    loaded (``model_ref`` as given, or the adapter's own name)."""
    if _same_model(plan.model, model_ref) or plan.model == adapter.name:
        return
    raise PlanModelError(
        f"the plan is for model {plan.model!r}, but the model loaded is {model_ref!r}",
        f"use --model {plan.model}, or make a plan for {model_ref} "
        f"(moefleet plan --model {model_ref} ...)")


def split_faults(faults: FaultPlan | None, has_functions: bool
                 ) -> tuple[FaultPlan | None, FaultPlan | None]:
    """(at the backend, at the expert seam): a fault a backend can suffer goes to the
    backend when there are functions; the rest (stall, error) to the seam."""
    if faults is None or faults.kind == "none":
        return None, None
    if has_functions and faults.hits_backend:
        return faults, None
    return None, faults


@dataclass
class DeployedParts:
    runner: ModelRunner
    stack: ExpertStack
    biller: InvocationBiller
    deployment: Deployment
    backend: FunctionBackend
    device: str
    notes: list[str] = field(default_factory=list)
    spawn: Callable[[], DeployedParts] | None = None  # more parts over the same functions


@contextlib.contextmanager
def deployed_parts(adapter: MoEModelAdapter, plan: DeploymentPlan | Deployment,
                   spec: PlatformSpec,
                   store: ObjectStore, stack: StackOptions, options: EngineOptions, *,
                   backend: str | FunctionBackend, backend_options: Mapping[str, Any] | None,
                   audit: bool) -> Iterator[DeployedParts]:
    """Deploy ``plan`` and build the runner, stack and biller over it (the root's docstring
    says which); tear down on exit."""
    if not spec.is_faas:
        raise MoefleetError(f"platform {spec.name!r} in the plan is a {spec.kind}, not a "
                            "function platform", "plan for a FaaS platform, e.g. aws-lambda")
    remoe = (plan.plan if isinstance(plan, Deployment) else plan).main is not None
    segments = options.runner == "segments"
    if remoe and segments:
        raise MoefleetError("a Remoe plan has no segment functions: its non-experts run in "
                            "the main function", "use the in-process runner (the default)")
    at_backend, at_seam = split_faults(stack.faults, True)
    notes: list[str] = []
    if stack.faults is not None and stack.faults.kind != "none":
        where = "backend" if at_backend is not None else "expert seam"
        notes.append(f"faults: {stack.faults.kind} at {stack.faults.rate:.0%} of calls, at "
                     f"the {where} (" + ("real worker kills" if stack.faults.kind == "crash"
                                         and _name(backend) == "local" else "emulated")
                     + ")")
    wrap = (lambda fb: FaultyBackend(fb, at_backend)) if at_backend is not None else None
    kinds = {"expert", "segment"} if segments else {"expert"}
    with deployed_backend(plan, platform=spec, store=store, adapter=adapter, backend=backend,
                          backend_options=backend_options, kinds=kinds, wrap=wrap) as (dep, fb):
        made: list[DeployedParts] = []

        def build() -> DeployedParts:
            rx = RemoteExperts(dep, fb, store, max_parallel=stack.max_parallel)
            try:
                make = _main_parts if remoe else _expert_parts
                parts = make(adapter, dep, fb, store, spec, stack, options, rx, at_seam,
                             notes, audit)
            except BaseException:
                rx.close()
                raise
            parts.spawn = build
            made.append(parts)
            return parts

        try:
            yield build()
        finally:
            for parts in made:
                parts.stack.close()
                if isinstance(parts.runner, SegmentRunner):
                    parts.runner.close()


def _name(backend: str | FunctionBackend) -> str:
    return backend if isinstance(backend, str) else backend.name


def _expert_parts(adapter: MoEModelAdapter, dep: Deployment, fb: FunctionBackend,
                  store: ObjectStore, spec: PlatformSpec, stack: StackOptions,
                  options: EngineOptions, rx: RemoteExperts, at_seam: FaultPlan | None,
                  notes: list[str], audit: bool) -> DeployedParts:
    """ODS/BO: non-experts here (or in segment functions), every routed expert remote."""
    device = move_model(adapter, options.device)
    pieces = compose(remote=rx, brownout=brownout_piece(adapter, stack, device, notes),
                     faults=at_seam, retry=stack.retry, wrap=stack.wrap)
    runner: ModelRunner
    sources: list[Attributed] = [rx]
    if options.runner == "segments":
        context = int(getattr(getattr(adapter.model, "config", None),
                              "max_position_embeddings", 512) or 512)
        seg = SegmentRunner(dep, fb, store, experts=pieces, staged=rx,
                            vocab_size=adapter.vocab_size,
                            max_model_len=min(options.max_model_len or context, context))
        runner, sources = seg, [seg, rx]
        notes.append("segment functions: prompts only (no KV cache)")
    else:
        seam = None
        if options.play_segments:
            from moefleet.compose.played_segments import SeamClock

            seam = SeamClock()
        runner = InProcessRunner(adapter, experts=seam.wrap(pieces) if seam else pieces,
                                 kv_budget_bytes=options.kv_budget_bytes,
                                 block_size=options.block_size,
                                 max_num_seqs=options.max_num_seqs,
                                 max_model_len=options.max_model_len,
                             **runner_sizes(options))
        if seam is not None:
            runner = _played(runner, dep, fb, spec, notes, seam)
            sources = [runner, rx]  # type: ignore[list-item]
    biller = InvocationBiller(sources, spec, audit=audit)
    return DeployedParts(runner, pieces, biller, dep, fb, str(device), notes)


def _played(runner: ModelRunner, dep: Deployment, fb: FunctionBackend, spec: PlatformSpec,
            notes: list[str], seam: Any) -> ModelRunner:
    """``runner`` playing the plan's segment functions (:mod:`.played_segments`)."""
    from moefleet.compose.played_segments import PlayedSegment, SegmentPlayedRunner

    moe = {lp.layer for lp in dep.plan.layers}
    played = [PlayedSegment(dep.function(f.name), f.memory_mb, int(f.layer or 0),
                            f.layer in moe) for f in dep.placement.segments]
    startup = getattr(fb, "startup_emulation", None)
    held = SegmentPlayedRunner(runner, played, spec, startup=startup, seam=seam)
    notes.append(f"emulated: this process plays the {len(played)} segment functions (held "
                 f"to {held.vcpus:.3g} vCPU, each step billed as their invocations"
                 + (", the platform's startup on each" if startup is not None else "") + ")")
    return held


def _main_parts(adapter: MoEModelAdapter, dep: Deployment, fb: FunctionBackend,
                store: ObjectStore, spec: PlatformSpec, stack: StackOptions,
                options: EngineOptions, rx: RemoteExperts, at_seam: FaultPlan | None,
                notes: list[str], audit: bool) -> DeployedParts:
    """Remoe: this process plays the main function (what a main instance loads)."""
    from moefleet.runtime.main_model import GPU_EMULATED, MainModel, gpu_share, main_device

    if options.play_segments:
        raise MoefleetError("play_segments: a Remoe plan has no segment functions (its "
                            "main is held with hold_main_share)",
                            "set play_segments only for plans with segment functions")
    main_plan = dep.plan.main
    placed = dep.placement.main
    assert main_plan is not None and placed is not None  # a Remoe plan has both
    main_device(main_plan.gpu_gb, options.device)  # a device this plan cannot use fails here
    name = dep.function(placed.name)
    share = gpu_share(dep, spec)
    main = MainModel.load(dep, store, name, device=options.device)
    kv_bytes = options.kv_budget_bytes or MAIN_KV_MB * MB
    main.check_memory(placed.memory_mb, kv_bytes, name)
    pieces = compose(held_experts(main.local), remote=rx, is_local=main.is_local,
                     brownout=brownout_piece(adapter, stack, main.device, notes),
                     faults=at_seam, retry=stack.retry, wrap=stack.wrap)
    runner: ModelRunner = InProcessRunner(
        main.adapter, experts=pieces, kv_budget_bytes=kv_bytes, block_size=options.block_size,
        max_num_seqs=options.max_num_seqs, max_model_len=options.max_model_len,
        **runner_sizes(options))
    if main.gpu == GPU_EMULATED:
        notes.append("GPU emulated: the main function's GPU price applied to CPU time")
    vcpus = spec.vcpus(placed.memory_mb)
    if options.hold_main_share and main.gpu == "none" and vcpus < 1:
        from moefleet.compose.held_share import ShareHeldRunner

        runner = ShareHeldRunner(runner, vcpus)
        notes.append(f"emulated: the main held to {vcpus:.3g} vCPU (its forward stretched "
                     "to cpu_s / vcpus)")
    biller = InvocationBiller([rx], spec, audit=audit,
                              main=MainPricing(name, placed.memory_mb, share, main.gpu))
    return DeployedParts(runner, pieces, biller, dep, fb, str(main.device), notes)
