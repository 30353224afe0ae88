"""``Placement``: a plan turned into functions — the one place function names are made.

``DeploymentPlan.placement()`` returns it; deploy (``runtime/deploy.py``), the executor and
the simulator read it instead of re-deriving names from the plan. Every function is a
:class:`PlacedFunction` with a role:

    segment  one per block: attention, norms, gate, dense/shared MLPs (``seg-<block>``);
    expert   the routed experts it holds in one MoE layer (``exp-<layer>-<i>`` for one
             expert, ``exp-<layer>-<i>_<j>_...`` for a group, see :func:`expert_name`);
    main     at most one: the loop itself (non-experts, KV cache, local experts).

Invariants (checked on construction): names are unique; one segment per block, in block
order; within an MoE layer every expert is held by exactly one function. Today's plans
give one function per expert and no ``main``; groups and ``main`` are here so plans that
need them (Remoe) add a field to the plan, not a new derivation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

Role = Literal["expert", "segment", "main"]
ROLES: tuple[Role, ...] = ("expert", "segment", "main")


def segment_name(block: int) -> str:
    return f"seg-{block}"


MAX_NAME = 40  # platforms cap names (Lambda: 64 with moefleet's prefix and a namespace)


def expert_name(layer: int, experts: tuple[int, ...]) -> str:
    """``exp-<layer>-<ids>``: ids joined by ``_``, runs of three or more consecutive ids
    written ``<first>to<last>`` (a 32-expert group is ``exp-0-0to31``); a set that still
    makes the name longer than :data:`MAX_NAME` is named by its size and a digest of its
    ids (``exp-3-g17-<10 hex>``). Deterministic, and distinct for distinct sets."""
    parts: list[str] = []
    i = 0
    while i < len(experts):
        j = i
        while j + 1 < len(experts) and experts[j + 1] == experts[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{experts[i]}to{experts[j]}")
        else:
            parts.extend(str(e) for e in experts[i:j + 1])
        i = j + 1
    name = f"exp-{layer}-" + "_".join(parts)
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha1(",".join(map(str, experts)).encode()).hexdigest()[:10]
    return f"exp-{layer}-g{len(experts)}-{digest}"


@dataclass(frozen=True)
class PlacedFunction:
    """One function of a placement. ``layer`` is the block (segment) or MoE layer
    (expert), None for ``main``; ``experts`` are the expert ids it holds (empty unless
    role is ``expert``)."""

    name: str
    role: Role
    layer: int | None
    memory_mb: int
    experts: tuple[int, ...] = ()
    replicas: int = 1
    concurrency: int = 1

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"{self.name}: role {self.role!r} is not one of {ROLES}")
        if (self.role == "main") != (self.layer is None):
            raise ValueError(f"{self.name}: segments and experts have a layer, main has none")
        if (self.role == "expert") != bool(self.experts):
            raise ValueError(f"{self.name}: only expert functions hold experts")
        if self.memory_mb < 1 or self.replicas < 1 or self.concurrency < 1:
            raise ValueError(f"{self.name}: memory, replicas and concurrency must be >= 1")


@dataclass(frozen=True)
class Placement:
    """All functions of one plan: segments (block order), then experts (layer order),
    then ``main`` if any."""

    functions: tuple[PlacedFunction, ...]
    _holder: dict[tuple[int | None, int], PlacedFunction] = field(
        init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = [f.name for f in self.functions]
        if len(set(names)) != len(names):
            raise ValueError(f"function names repeat: {names}")
        blocks = [f.layer for f in self.functions if f.role == "segment"]
        if blocks != list(range(len(blocks))):
            raise ValueError(f"segments must cover blocks 0..n-1 in order, got {blocks}")
        if sum(f.role == "main" for f in self.functions) > 1:
            raise ValueError("a placement has at most one main function")
        holder: dict[tuple[int | None, int], PlacedFunction] = {}
        for f in self.functions:
            for e in f.experts:
                key = (f.layer, e)
                if key in holder:
                    raise ValueError(f"expert {e} of layer {f.layer} is in "
                                     f"{holder[key].name} and {f.name}")
                holder[key] = f
        object.__setattr__(self, "_holder", holder)

    @classmethod
    def build(cls, segment_memory_mb: Iterable[int],
              experts: Iterable[tuple[int, tuple[int, ...], int, int]],
              main_memory_mb: int | None = None) -> Placement:
        """From per-block segment memory and ``(layer, expert ids, memory_mb, replicas)``
        groups; names come from here and nowhere else."""
        fns = [PlacedFunction(segment_name(b), "segment", b, int(m))
               for b, m in enumerate(segment_memory_mb)]
        fns += [PlacedFunction(expert_name(layer, ids), "expert", layer, int(mem), ids,
                               int(rep)) for layer, ids, mem, rep in experts]
        if main_memory_mb is not None:
            fns.append(PlacedFunction("main", "main", None, int(main_memory_mb)))
        return cls(tuple(fns))

    # ---- reading ---------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return [f.name for f in self.functions]

    @property
    def segments(self) -> list[PlacedFunction]:
        return [f for f in self.functions if f.role == "segment"]

    @property
    def main(self) -> PlacedFunction | None:
        return next((f for f in self.functions if f.role == "main"), None)

    def segment(self, block: int) -> PlacedFunction:
        seg = self.segments
        if not 0 <= block < len(seg):
            raise KeyError(f"placement has no segment for block {block}")
        return seg[block]

    def expert_functions(self, layer: int) -> list[PlacedFunction]:
        """The functions holding MoE layer ``layer``'s experts, by first expert id."""
        return sorted((f for f in self.functions if f.role == "expert" and f.layer == layer),
                      key=lambda f: f.experts[0])

    def holder(self, layer: int, expert: int) -> PlacedFunction:
        """The function that holds expert ``expert`` of MoE layer ``layer``."""
        try:
            return self._holder[(layer, expert)]
        except KeyError:
            raise KeyError(f"no function holds expert {expert} of layer {layer}") from None
