"""A model directory's ``config.json``, validated before anything is allocated.

A checkpoint directory is untrusted input: its ``config.json`` decides how many layers,
experts and bytes the loader allocates, so it is parsed into :class:`ModelConfigCheck`
here, field by field, before any library builds a module from it. The checks, in order:

1. the file is a regular file under 1 MiB holding one strict-JSON object;
2. ``architectures`` names one supported architecture;
3. every sizing field is an integer (never a bool or a string) in its documented range,
   every float a finite positive number;
4. consistency: ``1 <= top-k <= experts``, heads divide the hidden size, KV heads divide
   the heads;
5. a lower bound on the fp32 weights (embeddings, attention, experts) fits the memory
   available on this host (where every loader builds the model first).

Each failure is one :class:`~moefleet.errors.DataError` line naming the field, its value
and the bound. The weights themselves are checked by :mod:`moefleet.models.weights_check`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moefleet.errors import DataError, UnsupportedModelError

MAX_CONFIG_BYTES = 1 << 20
FP32_BYTES = 4

#: (lowest, highest) of each integer field any supported family may carry; generous for
#: real checkpoints (DeepSeek-V3 has 61 layers, 256 experts, 129k vocab, hidden 7168).
INT_RANGES: dict[str, tuple[int, int]] = {
    "hidden_size": (1, 65_536),
    "num_hidden_layers": (1, 1_024),
    "num_attention_heads": (1, 1_024),
    "num_key_value_heads": (1, 1_024),
    "intermediate_size": (1, 1 << 20),
    "moe_intermediate_size": (1, 1 << 20),
    "shared_expert_intermediate_size": (1, 1 << 20),
    "vocab_size": (1, 1 << 22),
    "max_position_embeddings": (1, 1 << 24),
    "num_local_experts": (1, 4_096),
    "num_experts": (1, 4_096),
    "n_routed_experts": (1, 4_096),
    "n_shared_experts": (0, 64),
    "num_experts_per_tok": (1, 4_096),
    "top_k": (1, 4_096),
    "head_dim": (1, 4_096),
    "kv_lora_rank": (1, 65_536),
    "q_lora_rank": (1, 65_536),
    "qk_rope_head_dim": (1, 4_096),
    "qk_nope_head_dim": (1, 4_096),
    "v_head_dim": (1, 4_096),
    "first_k_dense_replace": (0, 1_024),
    "decoder_sparse_step": (1, 1_024),
    "type_vocab_size": (1, 1_024),
    "sliding_window": (0, 1 << 24),  # Qwen2-MoE writes 0 when sliding is off
}
#: Fields that must be there for the loader to know the model's size.
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
#: Finite, positive floats.
POSITIVE_FLOATS = ("rms_norm_eps", "layer_norm_eps", "rope_theta")
#: Where each family keeps its expert count and its top-k.
EXPERT_FIELDS = ("num_local_experts", "n_routed_experts", "num_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "top_k")
#: Fields that may be null in a valid checkpoint (HF writes ``"head_dim": null``).
NULLABLE = {"head_dim", "q_lora_rank", "sliding_window", "num_key_value_heads",
            "moe_intermediate_size", "shared_expert_intermediate_size", "kv_lora_rank",
            "n_shared_experts"}


@dataclass(frozen=True)
class ModelConfigCheck:
    """A config that passed every check: its architecture, sizes and weight estimate."""

    architecture: str
    layers: int
    hidden: int
    experts: int
    top_k: int
    vocab: int
    min_weight_bytes: int
    config: dict[str, Any]


def _bad(cfg_file: Path, what: str, hint: str) -> DataError:
    return DataError(f"{cfg_file}: {what}", hint)


def read_config(cfg_file: Path) -> dict[str, Any]:
    """``config.json`` as a dict: a regular, small, UTF-8, strict-JSON object."""
    from moefleet.io import load_json_input

    hint = "point --model at a directory written by save_pretrained, or a zoo name"
    if not cfg_file.is_file():
        raise DataError(f"{cfg_file.parent} has no config.json (or it is not a regular file)",
                        hint)
    size = cfg_file.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise _bad(cfg_file, f"is {size} bytes; a model config is under "
                   f"{MAX_CONFIG_BYTES} bytes", "restore the checkpoint's config.json")
    blob = load_json_input(cfg_file, "model config", "restore the checkpoint's config.json")
    if not isinstance(blob, dict):
        raise _bad(cfg_file, f"holds a JSON {type(blob).__name__.replace('NoneType', 'null')}"
                   ", not an object", "config.json must be one JSON object of model settings")
    return blob


def check_architecture(config: dict[str, Any], where: str, supported: list[str]) -> str:
    archs = config.get("architectures")
    names = ", ".join(supported)
    if archs is None or archs == []:
        raise UnsupportedModelError(f"{where} has no 'architectures' entry in config.json",
                                    f"supported architectures: {names}")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise DataError(f"{where}: 'architectures' in config.json is {archs!r}, not a list "
                        "of class names", f"supported architectures: {names}")
    if archs[0] not in supported:
        raise UnsupportedModelError(f"architecture {archs[0][:80]!r} ({where}) is not "
                                    "supported", f"supported architectures: {names}")
    return archs[0]


def _int_field(config: dict[str, Any], name: str, cfg_file: Path) -> int | None:
    if name not in config or (config[name] is None and name in NULLABLE):
        return None
    value = config[name]
    lo, hi = INT_RANGES[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(cfg_file, f"{name} is {json.dumps(value)[:60]}, not an integer",
                   f"set {name} to an integer in [{lo}, {hi}]")
    if not lo <= value <= hi:
        raise _bad(cfg_file, f"{name}={value} is outside [{lo}, {hi}]",
                   f"set {name} to the checkpoint's real value")
    return value


def _first(sizes: dict[str, int | None], names: tuple[str, ...]) -> int | None:
    return next((v for n in names if (v := sizes.get(n)) is not None), None)


def memory_budget_bytes() -> int:
    """Memory this process may fill with weights: the host's available memory. Every
    loader builds the fp32 model on the host first (a GPU gets it afterwards, and the
    engine checks that move), so the host is the bound that holds for every device."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return 1 << 40


def min_weight_bytes(s: dict[str, int | None], tied: bool) -> int:
    """A lower bound on the fp32 weights: embeddings (+ LM head), attention projections
    and, per layer, the smaller of the routed experts and a dense MLP (two matrices each,
    though gated families have three). A lower bound,
    so a model refused by it cannot fit whatever its exact layout."""
    hidden, layers, vocab = s["hidden_size"] or 1, s["num_hidden_layers"] or 1, s["vocab_size"] or 1
    heads = s["num_attention_heads"] or 1
    head_dim = s.get("head_dim") or max(1, hidden // heads)
    kv = s.get("num_key_value_heads") or heads
    attn = hidden * head_dim * (2 * heads + 2 * kv)
    inter = s.get("intermediate_size") or 1
    moe_inter = s.get("moe_intermediate_size") or inter
    experts = _first(s, EXPERT_FIELDS) or 1
    mlp = min(2 * hidden * inter, experts * 2 * hidden * moe_inter)
    embed = vocab * hidden * (1 if tied else 2)
    return FP32_BYTES * (embed + layers * (attn + mlp))


def check_config(config: dict[str, Any], cfg_file: Path, architecture: str,
                 budget_bytes: int | None = None) -> ModelConfigCheck:
    """Every sizing field typed and in range, consistent, and small enough to load."""
    sizes = {name: _int_field(config, name, cfg_file) for name in INT_RANGES}
    for name in REQUIRED:
        if sizes[name] is None and architecture != "MoefleetBertMoE":
            raise _bad(cfg_file, f"has no {name}", f"add {name} (an integer) to config.json")
    for name in POSITIVE_FLOATS:
        value = config.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not math.isfinite(value) or value <= 0:
            raise _bad(cfg_file, f"{name} is {value!r:.60}, not a finite positive number",
                       f"set {name} to the checkpoint's real value (e.g. 1e-6)")
    rope = config.get("rope_parameters")
    if isinstance(rope, dict):
        theta = rope.get("rope_theta")
        if theta is not None and (isinstance(theta, bool) or not isinstance(theta, int | float)
                                  or not math.isfinite(theta) or theta <= 0):
            raise _bad(cfg_file, f"rope_parameters.rope_theta is {theta!r:.60}, not a finite "
                       "positive number", "set it to the checkpoint's real value")
    experts, top_k = _first(sizes, EXPERT_FIELDS), _first(sizes, TOP_K_FIELDS)
    if experts is None:
        raise _bad(cfg_file, "names no expert count (num_local_experts, num_experts or "
                   "n_routed_experts)", "this is not a Mixture-of-Experts checkpoint")
    if top_k is None:
        raise _bad(cfg_file, "names no top-k (num_experts_per_tok)",
                   "add num_experts_per_tok to config.json")
    if top_k > experts:
        raise _bad(cfg_file, f"top-k {top_k} is more than the {experts} experts per layer",
                   "set num_experts_per_tok to at most the expert count")
    hidden = sizes["hidden_size"] or 0
    heads = sizes["num_attention_heads"] or 1
    if hidden and sizes["head_dim"] is None and architecture != "DeepseekV2ForCausalLM" \
            and hidden % heads:
        raise _bad(cfg_file, f"hidden_size {hidden} is not divisible by "
                   f"num_attention_heads {heads}", "use the checkpoint's real values")
    kv = sizes["num_key_value_heads"]
    if kv is not None and (kv > heads or heads % kv):
        raise _bad(cfg_file, f"num_key_value_heads {kv} does not divide num_attention_heads "
                   f"{heads}", "use the checkpoint's real values")
    need = min_weight_bytes(sizes, bool(config.get("tie_word_embeddings")))
    budget = memory_budget_bytes() if budget_bytes is None else budget_bytes
    if need > budget:
        raise _bad(cfg_file, f"describes a model of at least {need / 2**30:.1f} GiB of fp32 "
                   f"weights; this machine has {budget / 2**30:.1f} GiB available",
                   "check num_hidden_layers, hidden_size, vocab_size and the expert counts, "
                   "or use a machine with more memory")
    return ModelConfigCheck(architecture, sizes["num_hidden_layers"] or 0, hidden, experts,
                            top_k, sizes["vocab_size"] or 0, need, config)
