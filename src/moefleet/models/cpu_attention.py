"""Decode attention on the CPU as two batched products, not PyTorch's CPU flash kernel.

A decode step's attention is one query per row over that row's history. PyTorch's CPU
SDPA (``_scaled_dot_product_flash_attention_for_cpu``) runs it in blocks sized for long
queries: on the OLMoE-1B-7B shape (8 rows, 16 heads of 128, about 100 cached tokens,
bf16, one thread) 2.8 ms a call against 0.36 ms for ``q @ k^T``, a float32 softmax and
``p @ v`` (one-off measurement, 2026-11-29, median of 21), and a layer calls it once a
step: 5 ms of an 86 ms decode step on the 2-layer slice. :func:`decode_attention_forward`
is that product form for queries of one token on the CPU, and transformers' own SDPA
function for anything else (prefill, GPUs, softcapped or biased attention), so a model
keeps one attention implementation name for every step.

Invariants: the same numerics as transformers' eager attention (scores in the model's
dtype, softmax in float32, probabilities back in the model's dtype); grouped-query heads
share their key/value head without copying it (the query heads of a group become rows of
one product); a masked slot gets float32's lowest value, not minus infinity, so a query
with no visible slot (padding) comes out finite, never NaN; the value width may differ
from the key width (DeepSeek-V2's MLA).

How HF modules reach it: registered with transformers' ``AttentionInterface`` as
:data:`CPU_DECODE_IMPL`; the adapter calls a shallow copy of each attention module whose
config names it (:func:`moefleet.models.attention.with_implementation`), and only for
models whose own implementation is SDPA, whose masks it reads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

CPU_DECODE_IMPL = "moefleet_cpu_decode"


def takes(query: torch.Tensor, dropout: float, kwargs: dict[str, Any]) -> bool:
    """Whether the product form runs this call: one query token on the CPU, no dropout,
    no softcap, no position bias, no attention weights asked for."""
    return (query.device.type == "cpu" and query.shape[2] == 1 and not dropout
            and kwargs.get("softcap") is None and kwargs.get("position_bias") is None
            and not kwargs.get("output_attentions", False))


def decode_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None,
                             dropout: float = 0.0, scaling: float | None = None,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query [B, Hq, T, D]``, ``key [B, Hk,
    S, D]``, ``value [B, Hk, S, Dv]``, ``attention_mask`` SDPA's (boolean, True = visible,
    or additive float; ``[B or 1, 1 or Hq, T, S]``; None = all visible) -> ``([B, T, Hq,
    Dv], None)``."""
    if not takes(query, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    B, Hq, T, D = query.shape
    Hk, S = key.shape[1], key.shape[2]
    group = Hq // Hk
    scale = D ** -0.5 if scaling is None else scaling
    # heads of one group are consecutive in HF's layout (repeat_kv), so they are rows of
    # their key/value head's product
    q = query.reshape(B, Hk, group * T, D)
    # The gathered history is head-major in memory ([H, B, S, D] viewed [B, H, S, D]):
    # batching the products over (head, row) in that order reads it in place, where the
    # other order would copy it (measured: the copies cost more than the kernel saved)
    head_major = B > 1 and key.transpose(0, 1).is_contiguous() \
        and value.transpose(0, 1).is_contiguous()
    k, v = (key.transpose(0, 1), value.transpose(0, 1)) if head_major else (key, value)
    if head_major:
        q = q.transpose(0, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    if attention_mask is not None:
        m = _mask(attention_mask, Hk, group)  # [B, Hk or 1, group or 1, T, S]
        m = m.transpose(0, 1) if head_major else m
        scores = _apply(scores.view(*scores.shape[:2], group, T, S), m)
    probs = torch.softmax(scores.view(*q.shape[:2], group * T, S), dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [B, Hk, group * T, Dv], or [Hk, B, ...] head-major
    out = out.transpose(0, 1) if head_major else out
    return out.reshape(B, Hq, T, -1).transpose(1, 2).contiguous(), None


def _mask(mask: torch.Tensor, Hk: int, group: int) -> torch.Tensor:
    """SDPA's ``[B or 1, 1 or Hq, T, S]`` mask as ``[B or 1, Hk or 1, group or 1, T, S]``."""
    return mask[:, :, None] if mask.shape[1] == 1 else mask.unflatten(1, (Hk, group))


def _apply(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Float32 ``scores`` with a boolean (True = visible) or additive mask applied, in
    place; masked slots at float32's lowest value, never minus infinity."""
    low = torch.finfo(torch.float32).min
    if mask.dtype == torch.bool:
        return scores.masked_fill_(~mask, low)
    return scores.add_(mask.float()).clamp_(min=low)


AttentionInterface.register(CPU_DECODE_IMPL, decode_attention_forward)
