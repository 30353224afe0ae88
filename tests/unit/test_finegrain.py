"""tiny-moe-lm-e32: the fine-grained split is exact at init; upcycling builds a loadable,
trained model whose report compares held-out perplexity with its base."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from moefleet.errors import DataError, MoefleetError
from moefleet.models import load_adapter, zoo
from moefleet.models.tinylm import entry, finegrain_entry
from moefleet.models.tinylm.finegrain import split_into_finer_experts
from moefleet.models.tinylm.model import ModelConfig, TinyMoELM
from moefleet.models.tinylm.sources import source_path

BASE: dict[str, Any] = {
    "seed": 3,
    "tokenizer": {"kind": "bpe", "vocab_size": 512},
    "data": {"train": ["wikitext2-raw-test"], "max_chars_per_source": 60_000,
             "heldout_tokens": 1024},
    "model": {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 48, "experts": 4,
              "top_k": 2, "max_positions": 64},
    "train": {"steps": 20, "batch": 4, "seq_len": 32, "warmup": 2, "lr": 1e-2,
              "checkpoint_every": 5},
}
UPCYCLE: dict[str, Any] = {
    "parts": 4, "router_mix": 0.5, "seed": 0,
    "train": {"steps": 8, "batch": 4, "seq_len": 32, "warmup": 2, "lr": 3e-3,
              "checkpoint_every": 4},
}


def _random_model() -> TinyMoELM:
    cfg = ModelConfig(vocab_size=97, layers=2, hidden=32, heads=4, kv_heads=2, ffn=48,
                      experts=4, top_k=2, max_positions=64)
    model = TinyMoELM(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3, generator=gen) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model.eval()


def test_split_without_router_tilt_reproduces_the_base_model() -> None:
    base = _random_model()
    split = split_into_finer_experts(base, parts=4, router_mix=0.0, seed=0)
    assert (split.cfg.experts, split.cfg.top_k, split.cfg.ffn) == (16, 8, 12)
    ids_BT = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref_BTV, _ = base(ids_BT)
        got_BTV, _ = split(ids_BT)
        tilted_BTV, _ = split_into_finer_experts(base, 4, 0.5, 0)(ids_BT)
    assert ref_BTV.abs().max() > 1.0
    assert torch.allclose(ref_BTV, got_BTV, atol=1e-4, rtol=0)
    assert not torch.allclose(ref_BTV, tilted_BTV, atol=1e-3)  # the tilt does route


def test_split_rejects_a_non_divisor() -> None:
    with pytest.raises(MoefleetError, match="parts=5"):
        split_into_finer_experts(_random_model(), parts=5, router_mix=0.0, seed=0)


def test_upcycled_model_trains_saves_and_reports_perplexities(tmp_path: Path) -> None:
    try:
        source_path("wikitext2-tokens-valid")
    except DataError:
        pytest.skip("needs the shared WikiText-2 valid file")
    base_dir = tmp_path / "base"
    base_dir.mkdir()
    report = entry.build(base_dir, copy.deepcopy(BASE), None)
    (base_dir / "build.json").write_text(__import__("json").dumps(report))
    out = tmp_path / "e16"
    out.mkdir()
    rep = finegrain_entry.upcycle(base_dir, out, UPCYCLE, None, tmp_path / "ckpt")
    ppl = rep["heldout_perplexity"]
    assert set(ppl) == {"base", "split_init", "result"}
    assert all(1.0 < v < 600 for v in ppl.values())
    assert rep["train"]["curve"][-1][1] < rep["train"]["curve"][0][1] + 0.5
    adapter = load_adapter(out)
    assert adapter.num_experts(adapter.moe_layers[0]) == 16 and adapter.top_k == 8
    assert not (tmp_path / "ckpt").exists()


def test_zoo_entry_is_registered_with_its_base_key() -> None:
    e = zoo.get_entry("tiny-moe-lm-e32")
    assert e.recipe["base_key"] == zoo.get_entry("tiny-moe-lm").key()
    with pytest.raises(MoefleetError, match="parts"):
        finegrain_entry._parse({**e.recipe, "parts": 0})
