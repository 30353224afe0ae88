"""In-process expert functions (``ExpertFn``), two kernels with the same result:

- ``"loop"``: one call per expert on its tokens (BrownoutServe's "non-fused" baseline);
- ``"stacked"``: every expert of a layer in one pair of batched matmuls over the layer's
  stacked weights, tokens grouped by expert and padded to the largest group ("fused").

Shape legend: N tokens, K experts per token, D hidden, F expert intermediate size,
E experts in the layer, C tokens of the largest expert group.
"""

from __future__ import annotations

from typing import Literal

import torch

from moefleet.errors import MoefleetError
from moefleet.models.base import ExpertFn, MoEModelAdapter

Kernel = Literal["auto", "loop", "stacked"]
KERNELS: tuple[Kernel, ...] = ("auto", "loop", "stacked")


def in_process_experts(adapter: MoEModelAdapter, kernel: Kernel = "auto") -> ExpertFn:
    """Every routed expert of ``adapter`` in this process, computed with ``kernel``.

    ``auto``: the stacked kernel on a GPU (one launch instead of one per expert) and
    the loop on a CPU, where launches are cheap and the stacked kernel's padding to the
    largest group is wasted arithmetic (measured: benchmarks/engine_throughput.py).
    """
    if kernel == "auto":
        on_gpu = adapter.device.type != "cpu"
        kernel = "stacked" if on_gpu and adapter.stacked_expert_weights(adapter.moe_layers[0]) \
            is not None else "loop"
    if kernel == "loop":
        return adapter.local_expert_fn()
    if kernel != "stacked":
        raise MoefleetError(f"unknown expert kernel {kernel!r}", f"use one of {list(KERNELS)}")
    if adapter.stacked_expert_weights(adapter.moe_layers[0]) is None:
        raise MoefleetError(
            f"{adapter.family} keeps no stacked expert weights, so the stacked kernel "
            "cannot run it", "use kernel='loop'")

    def run(layer: int, x_ND: torch.Tensor, ids_NK: torch.Tensor,
            w_NK: torch.Tensor) -> torch.Tensor:
        stacked = adapter.stacked_expert_weights(layer)
        assert stacked is not None  # checked for the model above
        gate_up_E2FD, down_EDF, act = stacked
        return grouped_matmul(x_ND, ids_NK, w_NK, gate_up_E2FD, down_EDF, act)

    return run


def grouped_matmul(x_ND: torch.Tensor, ids_NK: torch.Tensor, w_NK: torch.Tensor,
                   gate_up_E2FD: torch.Tensor, down_EDF: torch.Tensor, act) -> torch.Tensor:
    """y_N = sum_k w_NK * expert_{ids_NK}(x_N) with two ``bmm`` calls for all experts."""
    N, K = ids_NK.shape
    E, D = gate_up_E2FD.shape[0], x_ND.shape[1]
    if N == 0:
        return torch.zeros_like(x_ND)
    flat = ids_NK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    counts_E = torch.bincount(flat, minlength=E)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank = torch.arange(N * K, device=x_ND.device) - starts_E[sorted_e]
    token = order // K
    C = int(counts_E.max())
    x_ECD = x_ND.new_zeros(E, C, D)
    x_ECD[sorted_e, rank] = x_ND[token]
    gate_ECF, up_ECF = torch.bmm(x_ECD, gate_up_E2FD.transpose(1, 2)).chunk(2, dim=-1)
    y_ECD = torch.bmm(act(gate_ECF) * up_ECF, down_EDF.transpose(1, 2))
    slots = y_ECD[sorted_e, rank] * w_NK.reshape(-1)[order, None].to(x_ND.dtype)
    # back to (token, k) order, then sum over k: no scatter-add needed
    y_NKD = torch.empty(N * K, D, dtype=x_ND.dtype, device=x_ND.device)
    y_NKD[order] = slots.to(x_ND.dtype)
    return y_NKD.view(N, K, D).sum(dim=1)
