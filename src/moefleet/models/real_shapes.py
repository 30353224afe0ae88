"""Real-shape models: the published configurations of OLMoE-1B-7B, Qwen1.5-MoE-A2.7B,
DeepSeek-V2-Lite and Mixtral-8x7B with seeded random weights.

They carry every speed, memory and cost figure that claims to be about a real model size;
their outputs mean nothing (:data:`RANDOM_NOTE` goes on everything that uses them).

A reference is ``NAME`` or ``NAME:layers=N`` (the first N blocks only, for machines that
cannot hold the whole model; the embedding and head stay). Build invariants:

- the model is created on the ``meta`` device and materialised with ``to_empty`` directly
  on the target device in the target dtype: no float32 copy, no host detour, so loading
  peaks at about the weights' bytes (``benchmarks/engine_scale.py`` measures it);
- every tensor is filled from one generator seeded with ``seed``, tensor by tensor in
  parameter order: the same (name, layers, dtype, device, seed) gives the same weights;
- on a GPU every value is drawn (normal, std 0.02). On the CPU drawing billions of normals
  takes minutes (~15 ns each on one core), so each tensor is a seeded random rotation of
  one pool of 4M normal draws (a copy, at memory speed): rows of a matrix are distinct
  shifts of the pool, enough for routers to spread tokens over every expert.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Any

import torch

from moefleet.errors import MoefleetError, UnknownNameError

RANDOM_NOTE = "random weights: speed, memory and cost only"
_log = logging.getLogger(__name__)
_STD = 0.02  # the families' own initializer_range
_POOL = 4_194_301  # a prime: rows of any power-of-two width start at distinct offsets


@dataclass(frozen=True)
class RealShape:
    """A published configuration: the HF architecture and its config keywords."""

    name: str
    hub_id: str
    arch: str
    config: dict[str, Any]

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])


_COMMON = dict(tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
               pad_token_id=None)

SHAPES: dict[str, RealShape] = {s.name: s for s in [
    RealShape("olmoe-1b-7b", "allenai/OLMoE-1B-7B-0924", "OlmoeForCausalLM", dict(
        _COMMON, vocab_size=50304, hidden_size=2048, intermediate_size=1024,
        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
        max_position_embeddings=4096, rms_norm_eps=1e-5, num_experts=64,
        num_experts_per_tok=8, norm_topk_prob=False, clip_qkv=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    RealShape("qwen1.5-moe-a2.7b", "Qwen/Qwen1.5-MoE-A2.7B", "Qwen2MoeForCausalLM", dict(
        _COMMON, vocab_size=151936, hidden_size=2048, intermediate_size=5632,
        moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
        num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
        max_position_embeddings=8192, rms_norm_eps=1e-6, num_experts=60,
        num_experts_per_tok=4, decoder_sparse_step=1, norm_topk_prob=False,
        mlp_only_layers=[], use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    RealShape("deepseek-v2-lite", "deepseek-ai/DeepSeek-V2-Lite", "DeepseekV2ForCausalLM", dict(
        _COMMON, vocab_size=102400, hidden_size=2048, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, max_position_embeddings=163840, rms_norm_eps=1e-6,
        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, n_group=1, topk_group=1,
        topk_method="greedy", routed_scaling_factor=1.0, norm_topk_prob=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707})),
    RealShape("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", "MixtralForCausalLM", dict(
        _COMMON, vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=32768, rms_norm_eps=1e-5, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
]}

_REF = re.compile(r"^(?P<name>[a-z0-9.\-]+)(?::layers=(?P<layers>[^:]*))?$")


def is_real_shape(ref: str) -> bool:
    """Whether ``ref`` names a real-shape entry (with or without a layer slice)."""
    m = _REF.match(ref)
    return m is not None and m.group("name") in SHAPES


def looks_sliced(ref: str) -> bool:
    """``NAME:layers=...`` for any NAME: a slice of something that is not a real shape
    gets the real-shape error (naming the shapes) rather than "unknown model"."""
    return ":layers=" in ref


def parse_ref(ref: str) -> tuple[RealShape, int]:
    """``NAME[:layers=N]`` -> (shape, layers); a slice beyond the depth is one clear error."""
    m = _REF.match(ref)
    if m is None or m.group("name") not in SHAPES:
        raise UnknownNameError(f"unknown real-shape model {ref!r}",
                               f"use one of {', '.join(SHAPES)}, optionally ':layers=N'")
    shape = SHAPES[m.group("name")]
    raw = m.group("layers")
    if raw is None:
        return shape, shape.num_layers
    if not raw.isdigit() or not 1 <= int(raw) <= shape.num_layers:
        raise MoefleetError(
            f"layer slice {raw!r} of {shape.name} is outside 1..{shape.num_layers} (the "
            "model's depth)", f"use {shape.name}:layers=N with 1 <= N <= {shape.num_layers}")
    return shape, int(raw)


def hf_config(shape: RealShape, layers: int) -> Any:
    import transformers

    cls = getattr(transformers, shape.arch.replace("ForCausalLM", "Config"))
    cfg = dict(shape.config, num_hidden_layers=layers)
    with _quiet_transformers():
        config = cls(**cfg)
    config.architectures = [shape.arch]
    return config


def build_model(shape: RealShape, layers: int, *, dtype: torch.dtype,
                device: torch.device | str = "cpu", seed: int = 0) -> torch.nn.Module:
    """The HF model of ``shape`` cut to ``layers`` blocks, random weights drawn in ``dtype``
    on ``device`` (see the module docstring for the invariants)."""
    import transformers

    dev = torch.device(device)
    config = hf_config(shape, layers)
    cls = getattr(transformers, shape.arch)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = cls(config)
    model = model.to(dtype=dtype)  # meta: changes only the recorded dtype
    model.to_empty(device=dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    pool = None
    if dev.type == "cpu":
        pool = torch.randn(_POOL, generator=gen, device=dev).mul_(_STD).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms' scales 1, biases 0: what the families start from
                p.fill_(1.0 if name.endswith("norm.weight") or "layernorm" in name else 0.0)
            elif pool is None:
                p.normal_(0.0, _STD, generator=gen)
            else:
                _fill_from_pool(p, pool, gen)
    # Buffers (rotary frequencies) are computed, not learnt: rebuild them on the device.
    backbone: Any = model.model
    backbone.rotary_emb = type(backbone.rotary_emb)(config=config).to(dev)
    model.config.dtype = dtype
    _log.info("built %s (%d of %d layers, %s, %s) in %.1f s; %s", shape.name, layers,
              shape.num_layers, str(dtype).removeprefix("torch."), dev,
              time.perf_counter() - t0, RANDOM_NOTE)
    return model.eval()


def _fill_from_pool(p: torch.Tensor, pool: torch.Tensor, gen: torch.Generator) -> None:
    """``p`` (contiguous) = ``pool`` repeated from a random offset (one draw)."""
    flat = p.view(-1)
    n, P = flat.numel(), pool.numel()
    start = int(torch.randint(P, (1,), generator=gen, device=pool.device))
    src = torch.cat([pool[start:], pool[:start]])
    for s in range(0, n, P):
        k = min(P, n - s)
        flat[s:s + k].copy_(src[:k])


def load_real_shape(ref: str, *, dtype: torch.dtype | None = None,
                    device: torch.device | str = "cpu", seed: int = 0) -> Any:
    """The adapter of a real-shape reference (``dtype`` None: bfloat16, the published
    checkpoints' dtype). The adapter's ``notes`` carry :data:`RANDOM_NOTE`. Text prompts
    are tokenised with GPT-2's BPE (offline) where the vocabulary holds its ids (every
    shape but Mixtral's 32000: that one takes token ids only)."""
    from moefleet.models.hf import HFMoEAdapter

    shape, layers = parse_ref(ref)
    model = build_model(shape, layers, dtype=dtype or torch.bfloat16, device=device,
                        seed=seed)
    adapter = HFMoEAdapter(model, _tokenizer(int(shape.config["vocab_size"])), name=ref)
    adapter.notes = (RANDOM_NOTE,)
    return adapter


def _tokenizer(vocab_size: int) -> Any:
    from moefleet.errors import MissingExtraError
    from moefleet.models.tokenizers import gpt2_tokenizer

    try:
        tok = gpt2_tokenizer()
    except MissingExtraError:
        return None
    return tok if len(tok) <= vocab_size else None


class _quiet_transformers:
    """transformers warns about YaRN's factor on DeepSeek's own published config."""

    def __enter__(self) -> None:
        self._logger = logging.getLogger("transformers")
        self._level = self._logger.level
        self._logger.setLevel(logging.ERROR)

    def __exit__(self, *exc: object) -> None:
        self._logger.setLevel(self._level)
