"""Tiny random configurations of each supported HF family.

For tests and smoke runs: a few layers, small hidden size, real architecture classes.
Routing of random weights means nothing; use the zoo's trained models for that.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=None,
)


def small_mixtral(layers: int = 2, experts: int = 4, vocab_size: int = 1024,
                  seed: int = 0) -> PreTrainedModel:
    """A Mixtral smaller than ``tiny_model("mixtral")`` (2 blocks of 4 experts, top-2,
    fp32, eval mode): few functions, so backends that start a process per function (ray,
    the serving and fault runs) come up quickly on 2 cores."""
    torch.manual_seed(seed)
    cfg = MixtralConfig(**dict(_COMMON, num_hidden_layers=layers, vocab_size=vocab_size),
                        intermediate_size=96, num_local_experts=experts, num_experts_per_tok=2)
    return MixtralForCausalLM(cfg).float().eval()


def tiny_model(family: str, vocab_size: int = 1024, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised model of ``family`` with 8 experts (top-2), fp32."""
    torch.manual_seed(seed)
    common = dict(_COMMON, vocab_size=vocab_size)
    model: PreTrainedModel
    if family == "mixtral":
        model = MixtralForCausalLM(
            MixtralConfig(**common, intermediate_size=96, num_local_experts=8,
                          num_experts_per_tok=2)
        )
    elif family == "qwen2_moe":
        model = Qwen2MoeForCausalLM(
            Qwen2MoeConfig(**common, intermediate_size=128, moe_intermediate_size=48,
                           shared_expert_intermediate_size=96, num_experts=8,
                           num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[2])
        )
    elif family == "olmoe":
        model = OlmoeForCausalLM(
            OlmoeConfig(**common, intermediate_size=48, num_experts=8, num_experts_per_tok=2)
        )
    elif family == "deepseek_v2":
        model = DeepseekV2ForCausalLM(
            DeepseekV2Config(
                **{k: v for k, v in common.items() if k != "num_key_value_heads"},
                num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32,
                n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
                first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
                qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1,
                topk_group=1, topk_method="greedy",
            )
        )
    else:
        raise ValueError(f"no tiny config for family {family!r}")
    return model.float().eval()
