"""Remoe's expert seam: the main function's local experts and its remote expert functions,
run concurrently per layer and summed (:class:`SplitExperts`).

Invariants: a token-slot routed to a local expert reaches only ``local`` and one routed to
a remote expert only ``remote``; the other side sees it as id -1 (skipped, contributes 0),
so the local side never computes a remote expert and no remote function is sent a local
one. ``y = local(...) + remote(...)`` equals running every expert in one place, up to fp32
summation order. Shape legend: N tokens, D hidden, K experts per token, E experts.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from moefleet.experts.stack import ExpertStack, as_stack
from moefleet.models.base import ExpertFn

SKIP = -1  # an expert id the receiving side skips


def mask_ids(ids_NK: torch.Tensor, keep_E: torch.Tensor) -> torch.Tensor:
    """``ids_NK`` with every slot whose expert is not in ``keep_E`` (bool [E]) set to -1."""
    safe_NK = ids_NK.clamp(min=0)
    keep_NK = keep_E[safe_NK] & (ids_NK >= 0)
    return torch.where(keep_NK, ids_NK, torch.full_like(ids_NK, SKIP))


def held_experts(modules: Mapping[int, Mapping[int, nn.Module]]) -> ExpertFn:
    """An ExpertFn over the expert modules this process holds (``modules[layer][e]``);
    slots with id -1 are skipped, any other id not held is an error (the caller routed
    a remote expert here)."""

    def run(layer: int, x_ND: torch.Tensor, ids_NK: torch.Tensor,
            w_NK: torch.Tensor) -> torch.Tensor:
        held = modules.get(layer, {})
        y_ND = torch.zeros_like(x_ND)
        present = [int(e) for e in torch.unique(ids_NK).tolist() if e != SKIP]
        missing = [e for e in present if e not in held]
        if missing:
            raise ValueError(f"layer {layer}: experts {missing} are not held here "
                             f"(held: {sorted(held)})")
        with torch.no_grad():
            for e in present:
                n_idx, k_idx = torch.nonzero(ids_NK == e, as_tuple=True)
                out = held[e](x_ND[n_idx]) * w_NK[n_idx, k_idx, None].to(x_ND.dtype)
                y_ND.index_add_(0, n_idx, out.to(y_ND.dtype))
        return y_ND

    return run


class SplitExperts(ExpertStack):
    """Remoe's split (see the module docstring). Experts run on ``expert_device`` (the
    CPU: local experts live in host memory and remote ones travel as NumPy), so when the
    layer loop runs elsewhere (non-experts on CUDA) the token rows cross to it before the
    split and the summed result crosses back; on the same device both moves are no-ops.
    Both halves see the same token rows, so owners reach both unchanged."""

    def __init__(self, local: ExpertStack | ExpertFn, remote: ExpertStack | ExpertFn,
                 is_local: Mapping[int, torch.Tensor], *,
                 pool: ThreadPoolExecutor | None = None,
                 expert_device: torch.device | str = "cpu") -> None:
        self.local, self.remote = as_stack(local), as_stack(remote)
        self.inners = (self.local, self.remote)
        self.is_local = is_local
        self._own_pool = pool is None
        self.helper = pool or ThreadPoolExecutor(1, thread_name_prefix="moefleet-remoe-remote")
        self.expert_device = torch.device(expert_device)

    def close(self) -> None:
        if self._own_pool:
            self.helper.shutdown(wait=True)
        super().close()

    def __call__(self, layer: int, x_ND: torch.Tensor, ids_NK: torch.Tensor,
                 w_NK: torch.Tensor) -> torch.Tensor:
        home = x_ND.device
        dev = self.expert_device
        x_ND, ids_NK, w_NK = x_ND.to(dev), ids_NK.to(dev), w_NK.to(dev)
        keep_E = self.is_local.get(layer)
        if keep_E is None or bool(keep_E.all()):
            return self.local(layer, x_ND, ids_NK, w_NK).to(home)
        keep_E = keep_E.to(dev)
        remote_ids_NK = mask_ids(ids_NK, ~keep_E)
        local_ids_NK = mask_ids(ids_NK, keep_E)
        pending = None
        if bool((remote_ids_NK != SKIP).any()):
            pending = self.helper.submit(self.remote, layer, x_ND, remote_ids_NK, w_NK)
        try:
            y_ND = self.local(layer, x_ND, local_ids_NK, w_NK)
        finally:
            remote_ND = pending.result() if pending is not None else None
        y_ND = y_ND if remote_ND is None else y_ND + remote_ND.to(y_ND.dtype)
        return y_ND.to(home)
