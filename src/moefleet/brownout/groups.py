"""Brownout's plan for one layer call (BrownoutServe Alg. 1, as READING-NOTES reads it):
which experts run as themselves, which go to their group's united expert, which are dropped.
Pure Python over per-expert counts (:func:`plan_layer`, the reference), and the same plan
as device masks with no host read (:func:`plan_layer_device`, what a step uses); the
ExpertFn that applies a plan is :class:`moefleet.experts.brownout.BrownoutExperts`.

Per MoE layer and call (one engine step):

1. count the routed pairs of every expert; sort experts by count, descending (ties by
   index, so the plan is deterministic);
2. S1 = the shortest prefix whose cumulative count reaches ``threshold * total``: those
   experts run as themselves (``threshold = 1`` keeps all: zero brownout);
3. the rest (S2): **full** brownout drops their pairs; **partial** brownout sends them to
   their group's united expert, except that a group in which only one S2 expert has
   tokens runs that expert itself (the special case: no access is saved, so the exact
   expert is used).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from moefleet.errors import MoefleetError

Mode = Literal["partial", "full"]
MODES: tuple[str, ...] = ("partial", "full")
# Relative slack on "cumulative count reaches threshold * total": 0.6 * 20 must be 12.
_EPS = 1e-9


class BrownoutError(MoefleetError):
    """A brownout setting (ways, threshold, mode, united experts, SLO) that cannot work."""


def check_threshold(threshold: float) -> float:
    if not isinstance(threshold, int | float) or not math.isfinite(threshold) or not (
        0.0 <= threshold <= 1.0
    ):
        raise BrownoutError(
            f"brownout threshold {threshold!r} is outside [0, 1]",
            "use 1 for zero brownout, 0 to send every pair outside S1 to united experts",
        )
    return float(threshold)


def check_ways(ways: int, num_experts: int) -> int:
    if isinstance(ways, bool) or not isinstance(ways, int) or not 2 <= ways <= num_experts:
        raise BrownoutError(
            f"united-expert ways={ways!r} is not in [2, {num_experts}]",
            f"group at least 2 and at most the layer's {num_experts} experts",
        )
    return ways


@dataclass(frozen=True)
class Grouping:
    """Groups of experts per MoE layer; every expert of a layer is in exactly one group."""

    ways: int
    kind: str
    groups: Mapping[int, tuple[tuple[int, ...], ...]]

    def group_of(self, layer: int) -> list[int]:
        """group index of every expert of ``layer`` (list indexed by expert)."""
        members = self.groups[layer]
        out = [-1] * sum(len(g) for g in members)
        for g, experts in enumerate(members):
            for e in experts:
                out[e] = g
        return out


def index_groups(num_experts: int, ways: int) -> tuple[tuple[int, ...], ...]:
    """The paper's grouping: ceil(E / ways) groups of consecutive expert indices."""
    check_ways(ways, num_experts)
    return tuple(tuple(range(s, min(s + ways, num_experts))) for s in range(0, num_experts, ways))


@dataclass(frozen=True)
class BrownoutPlan:
    """Where each expert's pairs go in one layer call (experts without pairs omitted)."""

    original: tuple[int, ...]  # S1, in the order they were chosen
    united: Mapping[int, tuple[int, ...]]  # group -> its S2 members with pairs (>= 2)
    special: tuple[int, ...]  # S2 experts alone in their group: run as themselves
    dropped: tuple[int, ...]  # S2 experts whose pairs are dropped (full brownout)


def plan_layer(
    counts_E: Sequence[int], threshold: float, group_of_E: Sequence[int], mode: str
) -> BrownoutPlan:
    """Alg. 1's split of one layer's experts (see the module docstring)."""
    check_threshold(threshold)
    if mode not in MODES:
        raise BrownoutError(f"brownout mode {mode!r} is unknown", f"use one of {MODES}")
    counts = [int(c) for c in counts_E]
    total = sum(counts)
    order = sorted(range(len(counts)), key=lambda e: (-counts[e], e))
    need = threshold * total
    s1: list[int] = []
    cum = 0
    for e in order:
        if cum >= need - _EPS * max(total, 1) or counts[e] == 0:
            break
        s1.append(e)
        cum += counts[e]
    chosen = set(s1)
    s2 = [e for e in order if counts[e] > 0 and e not in chosen]
    if mode == "full":
        return BrownoutPlan(tuple(s1), {}, (), tuple(sorted(s2)))
    by_group: dict[int, list[int]] = {}
    for e in s2:
        by_group.setdefault(group_of_E[e], []).append(e)
    united = {g: tuple(sorted(m)) for g, m in sorted(by_group.items()) if len(m) > 1}
    special = tuple(sorted(m[0] for m in by_group.values() if len(m) == 1))
    return BrownoutPlan(tuple(s1), united, special, ())


@dataclass(frozen=True)
class DevicePlan:
    """:func:`plan_layer` as masks over the layer's experts, on the counts' device:
    ``original_E`` (S1 and special experts: run as themselves), ``united_E`` (S2 members
    of groups with >= 2 of them: sent to the group's united expert), ``dropped_E`` (full
    brownout's S2). ``s1_E`` and ``counts_E`` keep what :meth:`to_plan` needs."""

    counts_E: torch.Tensor
    s1_E: torch.Tensor
    original_E: torch.Tensor
    united_E: torch.Tensor
    dropped_E: torch.Tensor
    united_groups: torch.Tensor  # scalar: groups whose united expert runs

    def to_plan(self, group_of_E: Sequence[int]) -> BrownoutPlan:
        """The same plan as Python tuples (reads the masks: for inspection, not the step)."""
        counts = self.counts_E.tolist()
        s1 = sorted((e for e, m in enumerate(self.s1_E.tolist()) if m),
                    key=lambda e: (-counts[e], e))
        special = tuple(e for e, (o, s) in enumerate(zip(self.original_E.tolist(),
                                                         self.s1_E.tolist(), strict=True))
                        if o and not s)
        united: dict[int, list[int]] = {}
        for e, m in enumerate(self.united_E.tolist()):
            if m:
                united.setdefault(group_of_E[e], []).append(e)
        dropped = tuple(e for e, m in enumerate(self.dropped_E.tolist()) if m)
        return BrownoutPlan(tuple(s1), {g: tuple(m) for g, m in sorted(united.items())},
                            special, dropped)


def plan_layer_device(counts_E: torch.Tensor, threshold: float, group_of_E: torch.Tensor,
                      num_groups: int, mode: str) -> DevicePlan:
    """:func:`plan_layer` vectorised over experts and groups, with no host read.

    S1 is a prefix of the experts sorted by count (descending, ties by index: a stable
    sort of the negated counts); an expert is in it iff the pairs of the experts before
    it fall short of ``threshold * total`` (with the same slack) and it has pairs. In
    partial mode a group's S2 members go to its united expert when there are >= 2 of
    them, else the lone one runs as itself (the special case)."""
    order_E = torch.argsort(-counts_E, stable=True)
    sorted_E = counts_E[order_E]
    before_E = torch.cumsum(sorted_E, 0) - sorted_E
    total = counts_E.sum().double()
    need = threshold * total - _EPS * torch.clamp(total, min=1.0)
    chosen_sorted = (before_E.double() < need) & (sorted_E > 0)
    s1_E = torch.zeros_like(chosen_sorted).scatter(0, order_E, chosen_sorted)
    s2_E = (counts_E > 0) & ~s1_E
    none = torch.zeros_like(s1_E)
    if mode == "full":
        return DevicePlan(counts_E, s1_E, s1_E, none, s2_E, torch.zeros((), dtype=torch.long,
                                                                        device=s1_E.device))
    in_group_G = torch.zeros(num_groups, dtype=torch.long, device=counts_E.device)
    in_group_G.scatter_add_(0, group_of_E, s2_E.long())
    shared_E = in_group_G[group_of_E] > 1
    return DevicePlan(counts_E, s1_E, s1_E | (s2_E & ~shared_E), s2_E & shared_E, none,
                      (in_group_G > 1).sum())
