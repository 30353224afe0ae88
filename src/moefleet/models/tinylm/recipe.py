"""The recipe of ``tiny-moe-lm``: a JSON-able dict that fully determines a build.

:func:`parse_recipe` turns the dict into frozen dataclasses and is the only place that
validates it: unknown keys, wrong types and out-of-range values raise
:class:`RecipeError` (a :class:`moefleet.errors.MoefleetError`) naming the key, the bad
value and the fix. Everything downstream may assume a parsed recipe is consistent
(``hidden % heads == 0``, ``heads % kv_heads == 0``, even head dim, ``top_k <= experts``,
``seq_len <= max_positions``, held-out source not among the training sources).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moefleet.errors import MoefleetError

if TYPE_CHECKING:
    from moefleet.models.tinylm.model import ModelConfig


class RecipeError(MoefleetError):
    """A tiny-moe-lm recipe value that cannot be built."""


@dataclass(frozen=True)
class TokenizerSpec:
    """``bpe``: byte-level BPE of ``vocab_size`` tokens trained on the training text;
    ``gpt2``: GPT-2's 50257-token BPE (``vocab_size`` ignored).

    Why ``bpe``/8192 is the default (measured at the default model, 1 thread): a step
    costs 0.51 s CPU at 8192 tokens vs 1.46 s with GPT-2's 50257 (the head and its
    softmax dominate). At equal training CPU (~340 s: 600 vs 210 steps) GPT-2 tokens
    reached 1.89 held-out bits/byte vs 1.97 (4% better), but the model is then 39.4M
    parameters of which experts are 32%, vs 17.8M with experts 70%: the small vocabulary
    keeps compute and memory dominated by experts, as in real MoE models, which is what
    moefleet's planners and autoscalers study.
    """

    kind: str = "bpe"
    vocab_size: int = 8192


@dataclass(frozen=True)
class DataSpec:
    """Training sources (names of :data:`moefleet.models.tinylm.corpus.SOURCES`), an
    optional cap on the characters read from each, and the held-out evaluation: the first
    ``heldout_tokens`` tokens of ``heldout``."""

    train: tuple[str, ...] = ("wikitext2-tokens-test", "c4", "alpaca", "sharegpt")
    max_chars_per_source: int | None = None
    heldout: str = "wikitext2-tokens-valid"
    heldout_tokens: int = 65536


@dataclass(frozen=True)
class ArchSpec:
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 4
    ffn: int = 512
    experts: int = 8
    top_k: int = 2
    max_positions: int = 512
    rope_theta: float = 10000.0

    def model_config(self, vocab_size: int) -> ModelConfig:
        from moefleet.models.tinylm.model import ModelConfig

        return ModelConfig(vocab_size=vocab_size, **dataclasses.asdict(self))


@dataclass(frozen=True)
class TrainSpec:
    """AdamW with linear warmup then cosine decay to ``lr * min_lr_ratio``; one batch is
    ``batch`` windows of ``seq_len + 1`` tokens; ``precision`` bf16 = autocast matmuls
    with fp32 master weights; a checkpoint every ``checkpoint_every`` steps.

    ``threads`` is part of the recipe because the intra-op thread count changes float
    rounding (measured: 4e-3 max weight difference after 5 steps at 1 vs 2 threads), so
    a build is reproducible only at a fixed count. Default 1: on a shared 2-core machine
    two threads measured ~10x slower per step than one (OpenMP threads oversubscribed).
    """

    steps: int = 600
    batch: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    aux_coef: float = 0.01
    grad_clip: float = 1.0
    precision: str = "bf16"
    checkpoint_every: int = 100
    threads: int = 1


@dataclass(frozen=True)
class Recipe:
    seed: int = 0
    tokenizer: TokenizerSpec = field(default_factory=TokenizerSpec)
    data: DataSpec = field(default_factory=DataSpec)
    model: ArchSpec = field(default_factory=ArchSpec)
    train: TrainSpec = field(default_factory=TrainSpec)


def _check_type(where: str, value: Any, expected: Any) -> Any:
    """``value`` converted to the annotated type, or RecipeError."""
    if expected == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    if expected == "float" and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if expected == "str" and isinstance(value, str):
        return value
    if expected == "int | None" and (value is None or _is_int(value)):
        return value
    if expected == "tuple[str, ...]" and isinstance(value, list | tuple) and all(
        isinstance(v, str) for v in value
    ):
        return tuple(value)
    raise RecipeError(
        f"recipe value {where}={value!r} has the wrong type", f"{where} must be {expected}"
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _section(cls: Any, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe section {where!r} is {raw!r}", f"{where} must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise RecipeError(
            f"unknown recipe key(s) {', '.join(f'{where}.{k}' for k in unknown)}",
            f"keys allowed in {where}: {', '.join(fields)}",
        )
    values = {k: _check_type(f"{where}.{k}", v, str(fields[k].type)) for k, v in raw.items()}
    return cls(**values)


def _require(ok: bool, where: str, value: Any, fix: str) -> None:
    if not ok:
        raise RecipeError(f"recipe value {where}={value!r} is out of range", fix)


def parse_recipe(raw: dict[str, Any]) -> Recipe:
    """Validate ``raw`` (see the module docstring); missing keys take the defaults."""
    from moefleet.models.tinylm.sources import SOURCES

    if not isinstance(raw, dict):
        raise RecipeError(f"a recipe must be a mapping, got {raw!r}", "pass a dict")
    top = {"seed", "tokenizer", "data", "model", "train"}
    unknown = sorted(set(raw) - top)
    if unknown:
        raise RecipeError(
            f"unknown recipe key(s) {', '.join(unknown)}", f"top-level keys: {', '.join(top)}"
        )
    seed = _check_type("seed", raw.get("seed", 0), "int")
    tok = _section(TokenizerSpec, raw.get("tokenizer", {}), "tokenizer")
    data = _section(DataSpec, raw.get("data", {}), "data")
    arch = _section(ArchSpec, raw.get("model", {}), "model")
    train = _section(TrainSpec, raw.get("train", {}), "train")

    _require(seed >= 0, "seed", seed, "use a non-negative integer seed")
    _require(tok.kind in ("bpe", "gpt2"), "tokenizer.kind", tok.kind, "use 'bpe' or 'gpt2'")
    _require(
        tok.kind != "bpe" or 300 <= tok.vocab_size <= 65536,
        "tokenizer.vocab_size",
        tok.vocab_size,
        "a byte-level BPE needs 300..65536 tokens (256 bytes + merges + specials)",
    )
    known = ", ".join(SOURCES)
    for name in (*data.train, data.heldout):
        _require(name in SOURCES, "data source", name, f"known sources: {known}")
    _require(len(data.train) > 0, "data.train", data.train, "name at least one source")
    _require(
        data.heldout not in data.train,
        "data.heldout",
        data.heldout,
        "the held-out source must not also be a training source",
    )
    _require(
        data.max_chars_per_source is None or data.max_chars_per_source >= 1000,
        "data.max_chars_per_source",
        data.max_chars_per_source,
        "use null (all text) or at least 1000 characters",
    )
    _require(data.heldout_tokens >= 0, "data.heldout_tokens", data.heldout_tokens, "use >= 0")

    for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "experts", "top_k"):
        value = getattr(arch, name)
        _require(value >= 1, f"model.{name}", value, "use a positive integer")
    _require(arch.hidden % arch.heads == 0, "model.hidden", arch.hidden, "make it a multiple "
             "of model.heads")
    _require(arch.heads % arch.kv_heads == 0, "model.kv_heads", arch.kv_heads,
             "model.heads must be a multiple of model.kv_heads")
    _require((arch.hidden // arch.heads) % 2 == 0, "model.hidden", arch.hidden,
             "RoPE needs an even head dim (hidden / heads)")
    _require(arch.top_k <= arch.experts, "model.top_k", arch.top_k,
             f"choose at most model.experts={arch.experts} experts per token")
    _require(arch.rope_theta > 0, "model.rope_theta", arch.rope_theta, "use a positive base")

    for name in ("steps", "batch", "seq_len", "checkpoint_every", "threads"):
        value = getattr(train, name)
        _require(value >= 1, f"train.{name}", value, "use a positive integer")
    _require(2 <= train.seq_len <= arch.max_positions, "train.seq_len", train.seq_len,
             f"use 2..model.max_positions={arch.max_positions}")
    _require(train.lr > 0, "train.lr", train.lr, "use a positive learning rate")
    _require(0 <= train.min_lr_ratio <= 1, "train.min_lr_ratio", train.min_lr_ratio,
             "use a value in [0, 1]")
    _require(0 <= train.warmup <= train.steps, "train.warmup", train.warmup,
             "use 0..train.steps warmup steps")
    for name in ("weight_decay", "aux_coef", "grad_clip"):
        value = getattr(train, name)
        _require(value >= 0, f"train.{name}", value, "use a non-negative number")
    _require(train.precision in ("bf16", "fp32"), "train.precision", train.precision,
             "use 'bf16' (autocast) or 'fp32'")
    return Recipe(seed=seed, tokenizer=tok, data=data, model=arch, train=train)


def recipe_dict(recipe: Recipe) -> dict[str, Any]:
    """The JSON-able form of a parsed recipe (tuples become lists)."""
    out = dataclasses.asdict(recipe)
    out["data"]["train"] = list(recipe.data.train)
    return out
