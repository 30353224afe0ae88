"""Model weights as per-function safetensors objects, and weight-free model skeletons.

At deploy time :func:`upload_model` writes, under ``<prefix>/model/``:

    skeleton.json            how to rebuild the model's *structure* (no weights)
    seg-<block>.safetensors  every tensor segment(block) uses, by model-relative name
    exp-<l>-<i>.safetensors  expert (l, i)'s standalone module state

A function instance (cold start) builds the skeleton on PyTorch's ``meta`` device (no
memory), then assigns only its own tensors into it, so a segment function holds one block
and an expert function one expert. Invariant: the tensors a segment function receives are
exactly those reachable from ``adapter.segment(block)`` plus the model tensors no segment or
expert owns (e.g. rotary-embedding buffers; small for every supported adapter).

Skeleton builders are registered per adapter class (:func:`register_skeleton`); the
Hugging Face adapter is built in. Shape legend: as in :mod:`moefleet.models.base`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from moefleet.errors import UnsupportedModelError
from moefleet.models.base import MoEModelAdapter
from moefleet.platform import ObjectStore

SKELETON_FORMAT = 1
Exporter = Callable[[MoEModelAdapter], dict[str, Any]]
Builder = Callable[[dict[str, Any]], MoEModelAdapter]
_EXPORTERS: dict[str, tuple[str, Exporter]] = {}  # adapter class name -> (kind, exporter)
_BUILDERS: dict[str, Builder] = {}  # kind -> builder


def register_skeleton(adapter_class: str, kind: str, export: Exporter, build: Builder) -> None:
    """Teach the runtime to rebuild adapters of ``adapter_class`` without weights."""
    if adapter_class in _EXPORTERS or kind in _BUILDERS:
        raise ValueError(f"skeleton for {adapter_class!r} / kind {kind!r} already registered")
    _EXPORTERS[adapter_class] = (kind, export)
    _BUILDERS[kind] = build


def _hf_export(adapter: MoEModelAdapter) -> dict[str, Any]:
    config: Any = getattr(adapter, "config")  # noqa: B009 - HF adapters only
    return {"config": config.to_dict(), "attn": config._attn_implementation}


def _hf_build(spec: dict[str, Any]) -> MoEModelAdapter:
    from transformers import AutoConfig, AutoModelForCausalLM

    from moefleet.models.hf import HFMoEAdapter

    config = dict(spec["config"])
    cfg = AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=spec["attn"])
    return HFMoEAdapter(model.eval(), None, name=spec.get("name", ""))


def _bert_export(adapter: MoEModelAdapter) -> dict[str, Any]:
    model: Any = adapter.model
    return {"config": model.config.to_json()}


def _bert_build(spec: dict[str, Any]) -> MoEModelAdapter:
    from moefleet.models.moefy.adapter import BertMoEAdapter
    from moefleet.models.moefy.model import BertMoEConfig, BertMoEModel

    with torch.device("meta"):
        model = BertMoEModel(BertMoEConfig.from_json(spec["config"]))
    return BertMoEAdapter(model, None, name=spec.get("name", ""))


register_skeleton("HFMoEAdapter", "hf", _hf_export, _hf_build)
register_skeleton("BertMoEAdapter", "bert_moe", _bert_export, _bert_build)


def skeleton_json(adapter: MoEModelAdapter) -> bytes:
    cls = type(adapter).__name__
    if cls not in _EXPORTERS:
        raise UnsupportedModelError(
            f"the runtime cannot split {cls} models into functions yet",
            f"supported adapters: {', '.join(sorted(_EXPORTERS))} "
            "(add one with moefleet.runtime.weights.register_skeleton)",
        )
    kind, export = _EXPORTERS[cls]
    doc = {"format": SKELETON_FORMAT, "kind": kind, "name": adapter.name, **export(adapter)}
    return json.dumps(doc).encode()


def build_skeleton(blob: bytes) -> MoEModelAdapter:
    """The adapter with every tensor on the meta device (allocates no weight memory)."""
    doc = json.loads(blob)
    if doc.get("format") != SKELETON_FORMAT or doc.get("kind") not in _BUILDERS:
        raise UnsupportedModelError(
            f"model skeleton format {doc.get('format')} / kind {doc.get('kind')!r} is unknown",
            "redeploy the model with this moefleet version",
        )
    return _BUILDERS[doc["kind"]](doc)


# -- which tensors belong to which function ----------------------------------------------
def names_by_tensor(model: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for name, b in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(b), []).append(name)
    return names


def tensors_of(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def shared_tensors(adapter: MoEModelAdapter) -> list[torch.Tensor]:
    """Model tensors that no segment and no expert owns (e.g. rotary tables)."""
    owned = {id(t) for b in range(adapter.num_layers) for t in tensors_of(adapter.segment(b))}
    expert_storage = {
        p.untyped_storage().data_ptr()
        for layer in adapter.moe_layers
        for i in range(adapter.num_experts(layer))
        for p in adapter.expert_view(layer, i).parameters()
    }
    return [t for t in tensors_of(adapter.model)
            if id(t) not in owned and t.untyped_storage().data_ptr() not in expert_storage]


def segment_tensors(adapter: MoEModelAdapter, block: int) -> dict[str, torch.Tensor]:
    """Model-relative name → tensor for everything segment ``block`` needs: its own
    module's tensors plus the unowned ones (:func:`shared_tensors`), which every segment
    gets because no adapter method says which block uses them."""
    names = names_by_tensor(adapter.model)
    picked = [*tensors_of(adapter.segment(block)), *shared_tensors(adapter)]
    out: dict[str, torch.Tensor] = {}
    for t in picked:
        for name in names.get(id(t), []):
            out[name] = t.detach().contiguous().clone()
    return out


def expert_tensors(adapter: MoEModelAdapter, layer: int, index: int) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in adapter.expert(layer, index).state_dict().items()}


def assign_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Put real tensors into a (meta) model by model-relative name."""
    for name, t in tensors.items():
        path, _, leaf = name.rpartition(".")
        module: nn.Module = model.get_submodule(path) if path else model
        if leaf in module._parameters:
            module._parameters[leaf] = nn.Parameter(t, requires_grad=False)
        elif leaf in module._buffers:
            module._buffers[leaf] = t
        else:
            raise KeyError(f"model has no parameter or buffer {name!r}")


def load_expert(
    skeleton: MoEModelAdapter, layer: int, index: int, tensors: dict[str, torch.Tensor]
) -> nn.Module:
    module = skeleton.expert_view(layer, index)
    module.load_state_dict(tensors, strict=True, assign=True)
    return module.eval()


def to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    return bytes(st_save(tensors))


def from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    return dict(st_load(data))


def module_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@dataclass(frozen=True)
class ModelLayout:
    """Where a deployed model's pieces live in the object store (keys)."""

    skeleton: str
    segments: list[str]
    experts: dict[str, str]  # "layer:index" -> key
    bytes_uploaded: int

    def expert_key(self, layer: int, index: int) -> str:
        return self.experts[f"{layer}:{index}"]

    def to_dict(self) -> dict[str, Any]:
        return {"skeleton": self.skeleton, "segments": self.segments, "experts": self.experts,
                "bytes_uploaded": self.bytes_uploaded}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelLayout:
        return cls(d["skeleton"], list(d["segments"]), dict(d["experts"]),
                   int(d.get("bytes_uploaded", 0)))


def upload_model(adapter: MoEModelAdapter, store: ObjectStore, prefix: str) -> ModelLayout:
    """Write skeleton, segment and expert objects under ``prefix/model/``."""
    base = f"{prefix}/model"
    total = 0

    def put(key: str, data: bytes) -> str:
        nonlocal total
        store.put(key, data)
        total += len(data)
        return key

    skeleton = put(f"{base}/skeleton.json", skeleton_json(adapter))
    segments = [
        put(f"{base}/seg-{b}.safetensors", to_bytes(segment_tensors(adapter, b)))
        for b in range(adapter.num_layers)
    ]
    experts = {
        f"{layer}:{i}": put(f"{base}/exp-{layer}-{i}.safetensors",
                            to_bytes(expert_tensors(adapter, layer, i)))
        for layer in adapter.moe_layers
        for i in range(adapter.num_experts(layer))
    }
    return ModelLayout(skeleton, segments, experts, total)
