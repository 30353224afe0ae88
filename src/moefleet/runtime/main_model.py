"""What a Remoe main function holds, loaded once per instance: the model's non-expert
modules, its local experts and which experts are local, on the main function's device.

Both players of the main function use it: the ``main`` handler (one function instance,
:mod:`.handler`) and ``moefleet serve --plan`` of a Remoe plan, where the serving process
itself is the main function (:mod:`moefleet.serve.deployed`). Both load from the object
store what deploy uploaded, so the server holds exactly what a main instance would.

Device (:func:`main_device`): the non-expert modules and the KV cache go on CUDA when the
plan gives the main function a GPU and torch sees one (``auto``); the local experts stay
in host memory, as the plan sizes them in the main function's CPU memory, and
:class:`~moefleet.experts.split.SplitExperts` moves each layer's token rows to the CPU
before the split and the sum back. Otherwise everything runs on the CPU and the plan's
GPU price is applied to the measured time: "GPU emulated".

Invariants: every expert no group of the plan holds is in ``local`` (and only those);
``is_local[layer]`` is a bool [E] on the CPU; remote experts' weights are never loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moefleet.errors import MoefleetError
from moefleet.models.base import MoEModelAdapter
from moefleet.platform import PlatformSpec
from moefleet.runtime import weights
from moefleet.runtime.deploy import Deployment
from moefleet.runtime.errors import FunctionError
from moefleet.runtime.handlers import MB

DEVICES = ("auto", "cpu", "cuda")
GPU_EMULATED = "emulated"  # the usage/metrics label of a GPU price on CPU time


class DeviceError(MoefleetError):
    """A device the main function cannot run on here."""


def main_device(gpu_gb: float, requested: str = "auto") -> torch.device:
    """Where the main function's non-expert modules run. ``auto``: CUDA when the plan
    gives the main function a GPU (``gpu_gb`` > 0) and torch sees one, else the CPU;
    ``cpu``; ``cuda`` / ``cuda:N``: refused without a GPU here or in the plan."""
    req = str(requested).strip().lower()
    if req == "cpu" or (req == "auto" and (gpu_gb <= 0 or not torch.cuda.is_available())):
        return torch.device("cpu")
    if req == "auto":
        return torch.device("cuda")
    if req != "cuda" and not (req.startswith("cuda:") and req[5:].isdigit()):
        raise DeviceError(f"unknown device {requested!r}", "use auto, cpu, cuda or cuda:N")
    if gpu_gb <= 0:
        raise DeviceError(f"device {requested!r} requested, but the plan's main function has "
                          "no GPU (main.gpu_gb = 0)", "use --device cpu (or auto), or plan "
                          "a main function with a GPU (e.g. --policy remoe on alibaba-fc-gpu)")
    if not torch.cuda.is_available():
        raise DeviceError(f"device {requested!r} requested, but torch sees no CUDA GPU here",
                          "use --device auto or cpu (the GPU is then emulated: its price on "
                          "CPU time), or run on a machine with a GPU and a CUDA build of torch")
    return torch.device(req)


def gpu_label(gpu_gb: float, device: torch.device) -> str:
    """``none`` (a CPU main function), ``emulated`` (a GPU plan run on the CPU) or the
    CUDA device the non-experts ran on."""
    if gpu_gb <= 0:
        return "none"
    return GPU_EMULATED if device.type == "cpu" else str(device)


def place_non_experts(adapter: MoEModelAdapter, device: torch.device) -> None:
    """Move every non-expert tensor (each block's segment and the unowned ones, e.g.
    rotary tables) to ``device``; routed experts stay where they are. Tied tensors stay
    tied (every name of a tensor gets the one moved copy)."""
    if device.type == "cpu":
        return
    names = weights.names_by_tensor(adapter.model)
    picked = {id(t): t for b in range(adapter.num_layers)
              for t in weights.tensors_of(adapter.segment(b))}
    picked.update({id(t): t for t in weights.shared_tensors(adapter)})
    for key, t in picked.items():
        moved = t.detach().to(device)
        weights.assign_tensors(adapter.model, {n: moved for n in names.get(key, [])})


def _get(store: Any, key: str, function: str) -> bytes:
    from moefleet.platform import ObjectNotFoundError

    try:
        return bytes(store.get(key))
    except ObjectNotFoundError:
        raise FunctionError(f"{function}: object {key!r} is missing from {store.url}",
                            "deploy the plan again (its weights are uploaded then)") from None


@dataclass
class MainModel:
    """See the module docstring."""

    dep: Deployment
    adapter: MoEModelAdapter
    local: dict[int, dict[int, nn.Module]]
    is_local: dict[int, torch.Tensor]
    weight_bytes: int
    device: torch.device

    @classmethod
    def from_store(cls, key: str, store: Any, function: str, *,
                   device: str = "auto") -> MainModel:
        """:meth:`load` of the deployment JSON at ``key`` (what a main instance gets)."""
        dep = Deployment.from_dict(json.loads(_get(store, key, function)), key)
        return cls.load(dep, store, function, device=device)

    @classmethod
    def load(cls, dep: Deployment, store: Any, function: str, *,
             device: str = "auto") -> MainModel:
        """Build the model skeleton, load every block's non-expert weights and the local
        experts from ``store``, and place the non-experts on :func:`main_device`."""
        main = dep.plan.main
        dev = main_device(main.gpu_gb if main is not None else 0.0, device)
        layout = dep.layout
        adapter = weights.build_skeleton(_get(store, layout.skeleton, function))
        nbytes = 0
        for block in range(adapter.num_layers):
            tensors = weights.from_bytes(_get(store, layout.segments[block], function))
            nbytes += weights.module_bytes(tensors)
            weights.assign_tensors(adapter.model, tensors)
        local: dict[int, dict[int, nn.Module]] = {}
        is_local: dict[int, torch.Tensor] = {}
        for layer in dep.moe_layers:
            held = dep.plan.main_expert_ids(layer)
            keep_E = torch.zeros(adapter.num_experts(layer), dtype=torch.bool)
            keep_E[held] = True
            is_local[layer] = keep_E
            local[layer] = {}
            for e in held:
                tensors = weights.from_bytes(_get(store, layout.expert_key(layer, e), function))
                nbytes += weights.module_bytes(tensors)
                local[layer][e] = weights.load_expert(adapter, layer, e, tensors)
        place_non_experts(adapter, dev)
        return cls(dep, adapter, local, is_local, nbytes, dev)

    @property
    def has_remote(self) -> bool:
        return any(not bool(k.all()) for k in self.is_local.values())

    @property
    def gpu(self) -> str:
        main = self.dep.plan.main
        return gpu_label(main.gpu_gb if main is not None else 0.0, self.device)

    def check_memory(self, memory_mb: int, kv_bytes: int, function: str) -> None:
        """The weights plus the KV cache must fit the main function's ``memory_mb``."""
        if self.weight_bytes + kv_bytes > memory_mb * MB:
            raise FunctionError(
                f"{function}: non-expert and local-expert weights "
                f"({self.weight_bytes / MB:.1f} MB) plus the KV cache ({kv_bytes / MB:.0f} MB)"
                f" exceed memory_mb={memory_mb}", "give the main function more memory in "
                "the plan")


def gpu_share(dep: Deployment, platform: PlatformSpec) -> float:
    """The main function's share of the platform GPU (0 for a CPU main function)."""
    main = dep.plan.main
    if main is None or main.gpu_gb <= 0:
        return 0.0
    if platform.gpu is None:
        raise MoefleetError(f"the plan's main function asks for {main.gpu_gb:g} GB of GPU, "
                            f"but platform '{platform.name}' has no GPU functions",
                            "re-plan for a GPU platform, e.g. alibaba-fc-gpu")
    slices = -(-main.gpu_gb // platform.gpu.slice_gb)  # whole slices, rounded up
    return platform.check_gpu_share(min(1.0, slices * platform.gpu.slice_gb
                                        / platform.gpu.memory_gb))
