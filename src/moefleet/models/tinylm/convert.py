"""Convert the training module into a transformers ``MixtralForCausalLM`` (and back).

Shape legend: D hidden size, F expert intermediate size, E experts, H query heads,
G key/value heads, C head dim, V vocabulary.

Mapping (HF name <- ours), per layer ``l``:

    model.embed_tokens.weight                  <- embed.weight                  [V, D]
    layers.l.input_layernorm.weight            <- blocks.l.attn_norm.weight     [D]
    layers.l.self_attn.{q,k,v}_proj.weight     <- blocks.l.attn.wqkv rows split [H*C|G*C|G*C, D]
    layers.l.self_attn.o_proj.weight           <- blocks.l.attn.wo.weight       [D, H*C]
    layers.l.post_attention_layernorm.weight   <- blocks.l.ffn_norm.weight      [D]
    layers.l.mlp.gate.weight                   <- blocks.l.moe.gate.weight      [E, D]
    layers.l.mlp.experts.gate_up_proj          <- blocks.l.moe.w13_E2FD         [E, 2F, D]
    layers.l.mlp.experts.down_proj             <- blocks.l.moe.w2_EDF           [E, D, F]
    model.norm.weight                          <- norm.weight                   [D]
    lm_head.weight                             <- head.weight                   [V, D]

RoPE needs no permutation: both sides rotate (i, i + C/2) pairs with
``inv_freq = theta^(-2i/C)``. Every tensor is copied (the HF model shares nothing with
the training module), so training can go on after a conversion.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import MixtralConfig, MixtralForCausalLM

from moefleet.models.tinylm.model import ModelConfig, TinyMoELM


def hf_config(cfg: ModelConfig, *, bos_id: int, eos_id: int, aux_coef: float) -> MixtralConfig:
    """The ``MixtralConfig`` of the same architecture (fp32, no sliding window)."""
    return MixtralConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_positions,
        rms_norm_eps=cfg.rms_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        num_local_experts=cfg.experts,
        num_experts_per_tok=cfg.top_k,
        router_aux_loss_coef=aux_coef,
        tie_word_embeddings=False,
        sliding_window=None,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="float32",
    )


def hf_state_dict(model: TinyMoELM) -> dict[str, torch.Tensor]:
    """Our weights under HF Mixtral names (cloned, contiguous, fp32)."""
    cfg = model.cfg
    q_rows, kv_rows = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": model.embed.weight,
        "model.norm.weight": model.norm.weight,
        "lm_head.weight": model.head.weight,
    }
    for i, block in enumerate(model.block_list):
        p = f"model.layers.{i}."
        q, k, v = block.attn.wqkv.weight.split([q_rows, kv_rows, kv_rows], dim=0)
        out.update(
            {
                p + "input_layernorm.weight": block.attn_norm.weight,
                p + "self_attn.q_proj.weight": q,
                p + "self_attn.k_proj.weight": k,
                p + "self_attn.v_proj.weight": v,
                p + "self_attn.o_proj.weight": block.attn.wo.weight,
                p + "post_attention_layernorm.weight": block.ffn_norm.weight,
                p + "mlp.gate.weight": block.moe.gate.weight,
                p + "mlp.experts.gate_up_proj": block.moe.w13_E2FD,
                p + "mlp.experts.down_proj": block.moe.w2_EDF,
            }
        )
    return {name: t.detach().float().clone().contiguous() for name, t in out.items()}


def to_hf(
    model: TinyMoELM, *, bos_id: int, eos_id: int, aux_coef: float = 0.01
) -> MixtralForCausalLM:
    """A new ``MixtralForCausalLM`` (eval mode, fp32) holding a copy of ``model``'s weights.

    Raises ``RuntimeError`` when a name is missing on either side, so a change in the
    HF layout fails loudly instead of leaving randomly initialised weights behind.
    """
    config = hf_config(model.cfg, bos_id=bos_id, eos_id=eos_id, aux_coef=aux_coef)
    # The experts' matmuls run through HF's own default path (grouped_mm where available);
    # the equivalence test covers whichever one transformers picks.
    hf = MixtralForCausalLM(config)
    hf.load_state_dict(hf_state_dict(model), strict=True)
    return hf.float().eval()


def _rope_theta(config: MixtralConfig) -> float:
    rope: Any = config.rope_parameters or {}
    return float(rope.get("rope_theta", MixtralConfig.default_theta))


def from_hf(hf: MixtralForCausalLM) -> TinyMoELM:
    """The inverse of :func:`to_hf` (used to check that the mapping is a bijection)."""
    c = hf.config
    cfg = ModelConfig(
        vocab_size=c.vocab_size,
        layers=c.num_hidden_layers,
        hidden=c.hidden_size,
        heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads,
        ffn=c.intermediate_size,
        experts=c.num_local_experts,
        top_k=c.num_experts_per_tok,
        max_positions=c.max_position_embeddings,
        rope_theta=_rope_theta(c),
        rms_eps=c.rms_norm_eps,
    )
    model = TinyMoELM(cfg)
    sd = hf.state_dict()
    with torch.no_grad():
        model.embed.weight.copy_(sd["model.embed_tokens.weight"])
        model.norm.weight.copy_(sd["model.norm.weight"])
        model.head.weight.copy_(sd["lm_head.weight"])
        for i, block in enumerate(model.block_list):
            p = f"model.layers.{i}."
            block.attn_norm.weight.copy_(sd[p + "input_layernorm.weight"])
            block.attn.wqkv.weight.copy_(
                torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], dim=0)
            )
            block.attn.wo.weight.copy_(sd[p + "self_attn.o_proj.weight"])
            block.ffn_norm.weight.copy_(sd[p + "post_attention_layernorm.weight"])
            block.moe.gate.weight.copy_(sd[p + "mlp.gate.weight"])
            block.moe.w13_E2FD.copy_(sd[p + "mlp.experts.gate_up_proj"])
            block.moe.w2_EDF.copy_(sd[p + "mlp.experts.down_proj"])
    return model.eval()
