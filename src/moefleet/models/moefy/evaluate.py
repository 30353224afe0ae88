"""Fidelity of a conversion: sentence embeddings of converted vs dense model."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from moefleet.models.moefy.model import BertMoEModel
from moefleet.models.moefy.source import tokenize


@torch.no_grad()
def sentence_embeddings(model: Any, tokenizer: Any, texts: list[str], max_length: int,
                        batch_size: int = 32, hf: bool = False) -> torch.Tensor:
    """Mean-pooled (over real tokens) last hidden states, one row per text."""
    out = []
    for i in range(0, len(texts), batch_size):
        enc = tokenize(tokenizer, texts[i : i + batch_size], max_length)
        if hf:
            h_BTD = model(**enc).last_hidden_state
        else:
            h_BTD = model(enc["input_ids"], enc["attention_mask"])
        m_BT1 = enc["attention_mask"][..., None].to(h_BTD.dtype)
        out.append((h_BTD * m_BT1).sum(1) / m_BT1.sum(1).clamp_min(1.0))
    return torch.cat(out)


@torch.no_grad()
def fidelity(moe: BertMoEModel, dense: Any, tokenizer: Any, texts: list[str],
             max_length: int, top_ks: list[int]) -> dict[str, float]:
    """Mean cosine similarity of converted vs dense sentence embeddings, per top-k.

    ``moe``'s own top_k is restored afterwards.
    """
    ref = sentence_embeddings(dense, tokenizer, texts, max_length, hf=True)
    keep = moe.config.top_k
    out: dict[str, float] = {}
    try:
        for k in top_ks:
            moe.set_top_k(k)
            emb = sentence_embeddings(moe, tokenizer, texts, max_length)
            out[f"top{k}"] = float(F.cosine_similarity(emb, ref, dim=-1).mean())
    finally:
        moe.set_top_k(keep)
    return out
