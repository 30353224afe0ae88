"""Contract every MoEModelAdapter must meet, run over each implementation.

Add an implementation by adding a factory to ``ADAPTER_FACTORIES``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from moefleet.models import MoEModelAdapter
from moefleet.models.base import param_bytes
from moefleet.models.hf import HFMoEAdapter
from moefleet.models.moefy import BertMoEAdapter, BertMoEConfig, BertMoEModel
from moefleet.models.tiny import tiny_model

DECODER_FAMILIES = ["mixtral", "qwen2_moe", "olmoe", "deepseek_v2"]


def _hf(family: str) -> Callable[[], MoEModelAdapter]:
    return lambda: HFMoEAdapter(tiny_model(family, vocab_size=512, seed=1), name=family)


def tiny_bert_moe() -> MoEModelAdapter:
    """The converted-BERT encoder family, randomised (expert tensors start at zero)."""
    cfg = BertMoEConfig(
        vocab_size=512, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, num_experts=4, top_k=2, max_position_embeddings=32,
    )
    model = BertMoEModel(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return BertMoEAdapter(model)


ADAPTER_FACTORIES: dict[str, Callable[[], MoEModelAdapter]] = {
    **{f: _hf(f) for f in DECODER_FAMILIES}, "bert_moe": tiny_bert_moe,
}


@pytest.fixture(params=sorted(ADAPTER_FACTORIES), scope="module")
def adapter(request: pytest.FixtureRequest) -> MoEModelAdapter:
    return ADAPTER_FACTORIES[request.param]()


def _batch(adapter: MoEModelAdapter) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(adapter.vocab_size, 500), (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding, as the profiler batches
    mask[2, 3:] = 0
    return ids, mask


def test_layerwise_forward_matches_model_forward(adapter: MoEModelAdapter) -> None:
    ids, mask = _batch(adapter)
    ref = adapter.reference_forward(ids, mask)
    got = adapter.forward_layerwise(ids, mask)
    valid = mask.bool()
    assert ref.shape == got.shape
    assert torch.max(torch.abs(ref - got)[valid]).item() <= 1e-5


def test_layerwise_forward_without_mask(adapter: MoEModelAdapter) -> None:
    ids, _ = _batch(adapter)
    assert torch.allclose(adapter.reference_forward(ids), adapter.forward_layerwise(ids), atol=1e-5)


def test_expert_fn_is_what_runs_the_experts(adapter: MoEModelAdapter) -> None:
    ids, mask = _batch(adapter)
    seen: list[tuple[int, int, int]] = []
    local = adapter.local_expert_fn()

    def spy(layer, x_ND, ids_NK, w_NK):
        seen.append((layer, x_ND.shape[0], ids_NK.shape[1]))
        return local(layer, x_ND, ids_NK, w_NK)

    same = adapter.forward_layerwise(ids, mask, expert_fn=spy)
    assert [s[0] for s in seen] == adapter.moe_layers
    # padding never reaches an expert function: only the mask's real tokens do
    assert all(n == int(mask.sum()) and k == adapter.top_k for _, n, k in seen)
    valid = mask.bool()
    ref = adapter.reference_forward(ids, mask)
    assert torch.max(torch.abs(same - ref)[valid]).item() <= 1e-5
    zeroed = adapter.forward_layerwise(
        ids, mask, expert_fn=lambda layer, x, i, w: torch.zeros_like(x)
    )
    assert not torch.allclose(zeroed[valid], same[valid], atol=1e-4)


def test_standalone_expert_matches_its_slice_and_owns_weights(adapter: MoEModelAdapter) -> None:
    layer = adapter.moe_layers[-1]
    x = torch.randn(5, adapter.hidden_size, generator=torch.Generator().manual_seed(2))
    for i in (0, adapter.num_experts(layer) - 1):
        standalone = adapter.expert(layer, i)
        view = adapter.expert_view(layer, i)
        assert torch.allclose(standalone(x), view(x), atol=1e-6)
        model_ptrs = {p.data_ptr() for p in adapter.model.parameters()}
        assert all(p.data_ptr() not in model_ptrs for p in standalone.parameters())
        assert param_bytes(standalone) > 0


def test_expert_outputs_recombine_to_the_moe_layer(adapter: MoEModelAdapter) -> None:
    """Sum over top-k of gate weight x standalone expert == the routed part of the layer."""
    layer = adapter.moe_layers[0]
    x = torch.randn(7, adapter.hidden_size, generator=torch.Generator().manual_seed(3))
    ids_NK, w_NK = adapter.route(layer, x)
    assert ids_NK.shape == (7, adapter.top_k) == w_NK.shape
    assert int(ids_NK.max()) < adapter.num_experts(layer)
    experts = adapter.expert_modules(layer)
    rows = []
    for n in range(7):
        outs = [w_NK[n, k] * experts[int(ids_NK[n, k])](x[n : n + 1])[0]
                for k in range(ids_NK.shape[1])]
        rows.append(torch.stack(outs).sum(0))
    manual = torch.stack(rows)
    fused = adapter.local_expert_fn()(layer, x, ids_NK, w_NK)
    assert torch.allclose(manual, fused, atol=1e-5)


def test_segments_partition_the_parameters(adapter: MoEModelAdapter) -> None:
    """Segments + experts hold every parameter of the model exactly once."""
    seg_bytes = sum(param_bytes(adapter.segment(layer)) for layer in range(adapter.num_layers))
    expert_bytes = sum(
        param_bytes(adapter.expert_view(layer, i))
        for layer in adapter.moe_layers
        for i in range(adapter.num_experts(layer))
    )
    total = param_bytes(adapter.model)
    tied = getattr(adapter.model.config, "tie_word_embeddings", False)
    if not tied:
        assert seg_bytes + expert_bytes == total
    s = adapter.summary()
    assert s.expert_param_bytes == expert_bytes
    assert s.num_experts == [adapter.num_experts(layer) for layer in adapter.moe_layers]


def test_router_and_attention_conventions(adapter: MoEModelAdapter) -> None:
    ids, mask = _batch(adapter)
    layer = adapter.moe_layers[0]
    captured: dict[str, object] = {}
    h1 = adapter.router_module(layer).register_forward_hook(
        lambda m, a, out: captured.__setitem__("router", out)
    )
    h2 = adapter.attention_module(layer).register_forward_hook(
        lambda m, a, out: captured.__setitem__("attn", out)
    )
    try:
        with adapter.eager_attention():
            adapter.reference_forward(ids, mask)
    finally:
        h1.remove()
        h2.remove()
    logits, weights, eids = captured["router"]  # type: ignore[misc]
    assert logits.shape == (ids.numel(), adapter.num_experts(layer))
    assert weights.shape == eids.shape == (ids.numel(), adapter.top_k)
    probs = captured["attn"][1]  # type: ignore[index]
    assert probs is not None and probs.shape[0] == 3 and probs.shape[-1] == ids.shape[1]
    # padded keys never receive attention
    assert torch.all(probs[2, :, :3, 3:] == 0)
    assert torch.allclose(probs[0].sum(-1), torch.ones_like(probs[0].sum(-1)), atol=1e-5)
