"""Shared by the plans-run tests: a tiny real MoE model, its routing, and running a plan
on a backend (the segment runner, real handlers)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

MB = 1 << 20


def tiny_adapter() -> Any:
    from moefleet.models.hf import HFMoEAdapter
    from moefleet.models.tiny import tiny_model

    return HFMoEAdapter(tiny_model("mixtral"))


def routed_counts(adapter: Any, ids_BT: torch.Tensor) -> np.ndarray:
    """d(e,i) of one batch: the router's real top-k choices, counted per expert."""
    layers = list(adapter.moe_layers)
    counts = np.zeros((len(layers), max(adapter.num_experts(x) for x in layers)), np.int64)
    hooks = []
    for li, layer in enumerate(layers):
        def hook(_m: Any, _i: Any, out: Any, li: int = li) -> None:
            ids = out[2].reshape(-1).numpy()
            counts[li] += np.bincount(ids, minlength=counts.shape[1])
        hooks.append(adapter.router_module(layer).register_forward_hook(hook))
    try:
        with torch.inference_mode():
            adapter.reference_forward(ids_BT)
    finally:
        for h in hooks:
            h.remove()
    return counts


def run_plan(adapter: Any, plan: Any, platform: Any, backend: Any, store: Any,
             ids_BT: torch.Tensor) -> Any:
    """Deploy ``plan`` on ``backend`` and run one batch through its segment functions;
    returns the batch's run (its output checked against the monolithic model)."""
    from tests.segment_helpers import segment_batches

    B, T = ids_BT.shape
    with segment_batches(adapter, plan, platform, backend, store, batch_size=B,
                         max_length=max(2, T)) as ex:
        res = ex.run_batch(ids_BT)
    assert (res.output - adapter.reference_forward(ids_BT)).abs().max() <= 1e-4
    return res
