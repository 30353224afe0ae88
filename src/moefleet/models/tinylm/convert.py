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

from collections.abc import Iterator
from operator import attrgetter
from typing import Any

import torch
from transformers import MixtralConfig, MixtralForCausalLM

from moefleet.models.tinylm.model import ModelConfig, TinyMoELM

# MixtralConfig field <- ModelConfig field, in both directions (``head_dim`` is derived on
# our side, ``rope_theta`` lives in HF's ``rope_parameters``).
_CONFIG_KEYS: tuple[tuple[str, str], ...] = (
    ("vocab_size", "vocab_size"),
    ("hidden_size", "hidden"),
    ("intermediate_size", "ffn"),
    ("num_hidden_layers", "layers"),
    ("num_attention_heads", "heads"),
    ("num_key_value_heads", "kv_heads"),
    ("max_position_embeddings", "max_positions"),
    ("rms_norm_eps", "rms_eps"),
    ("num_local_experts", "experts"),
    ("num_experts_per_tok", "top_k"),
)


def hf_config(cfg: ModelConfig, *, bos_id: int, eos_id: int, aux_coef: float) -> MixtralConfig:
    """The ``MixtralConfig`` of the same architecture (fp32, no sliding window)."""
    return MixtralConfig(
        **{hf: getattr(cfg, ours) for hf, ours in _CONFIG_KEYS},
        head_dim=cfg.head_dim,
        hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        router_aux_loss_coef=aux_coef,
        tie_word_embeddings=False,
        sliding_window=None,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="float32",
    )


# The mapping of the module docstring, in both directions: HF name <- attribute path
# under the model. ``_MODEL_KEYS`` are whole-model tensors.
_MODEL_KEYS: tuple[tuple[str, str], ...] = (
    ("model.embed_tokens.weight", "embed.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "head.weight"),
)
# Per layer ``l``: HF name under ``model.layers.l.`` <- (path under ``blocks.l``, row block
# of that tensor: 0/1/2 for the q/k/v rows of the fused ``wqkv``, None for all of it).
_LAYER_KEYS: tuple[tuple[str, str, int | None], ...] = (
    ("input_layernorm.weight", "attn_norm.weight", None),
    ("self_attn.q_proj.weight", "attn.wqkv.weight", 0),
    ("self_attn.k_proj.weight", "attn.wqkv.weight", 1),
    ("self_attn.v_proj.weight", "attn.wqkv.weight", 2),
    ("self_attn.o_proj.weight", "attn.wo.weight", None),
    ("post_attention_layernorm.weight", "ffn_norm.weight", None),
    ("mlp.gate.weight", "moe.gate.weight", None),
    ("mlp.experts.gate_up_proj", "moe.w13_E2FD", None),
    ("mlp.experts.down_proj", "moe.w2_EDF", None),
)


def _hf_views(model: TinyMoELM) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, our tensor or a row view of it) for every HF tensor, in HF order.

    Views share storage with ``model``: read them to export, ``copy_`` into them (under
    ``torch.no_grad``) to import.
    """
    cfg = model.cfg
    q_rows, kv_rows = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    for name, path in _MODEL_KEYS:
        yield name, attrgetter(path)(model)
    for i, block in enumerate(model.block_list):
        p = f"model.layers.{i}."
        for name, path, rows in _LAYER_KEYS:
            t: torch.Tensor = attrgetter(path)(block)
            if rows is not None:
                t = t.split([q_rows, kv_rows, kv_rows], dim=0)[rows]
            yield p + name, t


def hf_state_dict(model: TinyMoELM) -> dict[str, torch.Tensor]:
    """Our weights under HF Mixtral names (cloned, contiguous, fp32)."""
    return {name: t.detach().float().clone().contiguous() for name, t in _hf_views(model)}


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
    cfg = ModelConfig(**{ours: getattr(c, hf) for hf, ours in _CONFIG_KEYS},
                      rope_theta=_rope_theta(c))
    model = TinyMoELM(cfg)
    sd = hf.state_dict()
    with torch.no_grad():
        for name, t in _hf_views(model):
            t.copy_(sd[name])
    return model.eval()
