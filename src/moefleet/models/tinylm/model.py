"""The training-time model of ``tiny-moe-lm``: a Mixtral-shaped decoder built for CPU training.

Shape legend (suffixes on tensor names):
    B batch, T sequence length, N tokens flattened (B*T), D hidden size, F expert
    intermediate size, E experts per layer, K experts per token (top-k), S = N*K routed
    (token, expert) pairs, R rows of the padded expert-major buffer (R >= S), H query
    heads, G key/value heads, C head dim, X = (H + 2G) * C fused q/k/v width, V vocabulary,
    P positions (max sequence length).

One MoE layer, as a pipeline:

    x_ND -> gate -> softmax -> top-k (renormalised) -> sort pairs by expert (padded)
         -> per-expert matmuls on contiguous slices -> gather back -> weight -> sum over K

Why a separate module rather than training ``MixtralForCausalLM`` directly: every weight
here is stored in exactly the HF layout (``w13_E2FD`` == ``gate_up_proj``, ``w2_EDF`` ==
``down_proj``), so conversion is a copy, but the compute is arranged for bf16 autocast on
CPU (oneDNN/AMX matmuls): q/k/v in one matmul, expert slices padded to a few repeating
shapes, attention as two matmuls, and the balance loss taken from the routing already
done. Invariant (tested): after :func:`moefleet.models.tinylm.convert.to_hf`, HF logits
equal this module's fp32 logits to 1e-4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from moefleet.models.tinylm.bf16 import lower_precision_matmuls


@dataclass(frozen=True)
class ModelConfig:
    """Architecture. ``hidden % heads == 0`` and ``heads % kv_heads == 0`` (validated by
    :mod:`moefleet.models.tinylm.recipe`, not here)."""

    vocab_size: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    experts: int
    top_k: int
    max_positions: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, normalised in fp32 like HF's ``MixtralRMSNorm``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x32_BTD = x_BTD.float()
        x32_BTD = x32_BTD * torch.rsqrt(x32_BTD.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32_BTD.to(x_BTD.dtype)


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_PC, sin_PC in HF's non-interleaved convention: ``cat(freqs, freqs)``."""
    c = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, c, 2, dtype=torch.float32) / c))
    freqs_PC = torch.arange(cfg.max_positions, dtype=torch.float32)[:, None] * inv_freq[None]
    emb_PC = torch.cat([freqs_PC, freqs_PC], dim=-1)
    return emb_PC.cos(), emb_PC.sin()


def apply_rope(x_BHTC: torch.Tensor, cos_TC: torch.Tensor, sin_TC: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + C/2): the ``rotate_half`` form HF Mixtral uses."""
    half = x_BHTC.shape[-1] // 2
    rotated_BHTC = torch.cat([-x_BHTC[..., half:], x_BHTC[..., :half]], dim=-1)
    return x_BHTC * cos_TC + rotated_BHTC * sin_TC


def _explicit_causal_attention(
    q_BHTC: torch.Tensor, k_BGTC: torch.Tensor, v_BGTC: torch.Tensor, groups: int
) -> torch.Tensor:
    """softmax(q k^T / sqrt(C) + causal mask) v with the two products as plain matmuls.

    Used under bf16 autocast (native or emulated): the products then run as bf16 (AMX)
    matmuls and the softmax in fp32, whereas the CPU flash kernel's bf16 backward is
    several times slower at these sizes (measured at T=128, C=64).
    """
    t, c = q_BHTC.shape[-2], q_BHTC.shape[-1]
    k_BHTC = k_BGTC.repeat_interleave(groups, dim=1)
    v_BHTC = v_BGTC.repeat_interleave(groups, dim=1)
    scores_BHTT = torch.matmul(q_BHTC, k_BHTC.transpose(-1, -2)).float() * c**-0.5
    future_TT = torch.ones(t, t, dtype=torch.bool, device=q_BHTC.device).triu(1)
    probs_BHTT = scores_BHTT.masked_fill(future_TT, float("-inf")).softmax(-1)
    return torch.matmul(probs_BHTT.to(v_BHTC.dtype), v_BHTC)


class Attention(nn.Module):
    """Causal grouped-query attention; q, k, v come out of one fused matmul."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        c = cfg.head_dim
        # Rows: H*C query, then G*C key, then G*C value (split again by convert.to_hf).
        self.wqkv = nn.Linear(cfg.hidden, (cfg.heads + 2 * cfg.kv_heads) * c, bias=False)
        self.wo = nn.Linear(cfg.heads * c, cfg.hidden, bias=False)

    def forward(
        self, x_BTD: torch.Tensor, cos_TC: torch.Tensor, sin_TC: torch.Tensor
    ) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x_BTD.shape
        c = cfg.head_dim
        qkv_BTX = self.wqkv(x_BTD)
        q_BTHC, k_BTGC, v_BTGC = qkv_BTX.split(
            [cfg.heads * c, cfg.kv_heads * c, cfg.kv_heads * c], dim=-1
        )
        q_BHTC = q_BTHC.reshape(b, t, cfg.heads, c).transpose(1, 2)
        k_BGTC = k_BTGC.reshape(b, t, cfg.kv_heads, c).transpose(1, 2)
        v_BGTC = v_BTGC.reshape(b, t, cfg.kv_heads, c).transpose(1, 2)
        q_BHTC = apply_rope(q_BHTC, cos_TC, sin_TC)
        k_BGTC = apply_rope(k_BGTC, cos_TC, sin_TC)
        if lower_precision_matmuls():
            out_BHTC = _explicit_causal_attention(q_BHTC, k_BGTC, v_BGTC, cfg.heads // cfg.kv_heads)
        else:
            out_BHTC = F.scaled_dot_product_attention(
                q_BHTC, k_BGTC, v_BGTC, is_causal=True, enable_gqa=cfg.kv_heads != cfg.heads
            )
        return self.wo(out_BHTC.transpose(1, 2).reshape(b, t, cfg.heads * c))


# Per-expert row counts are padded to a multiple of this: oneDNN's bf16 (AMX) matmul
# builds and caches a kernel per shape, and an unpadded count is a new shape almost
# every step (measured: ~4x slower expert matmuls). Padding wastes < E*32 rows.
ROW_BUCKET = 32


@dataclass
class RoutingStats:
    """What one MoE layer reports besides its output: the balance loss term (a tensor
    in the autograd graph) and the per-expert count of routed pairs (sums to N*K)."""

    aux_loss: torch.Tensor
    counts_E: torch.Tensor


class MoE(nn.Module):
    """Top-k routed SwiGLU experts with stacked weights in HF's fused layout.

    ``w13_E2FD[e]`` is ``cat(gate_FD, up_FD)``; ``w2_EDF[e]`` the down projection. Gate
    weights are softmax probabilities of the chosen experts renormalised to sum to 1
    (Mixtral's rule), computed in fp32.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.w13_E2FD = nn.Parameter(torch.empty(cfg.experts, 2 * cfg.ffn, cfg.hidden))
        self.w2_EDF = nn.Parameter(torch.empty(cfg.experts, cfg.hidden, cfg.ffn))

    def route(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probs_NE fp32, weights_NK fp32 summing to 1 per token, ids_NK)."""
        probs_NE = F.softmax(self.gate(x_ND).float(), dim=-1)
        weights_NK, ids_NK = torch.topk(probs_NE, self.cfg.top_k, dim=-1)
        return probs_NE, weights_NK / weights_NK.sum(-1, keepdim=True), ids_NK

    def dispatch(self, ids_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Where every routed pair goes in the expert-major padded buffer.

        Returns (pos_NK, src_R, rows_E): pair (n, k) sits in row ``pos_NK[n, k]`` of a
        buffer of R rows in which expert e owns ``rows_E[e]`` consecutive rows, its pairs
        first (in token order), then padding; ``src_R[r]`` is the token feeding row r, or
        N (a zero row) for padding. ``rows_E[e]`` is e's pair count rounded up to
        ``ROW_BUCKET``, so per-expert matmul shapes come from a small set.
        """
        n, k = ids_NK.shape
        ids_S = ids_NK.reshape(-1)
        # Stable sort: within an expert, pairs keep token order (deterministic layout).
        order_S = torch.argsort(ids_S, stable=True)
        counts_E = torch.bincount(ids_S, minlength=self.cfg.experts)
        rows_E = (counts_E + ROW_BUCKET - 1) // ROW_BUCKET * ROW_BUCKET
        first_pair_E = torch.cumsum(counts_E, 0) - counts_E
        first_row_E = torch.cumsum(rows_E, 0) - rows_E
        sorted_ids_S = ids_S[order_S]
        pair_S = torch.arange(n * k, device=ids_S.device)
        rank_S = pair_S - first_pair_E[sorted_ids_S]
        pos_S = torch.empty_like(order_S)
        pos_S[order_S] = first_row_E[sorted_ids_S] + rank_S
        src_R = torch.full((int(rows_E.sum()),), n, dtype=torch.long, device=ids_S.device)
        src_R[pos_S] = pair_S // k
        return pos_S.view(n, k), src_R, rows_E.tolist()

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, RoutingStats]:
        cfg = self.cfg
        n, k = x_ND.shape[0], cfg.top_k
        probs_NE, weights_NK, ids_NK = self.route(x_ND)
        pos_NK, src_R, rows_E = self.dispatch(ids_NK)
        # Gather once into expert-major order (padding rows read an appended zero row);
        # every expert then runs one matmul pair on its contiguous slice.
        xs_RD = torch.cat([x_ND, x_ND.new_zeros(1, x_ND.shape[1])])[src_R]
        outs: list[torch.Tensor] = []
        # unbind, not w[e]: indexing a parameter per expert makes autograd allocate and
        # sum E full-size zero gradients; unbind's backward stacks the E slices once.
        slices = zip(
            xs_RD.split(rows_E), self.w13_E2FD.unbind(0), self.w2_EDF.unbind(0), strict=True
        )
        for xe_rD, w13_2FD, w2_DF in slices:
            if xe_rD.shape[0] == 0:
                continue
            gate_rF, up_rF = F.linear(xe_rD, w13_2FD).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate_rF) * up_rF, w2_DF))
        ys_RD = torch.cat(outs)
        # Gather each pair's row back and sum the K copies: no scatter-add, so the result
        # does not depend on accumulation order.
        y_NKD = ys_RD[pos_NK] * weights_NK.unsqueeze(-1).to(ys_RD.dtype)
        y_ND = y_NKD.sum(1)
        counts_E = torch.bincount(ids_NK.reshape(-1), minlength=cfg.experts)
        # Switch-Transformer balance loss: E * sum_e (share of pairs on e) * (mean prob of e),
        # divided by K so a perfectly uniform router scores 1 whatever K is.
        share_E = counts_E.to(probs_NE.dtype) / n
        aux = cfg.experts * (share_E * probs_NE.mean(0)).sum() / k
        return y_ND, RoutingStats(aux, counts_E)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.moe = MoE(cfg)

    def forward(
        self, h_BTD: torch.Tensor, cos_TC: torch.Tensor, sin_TC: torch.Tensor
    ) -> tuple[torch.Tensor, RoutingStats]:
        h_BTD = h_BTD + self.attn(self.attn_norm(h_BTD), cos_TC, sin_TC)
        x_BTD = self.ffn_norm(h_BTD)
        y_ND, stats = self.moe(x_BTD.reshape(-1, x_BTD.shape[-1]))
        return h_BTD + y_ND.view_as(x_BTD), stats


class TinyMoELM(nn.Module):
    """Decoder LM: embed -> blocks -> final norm -> untied head.

    ``forward`` returns logits_BTV and one :class:`RoutingStats` per layer. Sequences
    longer than ``max_positions`` are rejected (RoPE tables are precomputed).
    """

    cos_PC: torch.Tensor
    sin_PC: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        cos_PC, sin_PC = rope_tables(cfg)
        self.register_buffer("cos_PC", cos_PC, persistent=False)
        self.register_buffer("sin_PC", sin_PC, persistent=False)

    @property
    def block_list(self) -> list[Block]:
        """The blocks, typed (iterating the ModuleList yields plain ``nn.Module``)."""
        return cast("list[Block]", list(self.blocks))

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """GPT-2 style: N(0, 0.02); residual-branch outputs scaled by 1/sqrt(2L) so the
        residual stream's variance does not grow with depth; norms start at 1."""
        std = 0.02
        out_std = std / math.sqrt(2 * self.cfg.layers)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            elif name.endswith(("wo.weight", "w2_EDF")):
                p.normal_(0.0, out_std, generator=generator)
            else:
                p.normal_(0.0, std, generator=generator)

    def forward(self, ids_BT: torch.Tensor) -> tuple[torch.Tensor, list[RoutingStats]]:
        t = ids_BT.shape[1]
        if t > self.cfg.max_positions:
            raise ValueError(
                f"sequence of {t} tokens exceeds max_positions={self.cfg.max_positions}"
            )
        cos_TC, sin_TC = self.cos_PC[:t], self.sin_PC[:t]
        h_BTD = self.embed(ids_BT)
        stats: list[RoutingStats] = []
        for block in self.block_list:
            h_BTD, layer_stats = block(h_BTD, cos_TC, sin_TC)
            stats.append(layer_stats)
        return self.head(self.norm(h_BTD)), stats
