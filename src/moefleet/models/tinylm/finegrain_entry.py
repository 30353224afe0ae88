"""The zoo entry ``tiny-moe-lm-e32``: tiny-moe-lm upcycled to 32 fine-grained experts.

Many small experts per layer (top-8 of 32) is the shape BrownoutServe's united experts
and Remoe's expert placement are about (the papers' models have 60-64); training such a
model from scratch on 2 cores is slow, so it is upcycled: every expert of the trained
``tiny-moe-lm`` is split into 4 by neuron clustering (:mod:`.finegrain`, exact at init),
router rows are tilted towards each part's neurons, and the whole model is trained a
little more on the same corpus so routing becomes fine-grained.

Build stages: build/load the base (zoo-cached) -> token streams with the base's
tokenizer (cached in the checkpoint dir) -> split -> train (checkpointed, resumable)
-> held-out eval of the base, the split-at-init and the result on the same windows
-> save as HF Mixtral. The recipe holds the base's zoo key, so a rebuilt base rebuilds
this model too.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

from moefleet.errors import DataError
from moefleet.io import atomic_path
from moefleet.models.tinylm import entry as base_entry
from moefleet.models.tinylm.recipe import RecipeError, TrainSpec, _section
from moefleet.models.zoo import ProgressFn, ZooEntry, register
from moefleet.paths import cache_dir
from moefleet.torch_io import load_torch_data

NAME = "tiny-moe-lm-e32"

DEFAULT_RECIPE: dict[str, Any] = {
    "base": base_entry.NAME,
    "base_key": base_entry.ENTRY.key(),
    "parts": 4,
    "router_mix": 0.5,
    "seed": 0,
    "train": dataclasses.asdict(
        TrainSpec(steps=300, lr=1e-3, warmup=20, checkpoint_every=50, min_lr_ratio=0.1)
    ),
}


def _parse(raw: dict[str, Any]) -> tuple[int, float, int, TrainSpec]:
    known = {"base", "base_key", "parts", "router_mix", "seed", "train"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise RecipeError(f"unknown recipe key(s) {', '.join(unknown)}", f"keys: {sorted(known)}")
    parts, mix, seed = raw.get("parts", 4), raw.get("router_mix", 0.5), raw.get("seed", 0)
    if not isinstance(parts, int) or parts < 1:
        raise RecipeError(f"recipe value parts={parts!r} is out of range", "use an int >= 1")
    if not isinstance(mix, int | float) or mix < 0:
        raise RecipeError(f"recipe value router_mix={mix!r} is out of range", "use >= 0")
    spec = _section(TrainSpec, raw.get("train", {}), "train")
    return parts, float(mix), int(seed), spec


def checkpoint_dir(raw_recipe: dict[str, Any]) -> Path:
    key = dataclasses.replace(ENTRY, recipe=raw_recipe).key()
    return cache_dir() / "checkpoints" / f"{NAME}-{key}"


def _streams(base_dir: Path, base_recipe: dict[str, Any], where: Path) -> tuple[Any, Any, Any]:
    """(tokenizer, train stream, held-out stream): the base's own data, re-encoded with
    the base's saved tokenizer and cached in ``where`` (a resumed build reuses them)."""
    import torch
    from transformers import AutoTokenizer

    from moefleet.models.tinylm import corpus

    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    f = where / "streams.pt"
    if f.is_file():
        saved = load_torch_data(f, "token streams", "delete it to re-tokenise")
        return tokenizer, saved["train"], saved["heldout"]
    data = base_recipe["data"]
    parts = [
        corpus.encode_docs(tokenizer, corpus.read_source(n, data["max_chars_per_source"]), True)
        for n in data["train"]
    ]
    heldout = corpus.encode_docs(tokenizer, corpus.read_source(data["heldout"]), False)
    where.mkdir(parents=True, exist_ok=True)
    with atomic_path(f) as tmp:
        torch.save({"train": torch.cat(parts), "heldout": heldout}, tmp)
    return tokenizer, torch.cat(parts), heldout


def upcycle(
    base_dir: Path, out: Path, raw: dict[str, Any], progress: ProgressFn | None, ckpt: Path
) -> dict[str, Any]:
    """Split the model saved in ``base_dir``, train it, save it into ``out``; the report."""
    import torch
    from transformers import MixtralForCausalLM

    from moefleet.models.tinylm import corpus
    from moefleet.models.tinylm.convert import from_hf, to_hf
    from moefleet.models.tinylm.evaluate import evaluate, hf_max_abs_diff, windows
    from moefleet.models.tinylm.finegrain import split_into_finer_experts
    from moefleet.models.tinylm.train import train

    parts, mix, seed, spec = _parse(raw)
    t_start, cpu_start = time.perf_counter(), time.process_time()
    base_report = json.loads((base_dir / "build.json").read_text())
    base_recipe = base_report["recipe_parsed"]

    def report(done: int, what: str) -> None:
        if progress is not None:
            progress(done, spec.steps, what)

    with base_entry._threads(spec.threads):
        report(0, "encoding the base model's corpus")
        tokenizer, train_L, heldout_L = _streams(base_dir, base_recipe, ckpt)
        if train_L.numel() <= spec.seq_len:
            raise DataError(f"the training text is only {train_L.numel()} tokens long",
                            f"give more than train.seq_len={spec.seq_len} tokens")
        base = from_hf(MixtralForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32))
        split = split_into_finer_experts(base, parts, mix, seed)
        init_state = {k: v.clone() for k, v in split.state_dict().items()}
        result = train(split.cfg, spec, train_L, seed, ckpt, init_state=init_state,
                       step_done=lambda s, n, loss: report(s, f"training, loss {loss:.3f}"),
                       log_every=max(1, spec.steps // 100))
        report(spec.steps, "evaluating base, split-at-init and result on held-out text")
        eval_WT = windows(heldout_L, base_recipe["data"]["heldout_tokens"], spec.seq_len)
        bytes_V = corpus.token_byte_lengths(tokenizer)
        evals = {
            name: evaluate(m, eval_WT, train_L, bytes_V)
            for name, m in (("base", base), ("split_init", split), ("result", result.model))
        }
        eos = int(tokenizer.eos_token_id)
        hf = to_hf(result.model, bos_id=eos, eos_id=eos, aux_coef=spec.aux_coef)
        check_BT = (eval_WT if eval_WT.numel() else windows(train_L, 4 * spec.seq_len,
                                                             spec.seq_len))[:4]
        diff = hf_max_abs_diff(result.model, hf, check_BT)
        if not diff <= base_entry.HF_TOLERANCE:
            raise RuntimeError(f"converted model differs by {diff:.2e}")
        hf.save_pretrained(out)
        tokenizer.save_pretrained(out)
    shutil.rmtree(ckpt, ignore_errors=True)
    cfg = result.model.cfg
    return {
        "base": {"name": raw.get("base"), "dir": base_dir.name,
                 "build_heldout_perplexity": base_report.get("heldout_eval", {}).get("perplexity")},
        "architecture": dataclasses.asdict(cfg),
        "params": sum(p.numel() for p in result.model.parameters()),
        "heldout_perplexity": {k: v.get("perplexity") for k, v in evals.items()},
        "heldout_bits_per_byte": {k: v.get("bits_per_byte") for k, v in evals.items()},
        "heldout_eval": evals["result"],
        "train": {
            "steps": result.steps, "resumed_from_step": result.resumed_from,
            "wall_s": round(result.wall_s, 2), "cpu_s": round(result.cpu_s, 2),
            "threads": spec.threads, "bf16": result.bf16,
            "curve": [[s, round(ce, 4), round(aux, 4)] for s, ce, aux in result.curve],
        },
        "hf_max_abs_logit_diff": diff,
        "timings_s": {"total": round(time.perf_counter() - t_start, 2),
                      # CPU time of this process: the cost without the other tenants' load.
                      "total_cpu": round(time.process_time() - cpu_start, 2)},
    }


def build(out: Path, raw: dict[str, Any], progress: ProgressFn | None) -> dict[str, Any]:
    from moefleet.models import zoo

    _parse(raw)  # bad recipes fail before the (long) base build
    base_dir = zoo.build(raw["base"])
    return upcycle(base_dir, out, raw, progress, checkpoint_dir(raw))


ENTRY = ZooEntry(
    name=NAME,
    description="Mixtral class, 4 layers, 32 fine-grained experts top-8, hidden 256: "
    "tiny-moe-lm's experts each split in 4 by neuron clustering, then trained 300 more "
    "steps on its corpus; for united experts (BrownoutServe) and expert placement (Remoe)",
    recipe=DEFAULT_RECIPE,
    build=build,
    load=base_entry._load,
    code_version="1",
    tags=("trained", "decoder", "fine-grained"),
)
register(ENTRY)
