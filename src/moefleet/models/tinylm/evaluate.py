"""Held-out evaluation of ``tiny-moe-lm``: perplexity, a unigram baseline, expert balance.

Shape legend: W evaluation windows, T window length, L tokens, V vocabulary, E experts.

Protocol (fixed, so numbers are comparable between builds of one tokenizer): take the
first ``n`` tokens of the held-out stream, cut them into ``W = n // T`` non-overlapping
windows of ``T`` tokens (the tail is dropped), score every token of a window but its
first from the tokens before it in the same window. Perplexity = exp(mean NLL) over the
``W * (T - 1)`` scored tokens; bits per byte divides the summed NLL by ln 2 and by the
UTF-8 bytes those tokens stand for, which makes tokenizers comparable.

The unigram baseline scores the same tokens with add-one-smoothed token frequencies of
the training stream. Expert balance counts, per MoE layer, the top-k assignments of
every evaluated token (each token counts K times).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from moefleet.models.tinylm.model import TinyMoELM

_EVAL_BATCH = 16


def windows(stream_L: torch.Tensor, n_tokens: int, seq_len: int) -> torch.Tensor:
    """ids_WT: the first ``n_tokens`` tokens (or all) cut into full windows of ``seq_len``."""
    n = min(n_tokens, stream_L.numel()) // seq_len * seq_len
    return stream_L[:n].view(-1, seq_len)


@torch.no_grad()
def evaluate(
    model: TinyMoELM,
    ids_WT: torch.Tensor,
    train_stream_L: torch.Tensor,
    bytes_V: torch.Tensor,
) -> dict[str, Any]:
    """Perplexity, bits per byte and balance of ``model`` (fp32) on ``ids_WT``, plus the
    unigram baseline on the same scored tokens. Empty ``ids_WT`` gives ``{"windows": 0}``."""
    if ids_WT.numel() == 0:
        return {"windows": 0}
    cfg = model.cfg
    model.eval()
    nll_sum = 0.0
    counts_LE = torch.zeros(cfg.layers, cfg.experts, dtype=torch.long)
    for start in range(0, ids_WT.shape[0], _EVAL_BATCH):
        batch_BT = ids_WT[start : start + _EVAL_BATCH]
        logits_BTV, stats = model(batch_BT)
        nll_sum += F.cross_entropy(
            logits_BTV[:, :-1].reshape(-1, cfg.vocab_size),
            batch_BT[:, 1:].reshape(-1),
            reduction="sum",
        ).item()
        counts_LE += torch.stack([s.counts_E for s in stats])
    targets = ids_WT[:, 1:].reshape(-1)
    scored = targets.numel()
    n_bytes = int(bytes_V[targets].sum())

    # Unigram baseline: add-one smoothing keeps unseen tokens finite.
    freq_V = torch.bincount(train_stream_L, minlength=cfg.vocab_size).double() + 1.0
    logp_V = (freq_V / freq_V.sum()).log()
    uni_sum = float(-logp_V[targets].sum())
    return {
        "windows": int(ids_WT.shape[0]),
        "window_tokens": int(ids_WT.shape[1]),
        "scored_tokens": scored,
        "scored_bytes": n_bytes,
        "perplexity": math.exp(nll_sum / scored),
        "bits_per_byte": nll_sum / math.log(2) / max(n_bytes, 1),
        "unigram_perplexity": math.exp(uni_sum / scored),
        "unigram_bits_per_byte": uni_sum / math.log(2) / max(n_bytes, 1),
        "balance": balance_report(counts_LE),
    }


def balance_report(counts_LE: torch.Tensor) -> list[dict[str, Any]]:
    """Per layer: share of assignments per expert, max/mean load ratio (1 = perfectly
    even, E/K = all on K experts), entropy of the shares in nats and normalised by ln E."""
    out = []
    experts = counts_LE.shape[1]
    for layer, counts_E in enumerate(counts_LE):
        share_E = counts_E.double() / counts_E.sum().clamp(min=1)
        nonzero = share_E[share_E > 0]
        entropy = float(-(nonzero * nonzero.log()).sum())
        out.append(
            {
                "layer": layer,
                "share": [round(float(s), 4) for s in share_E],
                "max_over_mean": float(share_E.max() * experts),
                "entropy_nats": entropy,
                "entropy_normalised": entropy / math.log(experts) if experts > 1 else 1.0,
            }
        )
    return out


@torch.no_grad()
def hf_max_abs_diff(model: TinyMoELM, hf: torch.nn.Module, ids_BT: torch.Tensor) -> float:
    """max |logits_ours - logits_hf| in fp32 on ``ids_BT`` (the conversion check)."""
    ours_BTV, _ = model.eval()(ids_BT)
    theirs_BTV = hf(input_ids=ids_BT, use_cache=False).logits
    return float((ours_BTV - theirs_BTV).abs().max())
