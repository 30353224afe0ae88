"""Model shapes ``compare`` knows, first match wins: the planner's analytical shapes
(gpt2-moe, deepseek-v2-lite) and tiny-moe-lm; the real-shape models' published configs
(:mod:`moefleet.models.real_shapes`: olmoe-1b-7b, qwen1.5-moe-a2.7b, mixtral-8x7b),
counted on the ``meta`` device so no weight is allocated; any zoo model (its own sizes).
Every shape is a :class:`moefleet.plan.remoe.shapes.ModelDims` (bf16 weights).
"""

from __future__ import annotations

import difflib

from moefleet.errors import UnknownNameError
from moefleet.plan.remoe.shapes import SHAPES, ModelDims

# tiny-moe-lm (models/tinylm/recipe.py defaults): 4 layers, hidden 256, SwiGLU ffn 512,
# 8 experts top-2, vocabulary 8192 (embeddings + head = 2 x 8192 x 256), 4 KV heads of 64.
EXTRA: dict[str, ModelDims] = {
    "tiny-moe-lm": ModelDims("tiny-moe-lm", 4, 8, 2, 256, 512,
                             4 * 4 * 256 * 256 + 2 * 8192 * 256, 4 * 2 * 256 * 2.0),
}

DEFAULT_MODEL = "gpt2-moe"
ENCODERS: set[str] = set()  # zoo models seen here that do not generate (one pass each)


def known_models() -> list[str]:
    """Analytical and real shapes (any zoo model name is accepted too: its own sizes)."""
    from moefleet.models.real_shapes import SHAPES as REAL

    return sorted({**SHAPES, **EXTRA, **REAL})


def resolve_dims(name: str) -> ModelDims:
    """The shape called ``name``; an unknown name is an error listing the known ones."""
    from moefleet.models.real_shapes import SHAPES as REAL

    table = {**SHAPES, **EXTRA}
    if name in table:
        return table[name]
    if name in REAL:
        return dims_from_real_shape(name)
    from moefleet.models import zoo

    if zoo.has_entry(name):  # a model this machine runs: its own sizes
        from moefleet.models import load_adapter

        return dims_from_adapter(load_adapter(name))
    close = difflib.get_close_matches(name, [*table, *REAL], n=1)
    raise UnknownNameError(f"unknown model shape '{name}'",
                           (f"did you mean '{close[0]}'? " if close else "")
                           + f"known: {', '.join(known_models())}")


def model_bytes(d: ModelDims) -> float:
    """All weights, bf16: non-experts plus every routed expert of every MoE layer."""
    return d.bytes_per_param * (d.nonexpert_params + d.moe_layers * d.experts * d.expert_params)


def active_params_per_token(d: ModelDims) -> float:
    """Parameters one token multiplies: non-experts plus top-k experts per MoE layer."""
    return d.nonexpert_params + d.moe_layers * d.top_k * d.expert_params


def dims_from_adapter(adapter: object) -> ModelDims:
    """The shape of a loaded model (``adapter.summary()``), for models this machine runs:
    sizes from its parameter bytes (fp32 as stored), SwiGLU experts (3 matrices)."""
    s = adapter.summary()  # type: ignore[attr-defined]
    if not s.causal:
        ENCODERS.add(s.name)
    per_param = 4
    experts = max(s.num_experts)
    layers = s.num_moe_layers
    expert_params = s.expert_param_bytes / per_param / max(1, layers * experts)
    ffn = max(1, round(expert_params / (3 * s.hidden_size)))
    return ModelDims(s.name, layers, experts, s.top_k, s.hidden_size, ffn,
                     s.non_expert_param_bytes / per_param,
                     s.num_layers * 2 * s.hidden_size * 2.0)


def dims_from_real_shape(name: str) -> ModelDims:
    """A real shape's dimensions, from its published config: the model is built on the
    ``meta`` device (no memory) and its parameters counted by name. Routed experts are the
    parameters under ``.experts.``; everything else (attention, norms, routers, shared
    experts, embeddings and head) is non-expert. KV cache: K and V of every layer in bf16."""
    import re

    import torch
    import transformers

    from moefleet.models.real_shapes import SHAPES as REAL
    from moefleet.models.real_shapes import hf_config

    shape = REAL[name]
    cfg = hf_config(shape, shape.num_layers)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    expert = non_expert = 0
    moe_layers: set[int] = set()
    for pname, p in model.named_parameters():
        if ".experts." in pname:
            expert += p.numel()
            m = re.search(r"layers\.(\d+)\.", pname)
            if m:
                moe_layers.add(int(m.group(1)))
        else:
            non_expert += p.numel()
    experts = next(int(v) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                   if (v := getattr(cfg, k, None)) is not None)
    hidden = int(cfg.hidden_size)
    ffn = round(expert / (len(moe_layers) * experts * 3 * hidden))
    head_dim = getattr(cfg, "head_dim", None) or hidden // int(cfg.num_attention_heads)
    kv = cfg.num_hidden_layers * 2 * int(cfg.num_key_value_heads) * int(head_dim) * 2.0
    return ModelDims(name, len(moe_layers), experts, int(cfg.num_experts_per_tok), hidden,
                     ffn, float(non_expert), kv)
