"""Brownout routing (BrownoutServe Alg. 1, as READING-NOTES reads it) around any ExpertFn.

Shape legend: N tokens, K experts per token, D hidden size, E experts in the layer,
G groups (united experts) in the layer, P routed (token, expert) pairs.

Per MoE layer and call (one engine step):

1. count the routed pairs of every expert; sort experts by count, descending (ties by
   index, so the plan is deterministic);
2. S1 = the shortest prefix whose cumulative count reaches ``threshold * total``: those
   experts run as themselves (``threshold = 1`` keeps all: zero brownout);
3. the rest (S2): **full** brownout drops their pairs; **partial** brownout sends them to
   their group's united expert, except that a group in which only one S2 expert has
   tokens runs that expert itself (the special case: no access is saved, so the exact
   expert is used).

A pair keeps its gate weight wherever it goes (eqs. 5-7): a token whose two chosen
experts share a group gets that group's united output once, weighted by the sum of the
two gate weights. Shared experts are not routed and never pass through here (adapters
add them in ``post_moe``), so brownout leaves them untouched on every family.

Invariant (tested): at ``threshold = 1`` the wrapper returns exactly ``inner``'s output.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from moefleet.errors import MoefleetError
from moefleet.models.base import ExpertFn, combine_experts
from moefleet.models.experts import GatedExpert
from moefleet.models.local_experts import grouped_matmul

if TYPE_CHECKING:
    from moefleet.brownout.united import UnitedExperts

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
class LayerPlan:
    """Where each expert's pairs go in one layer call (experts without pairs omitted)."""

    original: tuple[int, ...]  # S1, in the order they were chosen
    united: Mapping[int, tuple[int, ...]]  # group -> its S2 members with pairs (>= 2)
    special: tuple[int, ...]  # S2 experts alone in their group: run as themselves
    dropped: tuple[int, ...]  # S2 experts whose pairs are dropped (full brownout)


def plan_layer(
    counts_E: Sequence[int], threshold: float, group_of_E: Sequence[int], mode: str
) -> LayerPlan:
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
        return LayerPlan(tuple(s1), {}, (), tuple(sorted(s2)))
    by_group: dict[int, list[int]] = {}
    for e in s2:
        by_group.setdefault(group_of_E[e], []).append(e)
    united = {g: tuple(sorted(m)) for g, m in sorted(by_group.items()) if len(m) > 1}
    special = tuple(sorted(m[0] for m in by_group.values() if len(m) == 1))
    return LayerPlan(tuple(s1), united, special, ())


@dataclass
class BrownoutStats:
    """Cumulative counters over calls: expert accesses and routed pairs by destination."""

    calls: int = 0
    original_accesses: int = 0
    united_accesses: int = 0
    original_pairs: int = 0
    united_pairs: int = 0
    dropped_pairs: int = 0
    last_plan: dict[int, LayerPlan] = field(default_factory=dict)


class BrownoutExperts:
    """An ExpertFn applying brownout routing around ``inner`` (the original experts).

    ``groups`` is a :class:`Grouping` (enough for full brownout) or a
    :class:`~moefleet.brownout.united.UnitedExperts` (its grouping and united modules;
    required for partial brownout). ``threshold`` may be changed between calls (SALC
    does, per step) through :attr:`threshold`. ``united_kernel="stacked"`` runs a layer's
    united experts as two batched matmuls over their stacked weights (as the stacked
    kernel runs the originals: one launch pair instead of one per group, what a GPU
    wants); it needs gated experts (:class:`GatedExpert`), else it falls back to the loop.
    """

    def __init__(
        self,
        inner: ExpertFn,
        groups: Grouping | UnitedExperts,
        threshold: float,
        mode: str = "partial",
        united_kernel: str = "loop",
    ) -> None:
        if mode not in MODES:
            raise BrownoutError(f"brownout mode {mode!r} is unknown", f"use one of {MODES}")
        self.inner = inner
        self.mode = mode
        if isinstance(groups, Grouping):
            self.grouping, self.united = groups, None
        else:
            self.grouping, self.united = groups.grouping, groups.modules
        if mode == "partial" and self.united is None:
            raise BrownoutError(
                "partial brownout needs united experts, got only a grouping",
                "distill them with `moefleet brownout distill`, or use mode='full'",
            )
        self._group_of = {layer: self.grouping.group_of(layer) for layer in self.grouping.groups}
        if united_kernel not in ("loop", "stacked"):
            raise BrownoutError(f"united kernel {united_kernel!r} is unknown",
                                "use 'loop' or 'stacked'")
        self.united_kernel = united_kernel
        self._stacked: dict[int, tuple[torch.Tensor, torch.Tensor, Any] | None] = {}
        self._threshold = check_threshold(threshold)
        self.stats = BrownoutStats()

    @property
    def threshold(self) -> float:
        return self._threshold

    @threshold.setter
    def threshold(self, value: float) -> None:
        self._threshold = check_threshold(value)

    def __call__(
        self, layer: int, x_ND: torch.Tensor, ids_NK: torch.Tensor, w_NK: torch.Tensor
    ) -> torch.Tensor:
        st = self.stats
        st.calls += 1
        if layer not in self._group_of:
            raise BrownoutError(
                f"no expert groups for MoE layer {layer}",
                "the united experts were built for another model; distill for this one",
            )
        group_of = self._group_of[layer]
        num_experts = len(group_of)
        counts_E = torch.bincount(ids_NK.reshape(-1), minlength=num_experts)
        if counts_E.numel() > num_experts:
            raise BrownoutError(
                f"layer {layer} routes to expert {int(ids_NK.max())} but its groups cover "
                f"{num_experts} experts", "distill united experts for this model"
            )
        if self._threshold >= 1.0:
            busy = int((counts_E > 0).sum())
            st.original_accesses += busy
            st.original_pairs += int(ids_NK.numel())
            st.last_plan[layer] = LayerPlan(tuple(range(num_experts)), {}, (), ())
            return self.inner(layer, x_ND, ids_NK, w_NK)
        plan = plan_layer(counts_E.tolist(), self._threshold, group_of, self.mode)
        st.last_plan[layer] = plan
        dev = ids_NK.device
        run_original = torch.zeros(num_experts, dtype=torch.bool, device=dev)
        run_original[list(plan.original + plan.special)] = True
        to_united = torch.zeros(num_experts, dtype=torch.bool, device=dev)
        for members in plan.united.values():
            to_united[list(members)] = True
        y_ND = torch.zeros_like(x_ND)
        k = ids_NK.shape[1]
        orig_P = torch.nonzero(run_original[ids_NK].reshape(-1)).flatten()
        if orig_P.numel():
            tok_P = orig_P // k
            # One row per kept pair (K = 1): the inner sees only pairs that stay original.
            out_PD = self.inner(
                layer, x_ND[tok_P], ids_NK.reshape(-1)[orig_P, None],
                w_NK.reshape(-1)[orig_P, None],
            )
            y_ND.index_add_(0, tok_P, out_PD.to(y_ND.dtype))
        uni_P = torch.nonzero(to_united[ids_NK].reshape(-1)).flatten()
        if uni_P.numel():
            assert self.united is not None  # partial mode, checked in __init__
            y_ND += self._united(layer, x_ND, ids_NK, w_NK, uni_P, group_of)
        st.original_accesses += len(plan.original) + len(plan.special)
        st.united_accesses += len(plan.united)
        st.original_pairs += int(orig_P.numel())
        st.united_pairs += int(uni_P.numel())
        st.dropped_pairs += int(ids_NK.numel() - orig_P.numel() - uni_P.numel())
        return y_ND

    def _united(
        self,
        layer: int,
        x_ND: torch.Tensor,
        ids_NK: torch.Tensor,
        w_NK: torch.Tensor,
        pairs_P: torch.Tensor,
        group_of: list[int],
    ) -> torch.Tensor:
        """Sum over united pairs of w * united[group](x); one row per (token, group)."""
        assert self.united is not None
        k = ids_NK.shape[1]
        modules: Sequence[nn.Module] = self.united[layer]
        gid_E = torch.tensor(group_of, dtype=torch.long, device=ids_NK.device)
        tok_P = pairs_P // k
        grp_P = gid_E[ids_NK.reshape(-1)[pairs_P]]
        keys_P = tok_P * len(modules) + grp_P
        keys_U, inverse_P = torch.unique(keys_P, return_inverse=True)
        # Gate weights of pairs sharing (token, group) add up (eq. 5 summed per group).
        w_U = torch.zeros(keys_U.numel(), dtype=w_NK.dtype, device=w_NK.device)
        w_U.index_add_(0, inverse_P, w_NK.reshape(-1)[pairs_P])
        tok_U = keys_U // len(modules)
        stacked = self._stacked_united(layer) if self.united_kernel == "stacked" else None
        if stacked is not None:
            out_UD = grouped_matmul(x_ND[tok_U], (keys_U % len(modules))[:, None],
                                    w_U[:, None], *stacked)
        else:
            out_UD = combine_experts(
                list(modules), x_ND[tok_U], (keys_U % len(modules))[:, None], w_U[:, None]
            )
        y_ND = torch.zeros_like(x_ND)
        y_ND.index_add_(0, tok_U, out_UD.to(y_ND.dtype))
        return y_ND

    def _stacked_united(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, Any] | None:
        """The layer's united experts' weights stacked ([G, 2F, D], [G, D, F], act), once;
        None when they are not gated experts sharing one activation."""
        if layer not in self._stacked:
            assert self.united is not None
            mods = list(self.united[layer])
            gated = [m for m in mods if isinstance(m, GatedExpert)]
            # copies of one expert carry copies of its activation: compare what they are
            ok = len(gated) == len(mods) and len({repr(m.act) for m in gated}) == 1
            self._stacked[layer] = (torch.stack([m.gate_up.detach() for m in gated]),
                                    torch.stack([m.down.detach() for m in gated]),
                                    gated[0].act) if ok else None
        return self._stacked[layer]
