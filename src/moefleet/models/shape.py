"""``ModelShape``: the one description of an MoE model's shape, used everywhere.

Adapters report it (``adapter.summary()``), predictors remember the shape they were fitted
on, the planner and the simulator size their pipelines from it and a deployment stores it
so the executor needs no weights. Torch-free on purpose: planning, prediction and
simulation import it without loading a model.

Invariants (checked on construction, :class:`~moefleet.errors.DataError` otherwise):
``num_layers >= 1`` blocks; ``moe_layers`` strictly increasing block indices below
``num_layers``; one expert count ``>= 1`` per MoE layer; ``1 <= top_k <= min(experts)``;
byte counts ``>= 0``. Fields a source cannot know (a trace has no hidden size) stay at
their neutral defaults (``""``/``0``), never guessed.

Files written before this class existed stored other forms; :meth:`ModelShape.from_dict`
reads them all: predictor files (``layers``/``num_experts``/``top_k``), deployment
``structure`` dicts and the old ``ModelSummary`` fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from moefleet.errors import DataError

_HINT = "check the model (moefleet models info MODEL) or re-create the file"


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Blocks, MoE layers, experts per layer, top-k and sizes of one model.

    ``moe_layers``/``num_experts`` are lists (equal to plain lists, JSON-friendly); the
    instance is frozen and nothing may mutate them.
    """

    name: str = ""
    family: str = ""
    num_layers: int  # blocks, MoE or not
    moe_layers: list[int]
    num_experts: list[int]  # one count per MoE layer, in moe_layers order
    top_k: int
    hidden_size: int = 0
    vocab_size: int = 0
    expert_param_bytes: int = 0  # all routed experts together
    non_expert_param_bytes: int = 0
    total_param_bytes: int = 0
    causal: bool = True  # a causal model decodes (generates); an encoder runs one pass

    def __post_init__(self) -> None:
        try:
            layers = [int(x) for x in self.moe_layers]
            experts = [int(x) for x in self.num_experts]
        except (TypeError, ValueError) as err:
            raise DataError(f"model {self.name!r}: MoE layers {self.moe_layers!r} and "
                            f"experts {self.num_experts!r} must be integers", _HINT) from err
        object.__setattr__(self, "moe_layers", layers)
        object.__setattr__(self, "num_experts", experts)
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or \
                self.num_layers < 1:
            raise DataError(f"model {self.name!r} needs at least one block, got "
                            f"num_layers={self.num_layers!r}", _HINT)
        if len(layers) != len(experts):
            raise DataError(f"model {self.name!r}: {len(layers)} MoE layers but "
                            f"{len(experts)} expert counts", _HINT)
        if sorted(set(layers)) != layers or any(not 0 <= b < self.num_layers for b in layers):
            raise DataError(f"model {self.name!r}: moe_layers {layers} must be increasing "
                            f"block indices below {self.num_layers}", _HINT)
        if any(e < 1 for e in experts) or not 1 <= self.top_k <= min(experts,
                                                                     default=self.top_k):
            raise DataError(f"model {self.name!r}: top_k={self.top_k} must be in 1..experts "
                            f"({experts})", _HINT)
        for label in ("hidden_size", "vocab_size", "expert_param_bytes",
                      "non_expert_param_bytes", "total_param_bytes"):
            if getattr(self, label) < 0:
                raise DataError(f"model {self.name!r}: {label} must be >= 0, got "
                                f"{getattr(self, label)!r}", _HINT)

    # ---- derived ---------------------------------------------------------------------
    @property
    def decoder(self) -> bool:
        """Generates (prefill + decode): the same thing as ``causal``."""
        return self.causal

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def max_experts(self) -> int:
        return max(self.num_experts)

    def experts_of(self, layer: int) -> int:
        """Expert count of MoE block ``layer``."""
        return self.num_experts[self.layer_index(layer)]

    def mask_LE(self) -> np.ndarray:
        """True where (MoE layer, expert) exists; False on padding of smaller layers."""
        return np.arange(self.max_experts)[None, :] < np.asarray(self.num_experts)[:, None]

    def layer_index(self, layer: int) -> int:
        """Position of block ``layer`` among the MoE layers."""
        if layer not in self.moe_layers:
            raise DataError(f"layer {layer} is not an MoE layer of this model",
                            f"MoE layers: {list(self.moe_layers)}")
        return self.moe_layers.index(layer)

    def differences(self, other: ModelShape) -> list[str]:
        """``field: mine vs other`` for every routing-relevant field that differs (MoE
        layers, experts per layer, top-k): what a predictor or a trace must agree on."""
        out = []
        for label, a, b in (("MoE layers", self.moe_layers, other.moe_layers),
                            ("experts per layer", self.num_experts, other.num_experts),
                            ("top-k", self.top_k, other.top_k)):
            if a != b:
                out.append(f"{label} {a} vs {b}")
        return out

    # ---- persistence -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> ModelShape:
        """Read this class's dict or any older stored form (see the module docstring)."""
        try:
            layers = [int(x) for x in obj.get("moe_layers", obj.get("layers", []))]
            blocks = obj.get("num_layers", obj.get("num_blocks"))
            # predictor files stored MoE layers only: the blocks after the last one
            # are unknown, so the shape claims no more than it knows
            num_layers = int(blocks) if blocks is not None else max(layers, default=0) + 1
            known = {k: obj[k] for k in ("name", "family", "hidden_size", "vocab_size",
                                         "expert_param_bytes", "non_expert_param_bytes",
                                         "total_param_bytes", "causal") if k in obj}
            if "decoder" in obj and "causal" not in obj:
                known["causal"] = bool(obj["decoder"])
            return cls(num_layers=num_layers, moe_layers=layers,
                       num_experts=list(obj["num_experts"]), top_k=int(obj["top_k"]), **known)
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(f"not a model shape: {dict(obj)!r} ({err!r})", _HINT) from err

    @classmethod
    def from_trace(cls, trace: Any) -> ModelShape:
        """The shape a routing trace (``moefleet.traces.Trace``) records; blocks after the
        last MoE layer and sizes are not in a trace and stay at their defaults."""
        layers = [int(x) for x in trace.moe_layers]
        experts = [int(e) for e in trace.meta["num_experts"]]
        if not layers or len(layers) != len(experts):
            raise DataError(
                f"trace metadata lists {len(layers)} MoE layers but {len(experts)} expert "
                "counts", "re-record the trace with moefleet profile")
        meta = trace.meta
        return cls(name=str(meta.get("model") or ""), family=str(meta.get("family") or ""),
                   num_layers=int(meta.get("num_layers") or max(layers) + 1),
                   moe_layers=layers, num_experts=experts, top_k=int(trace.top_k))
