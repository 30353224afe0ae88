"""United experts: one distilled expert per group of ``ways`` experts, cached per model.

A :class:`UnitedExperts` holds, for one model: the grouping (which experts each united
expert stands for, per MoE layer) and one module per group with the same architecture
as the model's experts (so any ExpertFn-level code can run it). Distillation lives in
:mod:`moefleet.brownout.distill`; this module owns identity, storage and validation.

Cache layout (keyed like zoo builds): ``<cache>/united/<model>-<model key>/
<grouping>-w<ways>-<config hash>/{united.pt, report.json}``. The model key is the zoo
entry's key (recipe + code), so united experts of a rebuilt model are never reused.
An entry is written into a temporary sibling directory and renamed into place, so an
interrupted distillation leaves no entry (and no partial file) behind.

Invariant checked on load: the stored model name/key, ways, grouping kind and expert
shapes equal the ones asked for; anything else is a :class:`BrownoutError` naming both.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moefleet.brownout.groups import BrownoutError, Grouping
from moefleet.io import atomic_dir
from moefleet.models.base import MoEModelAdapter
from moefleet.paths import cache_dir
from moefleet.torch_io import load_torch_data

GROUPINGS: tuple[str, ...] = ("index", "similarity")
CODE_VERSION = "1"


@dataclass
class UnitedExperts:
    model: str
    model_key: str
    grouping: Grouping
    modules: dict[int, list[nn.Module]]
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def ways(self) -> int:
        return self.grouping.ways

    def check_for(self, adapter: MoEModelAdapter, ways: int | None = None) -> None:
        """Raise unless these united experts belong to ``adapter`` (and ``ways``)."""
        key = model_key(adapter)
        if (self.model, self.model_key) != (adapter.name, key):
            raise BrownoutError(
                f"united experts were built for model {self.model!r} (key {self.model_key}), "
                f"not {adapter.name!r} (key {key})",
                f"distill them for this model: moefleet brownout distill --model {adapter.name}",
            )
        if ways is not None and ways != self.ways:
            raise BrownoutError(
                f"united experts were built with ways={self.ways}, not ways={ways}",
                f"distill with --ways {ways} or use ways={self.ways}",
            )


def check_grouping_kind(kind: str) -> str:
    if kind not in GROUPINGS:
        raise BrownoutError(f"grouping {kind!r} is unknown", f"use one of {', '.join(GROUPINGS)}")
    return kind


def model_key(adapter: MoEModelAdapter) -> str:
    """The zoo key of a zoo model; else a hash of its config and routed-expert shapes."""
    from moefleet.models import zoo

    if zoo.has_entry(adapter.name):
        return zoo.get_entry(adapter.name).key()
    cfg: Any = getattr(adapter.model, "config", None)
    blob = json.dumps(
        {"config": cfg.to_dict() if cfg is not None else adapter.name,
         "experts": [adapter.num_experts(layer) for layer in adapter.moe_layers]},
        sort_keys=True, default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def entry_dir(adapter: MoEModelAdapter, ways: int, kind: str, config: dict[str, Any]) -> Path:
    blob = json.dumps({"config": config, "code": CODE_VERSION}, sort_keys=True)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:12]
    safe = adapter.name.replace("/", "--")
    return (cache_dir() / "united" / f"{safe}-{model_key(adapter)}"
            / f"{kind}-w{ways}-{digest}")


def save_atomic(target: Path, united: UnitedExperts, write: Callable[[Path], None] | None = None
                ) -> None:
    """Write ``united`` as the entry ``target`` (temp dir + rename; see module doc)."""
    with atomic_dir(target) as tmp:
        payload = {
            "model": united.model,
            "model_key": united.model_key,
            "ways": united.ways,
            "kind": united.grouping.kind,
            "groups": {str(k): [list(g) for g in v] for k, v in united.grouping.groups.items()},
            "state": {str(k): [m.state_dict() for m in mods] for k, mods in united.modules.items()},
        }
        torch.save(payload, tmp / "united.pt")
        if write is not None:
            write(tmp)
        (tmp / "report.json").write_text(json.dumps(united.report, indent=2, sort_keys=True))


def load_entry(path: Path, adapter: MoEModelAdapter, ways: int | None = None) -> UnitedExperts:
    """United experts stored at ``path``, checked against ``adapter`` and ``ways``."""
    f = path / "united.pt"
    if not f.is_file():
        raise BrownoutError(f"no united experts at {path}", "run `moefleet brownout distill`")
    data = load_torch_data(f, "united experts", "distill again: moefleet brownout distill")
    try:
        groups = {int(k): tuple(tuple(int(i) for i in g) for g in v)
                  for k, v in data["groups"].items()}
        grouping = Grouping(int(data["ways"]), str(data["kind"]), groups)
        united = UnitedExperts(str(data["model"]), str(data["model_key"]), grouping, {})
        layers = [(int(layer), list(states)) for layer, states in data["state"].items()]
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise BrownoutError(f"{f} is not a united-experts file ({type(err).__name__}: {err})",
                            "distill again: moefleet brownout distill") from None
    united.check_for(adapter, ways)
    for layer_i, states in layers:
        if len(states) != len(groups.get(layer_i, ())):
            raise BrownoutError(f"{f}: layer {layer_i} has {len(states)} united experts for "
                                f"{len(groups.get(layer_i, ()))} groups", "distill again")
        mods = []
        for members, state in zip(groups[layer_i], states, strict=True):
            m = copy.deepcopy(adapter.expert(layer_i, members[0]))
            try:
                m.load_state_dict(state, strict=True)
            except RuntimeError as err:
                raise BrownoutError(f"united expert of layer {layer_i} does not fit the "
                                    f"model's experts: {err}", "distill again") from err
            mods.append(m.eval())
        united.modules[layer_i] = mods
    report = path / "report.json"
    united.report = json.loads(report.read_text()) if report.is_file() else {}
    return united


def find_cached(adapter: MoEModelAdapter, ways: int, kind: str,
                config: dict[str, Any]) -> UnitedExperts | None:
    path = entry_dir(adapter, ways, kind, config)
    return load_entry(path, adapter, ways) if (path / "report.json").is_file() else None


def averaged_united(adapter: MoEModelAdapter, ways: int) -> UnitedExperts:
    """United experts that are the plain average of their group's experts (index
    grouping), with no distillation: for speed and memory measurements only (their output
    quality is not BrownoutServe's). Needs stacked gated experts."""
    from moefleet.brownout.groups import index_groups
    from moefleet.models.experts import GatedExpert

    groups: dict[int, tuple[tuple[int, ...], ...]] = {}
    modules: dict[int, list[nn.Module]] = {}
    for layer in adapter.moe_layers:
        stacked = adapter.stacked_expert_weights(layer)
        if stacked is None:
            raise BrownoutError(f"{adapter.family} keeps no stacked expert weights",
                                "distill united experts instead")
        gate_up, down, act = stacked
        groups[layer] = index_groups(adapter.num_experts(layer), ways)
        modules[layer] = [GatedExpert(gate_up[list(g)].mean(0), down[list(g)].mean(0), act)
                          for g in groups[layer]]
    return UnitedExperts(adapter.name, model_key(adapter), Grouping(ways, "index", groups),
                         modules, {"united": "group averages (speed only, not distilled)"})
