"""Decode attention on the CPU as two products (``models.cpu_attention``).

It equals the float64 attention of the same inputs for multi-head and grouped-query
heads, key/value histories laid out batch- or head-major, boolean, additive, per-head
and absent masks, and a value width unlike the key's (MLA); a query with no visible slot
comes out finite; anything but a one-token CPU query is transformers' SDPA itself; and a
model's decode steps go through it, with the logits SDPA gives.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from moefleet.models import cpu_attention
from moefleet.models.cpu_attention import decode_attention_forward
from moefleet.models.hf import HFMoEAdapter
from moefleet.models.kv import KVCache
from moefleet.models.step import StepInput
from moefleet.models.tiny import tiny_model


def _module(groups: int) -> nn.Module:
    m = nn.Module()
    m.num_key_value_groups = groups  # type: ignore[assignment]
    m.is_causal = True  # type: ignore[assignment]
    return m


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float) -> torch.Tensor:
    """Float64 attention, key/value heads repeated per group: ``[B, T, Hq, Dv]``."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    s = q.double() @ k.transpose(-1, -2) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return (s.softmax(-1) @ v).transpose(1, 2)


def _history(B: int, H: int, S: int, D: int, head_major: bool, g: torch.Generator
             ) -> torch.Tensor:
    if head_major:  # as the gather path hands it: [H, B, S, D] viewed [B, H, S, D]
        return torch.randn(H, B, S, D, generator=g).transpose(0, 1)
    return torch.randn(B, H, S, D, generator=g)


@pytest.mark.parametrize(("B", "Hq", "Hk", "D", "Dv", "head_major", "mask_kind"), [
    (3, 4, 4, 16, 16, False, "bool"),
    (3, 8, 2, 16, 16, True, "additive"),  # grouped-query heads, head-major history
    (1, 4, 4, 16, 16, True, "none"),  # one row: batch-major whatever its strides
    (2, 8, 2, 16, 16, False, "per_head"),
    (2, 4, 4, 24, 16, True, "bool"),  # MLA: values narrower than keys
])
def test_it_equals_float64_attention(B: int, Hq: int, Hk: int, D: int, Dv: int,
                                     head_major: bool, mask_kind: str) -> None:
    g = torch.Generator().manual_seed(B * 100 + Hq)
    S = 7
    q = torch.randn(B, Hq, 1, D, generator=g)
    k = _history(B, Hk, S, D, head_major, g)
    v = _history(B, Hk, S, Dv, head_major, g)
    visible = torch.rand(B, 1, 1, S, generator=g) > 0.3
    visible[..., 0] = True  # every query sees its first slot
    mask: torch.Tensor | None = {
        "bool": visible,
        "additive": torch.where(visible, 0.0, torch.finfo(torch.float32).min),
        "none": None,
        "per_head": visible.expand(B, Hq, 1, S) & (torch.rand(B, Hq, 1, S, generator=g) > 0.2)
        | torch.arange(S).eq(0),
    }[mask_kind]
    got, weights = decode_attention_forward(_module(Hq // Hk), q, k, v, mask, scaling=0.3)
    assert weights is None and got.shape == (B, 1, Hq, Dv) and got.is_contiguous()
    torch.testing.assert_close(got.double(), _reference(q, k, v, mask, 0.3),
                               rtol=1e-5, atol=1e-5)


def test_a_query_with_no_visible_slot_comes_out_finite() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 8, generator=g) for n in (1, 5, 5))
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    mask[1] = False  # row 1: padding
    got, _ = decode_attention_forward(_module(1), q, k, v, mask)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[0:1].double(),
                               _reference(q[0:1], k[0:1], v[0:1], mask[0:1], 8 ** -0.5))


@pytest.mark.parametrize("case", ["prefill", "softcap", "dropout"])
def test_anything_else_is_sdpa_itself(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(1)
    T = 3 if case == "prefill" else 1
    q, k, v = torch.randn(2, 4, T, 8, generator=g), *(torch.randn(2, 4, 6, 8, generator=g)
                                                       for _ in range(2))
    kw = {"softcap": 30.0} if case == "softcap" else {}
    dropout = 0.5 if case == "dropout" else 0.0
    calls: list[int] = []

    def sdpa(*args: object, **kwargs: object) -> tuple[torch.Tensor, None]:
        calls.append(1)
        return torch.zeros(1), None

    if case == "prefill":  # the real one: the very same result
        want, _ = sdpa_attention_forward(_module(1), q, k, v, None)
        assert torch.equal(decode_attention_forward(_module(1), q, k, v, None)[0], want)
    monkeypatch.setattr(cpu_attention, "sdpa_attention_forward", sdpa)
    decode_attention_forward(_module(1), q, k, v, None, dropout=dropout, **kw)
    assert calls == [1]
    assert not cpu_attention.takes(q, dropout, kw)


def test_a_models_decode_steps_take_it_with_sdpas_logits(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Every decoder family (grouped-query heads; DeepSeek-V2's MLA): the decode step's
    logits equal those with the product form turned off (SDPA), and every layer's decode
    attention went through it."""
    original = cpu_attention.takes
    for family in ("mixtral", "qwen2_moe", "olmoe", "deepseek_v2"):
        logits = {}
        for on in (True, False):
            adapter = HFMoEAdapter(tiny_model(family, vocab_size=128, seed=5))
            assert adapter.config._attn_implementation == "sdpa"
            taken: list[int] = []

            def spy(q: torch.Tensor, dropout: float, kwargs: dict, on: bool = on,
                    taken: list[int] = taken) -> bool:
                took = on and original(q, dropout, kwargs)
                taken.append(int(took))
                return took

            monkeypatch.setattr(cpu_attention, "takes", spy)
            cache = KVCache(adapter.kv_layout(), num_blocks=8, block_size=4)
            for s in (0, 1):
                cache.alloc(s)
            adapter.forward_step(StepInput.from_lists([0, 1], [[1, 2, 3, 4, 5], [6, 7]],
                                                      [0, 0]), cache)
            taken.clear()
            out = adapter.forward_step(StepInput.from_lists([0, 1], [[9], [10]], [5, 2]),
                                       cache)
            logits[on] = out.last_logits_BV
            assert taken == [int(on)] * adapter.num_layers
        torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)
