"""compare prices the real shapes from their published configs (counted on ``meta``)."""

from __future__ import annotations

import pytest

from moefleet.compare.shapes import known_models, model_bytes, resolve_dims


@pytest.mark.parametrize(("name", "layers", "experts", "top_k", "ffn", "billions"), [
    ("qwen1.5-moe-a2.7b", 24, 60, 4, 1408, 14.3),  # published: 14.3B parameters
    ("mixtral-8x7b", 32, 8, 2, 14336, 46.7),  # 46.7B
    ("olmoe-1b-7b", 16, 64, 8, 1024, 6.9),  # 6.9B
])
def test_real_shape_dims_match_the_published_model(name: str, layers: int, experts: int,
                                                   top_k: int, ffn: int,
                                                   billions: float) -> None:
    d = resolve_dims(name)
    assert (d.moe_layers, d.experts, d.top_k, d.expert_intermediate) == (layers, experts,
                                                                        top_k, ffn)
    assert model_bytes(d) / d.bytes_per_param / 1e9 == pytest.approx(billions, rel=0.01)
    assert name in known_models()


def test_the_planners_deepseek_shape_keeps_precedence() -> None:
    # the analytical shape carries MLA's compressed KV cache, which a K/V count would miss
    assert resolve_dims("deepseek-v2-lite").kv_bytes_per_token == 27 * (512 + 64) * 2.0
