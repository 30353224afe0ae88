"""Brownout routing around any ExpertFn (seam 1): BrownoutServe's united experts.

Shape legend: N tokens, K experts per token, D hidden size, E experts in the layer,
G groups (united experts) in the layer, P routed (token, expert) pairs.

Each call plans the layer on the device (Alg. 1 as masks:
:func:`moefleet.brownout.groups.plan_layer_device`) and sends each routed pair where the
plan says: the inner ExpertFn (S1 and special experts), the group's united expert
(partial brownout), or nowhere (full brownout). A pair keeps its gate weight wherever it
goes (eqs. 5-7): a token whose two chosen experts share a group gets that group's united
output once, weighted by the sum of the two gate weights. Shared experts are not routed
and never pass through here (adapters add them in ``post_moe``), so brownout leaves them
untouched on every family.

Invariant (tested): at ``threshold = 1`` the wrapper returns exactly ``inner``'s output,
and so does a partial-brownout call the inner says uniting cannot make cheaper
(:meth:`~moefleet.experts.stack.ExpertStack.uniting_pays`: a small bf16 step on a CPU,
whose pairs each run their own product whatever expert they read; counted in
:attr:`BrownoutStats.calls_not_united`).
With an inner that skips marked pairs (the fused kernel) and stackable united experts, a
call makes no host read: counts, plan, routing and statistics stay on the device
(:attr:`BrownoutExperts.stats` reads them when asked).
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
    DevicePlan,
    Grouping,
    check_threshold,
    plan_layer_device,
)
from moefleet.experts import cpu_gemv
from moefleet.experts.kernels import fused_experts
from moefleet.experts.stack import ExpertStack, as_stack
from moefleet.models.base import ExpertFn, combine_experts, count_experts
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
    # partial-brownout calls left on the original experts because uniting could not make
    # them cheaper there (ExpertStack.uniting_pays: small bf16 steps on a CPU)
    calls_not_united: int = 0
    last_plan: dict[int, BrownoutPlan] = field(default_factory=dict)


# order of the device-side counters (BrownoutExperts._acc)
_COUNTERS = ("original_accesses", "united_accesses", "original_pairs", "united_pairs",
             "dropped_pairs")


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
        self._calls = 0
        self._not_united = 0
        self._acc: torch.Tensor | None = None  # _COUNTERS, summed on the device
        self._plans: dict[int, DevicePlan] = {}
        self._gid: dict[tuple[int, torch.device], torch.Tensor] = {}

    @property
    def stats(self) -> BrownoutStats:
        """The counters so far (reading them is a host read: do it between steps)."""
        acc = [0] * len(_COUNTERS) if self._acc is None else self._acc.tolist()
        plans = {layer: p.to_plan(self._group_of[layer]) for layer, p in self._plans.items()}
        counters = {name: int(v) for name, v in zip(_COUNTERS, acc, strict=True)}
        return BrownoutStats(calls=self._calls, last_plan=plans,
                             calls_not_united=self._not_united, **counters)

    def _count(self, values: list[torch.Tensor | int], device: torch.device) -> None:
        add = torch.stack([torch.as_tensor(v, device=device).long() for v in values])
        self._acc = add if self._acc is None else self._acc + add

    def _group_ids(self, layer: int, device: torch.device) -> torch.Tensor:
        key = (layer, device)
        if key not in self._gid:
            self._gid[key] = torch.tensor(self._group_of[layer], dtype=torch.long,
                                          device=device)
        return self._gid[key]

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
        self._calls += 1
        if layer not in self._group_of:
            raise BrownoutError(
                f"no expert groups for MoE layer {layer}",
                "the united experts were built for another model; distill for this one",
            )
        dev = ids_NK.device
        num_experts = len(self._group_of[layer])
        gid_E = self._group_ids(layer, dev)
        # counted on the device (scatter_add: bincount's output size would be read back)
        counts_E = count_experts(ids_NK, num_experts)
        # the original experts alone where uniting saves nothing (see uniting_pays):
        # faster, and exact
        plain = self._threshold < 1.0 and self.mode == "partial" \
            and not self.inner.uniting_pays(layer, x_ND, ids_NK.numel())
        self._not_united += plain
        if self._threshold >= 1.0 or plain:
            busy = (counts_E > 0).sum()
            self._count([busy, 0, ids_NK.numel(), 0, 0], dev)
            self._plans[layer] = DevicePlan(counts_E, counts_E > 0, counts_E > 0,
                                            torch.zeros_like(busy, dtype=torch.bool)
                                            .expand(num_experts),
                                            torch.zeros(num_experts, dtype=torch.bool,
                                                        device=dev), busy * 0)
            return self._call_inner(layer, x_ND, ids_NK, w_NK, None)
        n_groups = len(self.grouping.groups[layer])
        plan = plan_layer_device(counts_E, self._threshold, gid_E, n_groups, self.mode)
        self._plans[layer] = plan
        orig_NK = plan.original_E[ids_NK]
        uni_NK = plan.united_E[ids_NK]
        if self.inner.skips_marked_pairs:
            # mark the pairs that go elsewhere (id E): the kernel skips them, so no
            # row selection and no host read
            with cpu_gemv.marked_pairs():
                y_ND = self._call_inner(layer, x_ND,
                                        torch.where(orig_NK, ids_NK, num_experts),
                                        torch.where(orig_NK, w_NK, 0), None)
        else:
            y_ND = self._selected(layer, x_ND, ids_NK, w_NK, orig_NK)
        if self.united is not None:
            y_ND = y_ND + self._united(layer, x_ND, w_NK, uni_NK, gid_E[ids_NK], n_groups)
        kept, united = orig_NK.sum(), uni_NK.sum()
        self._count([plan.original_E.sum(), plan.united_groups, kept, united,
                     ids_NK.numel() - kept - united], dev)
        return y_ND

    def _selected(self, layer: int, x_ND: torch.Tensor, ids_NK: torch.Tensor,
                  w_NK: torch.Tensor, orig_NK: torch.Tensor) -> torch.Tensor:
        """The kept pairs as rows of their own (K = 1) for an inner that cannot skip
        marked pairs (remote dispatch bills and ships rows): reads their positions."""
        y_ND = torch.zeros_like(x_ND)
        k = ids_NK.shape[1]
        orig_P = torch.nonzero(orig_NK.reshape(-1)).flatten()
        if orig_P.numel():
            tok_P = orig_P // k
            out_PD = self._call_inner(
                layer, x_ND[tok_P], ids_NK.reshape(-1)[orig_P, None],
                w_NK.reshape(-1)[orig_P, None], tok_P,
            )
            y_ND.index_add_(0, tok_P, out_PD.to(y_ND.dtype))
        return y_ND

    def _united(self, layer: int, x_ND: torch.Tensor, w_NK: torch.Tensor,
                uni_NK: torch.Tensor, grp_NK: torch.Tensor, n_groups: int) -> torch.Tensor:
        """Sum over united pairs of w * united[group](x), once per (token, group): a
        token's pairs in one group add their gate weights (eq. 5 summed per group) onto
        the first of them, the others are marked (id G) and skipped."""
        assert self.united is not None
        K = uni_NK.shape[1]
        same_NKK = (grp_NK[:, :, None] == grp_NK[:, None, :]) & uni_NK[:, :, None] \
            & uni_NK[:, None, :]
        w_sum_NK = (same_NKK.to(w_NK.dtype) * w_NK[:, None, :]).sum(-1)
        earlier_KK = torch.ones(K, K, dtype=torch.bool, device=uni_NK.device).tril(-1)
        first_NK = uni_NK & ~(same_NKK & earlier_KK).any(-1)
        gids_NK = torch.where(first_NK, grp_NK, n_groups)
        gw_NK = torch.where(first_NK, w_sum_NK, 0)
        stacked = self._stacked_united(layer)
        if stacked is not None and (self.united_kernel == "stacked"
                                    or self.inner.skips_marked_pairs):
            return fused_experts(x_ND, gids_NK, gw_NK, *stacked)
        # the per-module reference: select the (token, group) rows (reads their count)
        modules: Sequence[nn.Module] = self.united[layer]
        keep_P = torch.nonzero(first_NK.reshape(-1)).flatten()
        y_ND = torch.zeros_like(x_ND)
        if keep_P.numel():
            tok_U = keep_P // K
            out_UD = combine_experts(list(modules), x_ND[tok_U],
                                     gids_NK.reshape(-1)[keep_P, None],
                                     gw_NK.reshape(-1)[keep_P, None])
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
