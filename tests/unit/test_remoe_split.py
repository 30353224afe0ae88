"""SplitExperts (Remoe): local and remote halves of a layer, each seeing only its own slots."""

from __future__ import annotations

import torch

from moefleet.experts.kernels import in_process_experts
from moefleet.experts.split import SKIP, SplitExperts, held_experts, mask_ids
from moefleet.models.hf import HFMoEAdapter
from moefleet.models.tiny import tiny_model


def test_mask_ids_keeps_only_chosen_experts() -> None:
    ids = torch.tensor([[0, 3], [2, -1], [3, 1]])
    keep = torch.tensor([True, False, False, True])
    assert mask_ids(ids, keep).tolist() == [[0, 3], [-1, -1], [3, -1]]


def test_split_equals_all_local_and_never_crosses_sides() -> None:
    adapter = HFMoEAdapter(tiny_model("mixtral"))
    layer = adapter.moe_layers[0]
    every = in_process_experts(adapter, "loop")
    local_set = {0, 1, 2}
    held = {layer: {e: adapter.expert_view(layer, e) for e in local_set}}
    # the remote side: every expert in process (it must still skip the -1 slots)
    remote = held_experts({layer: {e: adapter.expert_view(layer, e)
                                   for e in range(adapter.num_experts(layer))}})
    seen: dict[str, set[int]] = {"local": set(), "remote": set()}

    def spy(side: str, fn):  # records which expert ids each side is given
        def run(lay, x, ids, w):
            seen[side] |= {int(e) for e in ids.unique().tolist() if e != SKIP}
            return fn(lay, x, ids, w)
        return run

    keep = torch.zeros(adapter.num_experts(layer), dtype=torch.bool)
    keep[sorted(local_set)] = True
    split = SplitExperts(spy("local", held_experts(held)), spy("remote", remote),
                         {layer: keep})
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, adapter.hidden_size, generator=g)
    ids = torch.randint(0, adapter.num_experts(layer), (12, 2), generator=g)
    w = torch.rand(12, 2, generator=g)
    torch.testing.assert_close(split(layer, x, ids, w), every(layer, x, ids, w),
                               rtol=1e-5, atol=1e-6)
    assert seen["local"] <= local_set and seen["remote"].isdisjoint(local_set)
    assert seen["remote"]  # the draw routed some slots to remote experts
