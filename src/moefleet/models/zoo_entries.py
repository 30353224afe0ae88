"""Zoo entries. Importing this module registers every entry with :mod:`moefleet.models.zoo`.

Each family of model lives in its own module; this file only wires them in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moefleet.models.base import MoEModelAdapter
from moefleet.models.moefy import entries as _moefy  # noqa: F401  (registers minilm-moe-*)
from moefleet.models.tinylm import entry as _tinylm  # noqa: F401  (registers tiny-moe-lm)
from moefleet.models.tinylm import finegrain_entry as _e32  # noqa: F401  (tiny-moe-lm-e32)
from moefleet.models.zoo import ProgressFn, ZooEntry, register


def _build_tiny(out: Path, recipe: dict[str, Any], progress: ProgressFn | None) -> dict[str, Any]:
    from moefleet.models.tiny import tiny_model
    from moefleet.models.tokenizers import gpt2_tokenizer

    tok = gpt2_tokenizer()
    model = tiny_model(recipe["family"], vocab_size=len(tok), seed=recipe["seed"])
    model.save_pretrained(out)
    tok.save_pretrained(out)
    if progress:
        progress(1, 1, "saved")
    return {"params": sum(p.numel() for p in model.parameters())}


def _load_dir(path: Path, name: str) -> MoEModelAdapter:
    from moefleet.models.registry import load_adapter

    adapter = load_adapter(path)
    adapter.name = name
    return adapter


for _family, _label in [
    ("mixtral", "Mixtral"),
    ("qwen2_moe", "Qwen2-MoE"),
    ("olmoe", "OLMoE"),
    ("deepseek_v2", "DeepSeek-V2"),
]:
    register(
        ZooEntry(
            name=f"tiny-{_family.replace('_', '-')}-random",
            description=f"{_label} class, 3 layers, 8 experts top-2, random weights "
            "(GPT-2 BPE); for tests and smoke runs: its routing is meaningless",
            recipe={"family": _family, "seed": 0},
            build=_build_tiny,
            load=_load_dir,
            tags=("random", "decoder"),
        )
    )
