"""Brownout routing around any ExpertFn (seam 1): BrownoutServe's united experts.

Shape legend: N tokens, K experts per token, D hidden size, E experts in the layer,
G groups (united experts) in the layer, P routed (token, expert) pairs.

Each call plans the layer with :func:`moefleet.brownout.groups.plan_layer` and sends each
routed pair where the plan says: the inner ExpertFn (S1 and special experts), the
group's united expert (partial brownout), or nowhere (full brownout). A pair keeps its
gate weight wherever it goes (eqs. 5-7): a token whose two chosen experts share a group
gets that group's united output once, weighted by the sum of the two gate weights.
Shared experts are not routed and never pass through here (adapters add them in
``post_moe``), so brownout leaves them untouched on every family.

Invariant (tested): at ``threshold = 1`` the wrapper returns exactly ``inner``'s output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from moefleet.brownout.groups import (
    MODES,
    BrownoutError,
    BrownoutPlan,
    Grouping,
    check_threshold,
    plan_layer,
)
from moefleet.experts.kernels import grouped_matmul
from moefleet.experts.stack import ExpertStack, as_stack
from moefleet.models.base import ExpertFn, combine_experts
from moefleet.models.experts import GatedExpert

if TYPE_CHECKING:
    from moefleet.brownout.united import UnitedExperts


@dataclass
class BrownoutStats:
    """Cumulative counters over calls: expert accesses and routed pairs by destination."""

    calls: int = 0
    original_accesses: int = 0
    united_accesses: int = 0
    original_pairs: int = 0
    united_pairs: int = 0
    dropped_pairs: int = 0
    last_plan: dict[int, BrownoutPlan] = field(default_factory=dict)


class BrownoutExperts(ExpertStack):
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
        inner: ExpertStack | ExpertFn,
        groups: Grouping | UnitedExperts,
        threshold: float,
        mode: str = "partial",
        united_kernel: str = "loop",
    ) -> None:
        if mode not in MODES:
            raise BrownoutError(f"brownout mode {mode!r} is unknown", f"use one of {MODES}")
        self.inner = as_stack(inner)
        self.inners = (self.inner,)
        self._owners: list[str] | None = None
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

    def set_owners(self, owners_N: Sequence[str] | None) -> None:
        # kept: the inner sees a subset of rows (one per kept pair), told per call
        self._owners = None if owners_N is None else list(owners_N)
        self.inner.set_owners(owners_N)

    def _call_inner(self, layer: int, x_ND: torch.Tensor, ids_NK: torch.Tensor,
                    w_NK: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """``inner`` on ``rows`` of this call's token rows (None: all of them), told
        whose each row is first."""
        if self._owners is not None:
            owners = self._owners
            self.inner.set_owners(owners if rows is None else [owners[i] for i in rows.tolist()])
        return self.inner(layer, x_ND, ids_NK, w_NK)

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
            st.last_plan[layer] = BrownoutPlan(tuple(range(num_experts)), {}, (), ())
            return self._call_inner(layer, x_ND, ids_NK, w_NK, None)
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
            out_PD = self._call_inner(
                layer, x_ND[tok_P], ids_NK.reshape(-1)[orig_P, None],
                w_NK.reshape(-1)[orig_P, None], tok_P,
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
