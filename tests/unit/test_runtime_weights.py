"""Per-function weights and meta-device skeletons reproduce the model exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moefleet.errors import UnsupportedModelError
from moefleet.models.hf import HFMoEAdapter
from moefleet.models.tiny import tiny_model
from moefleet.platform import LocalObjectStore
from moefleet.runtime import weights as W


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe", "deepseek_v2"])
def test_skeleton_plus_function_weights_equals_the_model(family: str) -> None:
    adapter = HFMoEAdapter(tiny_model(family))
    skel = W.build_skeleton(W.skeleton_json(adapter))
    assert all(p.device.type == "meta" for p in skel.model.parameters())
    for block in range(adapter.num_layers):
        W.assign_tensors(skel.model, W.from_bytes(W.to_bytes(W.segment_tensors(adapter, block))))
    experts = {
        (layer, i): W.load_expert(skel, layer, i, W.from_bytes(W.to_bytes(
            W.expert_tensors(adapter, layer, i))))
        for layer in adapter.moe_layers for i in range(adapter.num_experts(layer))
    }
    # Every non-expert tensor is materialised; stacked expert weights stay on meta.
    meta = [n for n, p in skel.model.named_parameters() if p.device.type == "meta"]
    assert meta and all(".experts." in n for n in meta)

    from moefleet.models.base import combine_experts

    def fn(layer: int, x, ids, w):
        mods = [experts[(layer, i)] for i in range(adapter.num_experts(layer))]
        return combine_experts(mods, x, ids, w)

    ids = torch.randint(0, 1000, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    want = adapter.reference_forward(ids, mask)
    got = skel.forward_layerwise(ids, mask, expert_fn=fn)
    assert (got - want)[mask.bool()].abs().max() <= 1e-5  # padding never reaches experts


def test_segments_hold_only_their_block(tmp_path: Path) -> None:
    adapter = HFMoEAdapter(tiny_model("mixtral"))
    seg1 = W.segment_tensors(adapter, 1)
    assert seg1 and all(n.startswith("model.layers.1.") or "rotary" in n for n in seg1)
    assert not any(".experts." in n for n in seg1)
    assert any("rotary" in n for n in W.segment_tensors(adapter, 0))
    assert all("rotary" in n for n in set(seg1) - {n for n in seg1 if ".layers.1." in n})
    layout = W.upload_model(adapter, LocalObjectStore(tmp_path), "dep")
    assert len(layout.segments) == 3 and len(layout.experts) == 24
    assert layout.expert_key(2, 7) == "dep/model/exp-2-7.safetensors"
    assert W.ModelLayout.from_dict(layout.to_dict()) == layout


def test_unknown_adapters_and_formats_are_refused() -> None:
    class Other:
        name = "x"

    with pytest.raises(UnsupportedModelError, match="Other"):
        W.skeleton_json(Other())  # type: ignore[arg-type]
    with pytest.raises(UnsupportedModelError, match="format"):
        W.build_skeleton(b'{"format": 99, "kind": "hf"}')


def tiny_bert_moe(seed: int = 0):
    """A small random BertMoE (the family of the default model minilm-moe-e8)."""
    from moefleet.models.moefy.adapter import BertMoEAdapter
    from moefleet.models.moefy.model import BertMoEConfig, BertMoEModel

    torch.manual_seed(seed)
    model = BertMoEModel(BertMoEConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, intermediate_size=64,
                                       num_experts=4, top_k=2, max_position_embeddings=64))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return BertMoEAdapter(model, None, name="tiny-bert-moe")


def test_bert_moe_skeleton_equals_the_model() -> None:
    from moefleet.models.base import combine_experts

    adapter = tiny_bert_moe()
    skel = W.build_skeleton(W.skeleton_json(adapter))
    for block in range(adapter.num_layers):
        W.assign_tensors(skel.model, W.segment_tensors(adapter, block))
    mods = {(layer, i): W.load_expert(skel, layer, i, W.expert_tensors(adapter, layer, i))
            for layer in adapter.moe_layers for i in range(4)}
    ids = torch.randint(0, 120, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0
    got = skel.forward_layerwise(ids, mask, expert_fn=lambda layer, x, i, w: combine_experts(
        [mods[(layer, e)] for e in range(4)], x, i, w))
    assert (got - adapter.reference_forward(ids, mask))[mask.bool()].abs().max() <= 1e-5
