"""The zoo entry ``tiny-moe-lm``: prepare data, train, evaluate, save as HF Mixtral.

Build stages (``progress(done, total, description)`` with ``total`` = training steps):

    tokenizer + token streams (cached in the checkpoint dir) -> train (checkpointed)
      -> held-out eval + balance -> convert to MixtralForCausalLM -> equivalence check
      -> save_pretrained (+ tokenizer) -> drop the checkpoint dir

The checkpoint directory is ``<cache>/checkpoints/tiny-moe-lm-<key>``, where ``key`` is
computed like :meth:`ZooEntry.key` from the recipe being built, so a rebuild of the same
recipe after an interruption resumes, and a different recipe never sees its state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moefleet.errors import DataError
from moefleet.io import atomic_path
from moefleet.models.base import MoEModelAdapter
from moefleet.models.tinylm.recipe import Recipe, parse_recipe, recipe_dict
from moefleet.models.zoo import ProgressFn, ZooEntry, register
from moefleet.paths import cache_dir
from moefleet.torch_io import load_torch_data

if TYPE_CHECKING:
    import torch

# torch, transformers and tokenizers are imported inside the functions that need them:
# importing this module (which registers the entry) must stay cheap for `models list`.

NAME = "tiny-moe-lm"
# Conversion must reproduce our logits; a larger gap means the HF layout changed.
HF_TOLERANCE = 1e-4


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def checkpoint_dir(raw_recipe: dict[str, Any]) -> Path:
    """Where a build of ``raw_recipe`` keeps its resumable state."""
    key = dataclasses.replace(ENTRY, recipe=raw_recipe).key()
    return cache_dir() / "checkpoints" / f"{NAME}-{key}"


def _prepare(recipe: Recipe, where: Path) -> tuple[Any, torch.Tensor, torch.Tensor, list]:
    """(tokenizer, train stream, held-out stream, per-source provenance), cached in
    ``where`` so that a resumed build trains on exactly the tokens it started with."""
    import torch

    from moefleet.models.tinylm import corpus

    tok_file, streams_file = where / "tokenizer.json", where / "streams.pt"
    if streams_file.is_file():
        saved = load_torch_data(streams_file, "token streams", "delete it to re-tokenise")
        if recipe.tokenizer.kind == "bpe":
            from tokenizers import Tokenizer

            tokenizer = corpus.wrap_tokenizer(Tokenizer.from_file(str(tok_file)))
        else:
            tokenizer = _gpt2()
        return tokenizer, saved["train"], saved["heldout"], saved["sources"]

    data = recipe.data
    texts = {name: corpus.read_source(name, data.max_chars_per_source) for name in data.train}
    if recipe.tokenizer.kind == "bpe":
        all_docs = [doc for name in data.train for doc in texts[name]]
        tokenizer = corpus.train_bpe(all_docs, recipe.tokenizer.vocab_size)
    else:
        tokenizer = _gpt2()
    sources, parts = [], []
    for name in data.train:
        ids = corpus.encode_docs(tokenizer, texts[name], eos_after_each=True)
        parts.append(ids)
        path = corpus.source_path(name)
        sources.append(
            {
                "name": name,
                "file": f"{path.parent.name}/{path.name}",
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                "documents": len(texts[name]),
                "chars": sum(len(d) for d in texts[name]),
                "tokens": int(ids.numel()),
            }
        )
    train_L = torch.cat(parts)
    heldout_L = torch.zeros(0, dtype=torch.long)
    if data.heldout_tokens > 0:
        heldout_L = corpus.encode_docs(tokenizer, corpus.read_source(data.heldout), False)
    where.mkdir(parents=True, exist_ok=True)
    if recipe.tokenizer.kind == "bpe":
        with atomic_path(tok_file) as tmp:
            tokenizer.backend_tokenizer.save(str(tmp))
    with atomic_path(streams_file) as tmp:
        torch.save({"train": train_L, "heldout": heldout_L, "sources": sources}, tmp)
    return tokenizer, train_L, heldout_L, sources


def _gpt2() -> Any:
    from moefleet.models.tokenizers import gpt2_tokenizer

    return gpt2_tokenizer()


def build(out: Path, raw_recipe: dict[str, Any], progress: ProgressFn | None) -> dict[str, Any]:
    """Build ``raw_recipe`` into ``out`` (HF ``save_pretrained`` layout); returns the report.

    Raises :class:`~moefleet.models.tinylm.recipe.RecipeError` for a bad recipe and
    :class:`~moefleet.errors.DataError` for missing data, before any training starts.
    """
    from moefleet.models.tinylm import corpus
    from moefleet.models.tinylm.convert import to_hf
    from moefleet.models.tinylm.evaluate import evaluate, hf_max_abs_diff, windows
    from moefleet.models.tinylm.train import train

    t_start, cpu_start = time.perf_counter(), time.process_time()
    recipe = parse_recipe(raw_recipe)
    spec = recipe.train
    ckpt = checkpoint_dir(raw_recipe)

    def report(done: int, what: str) -> None:
        if progress is not None:
            progress(done, spec.steps, what)

    with _threads(spec.threads):
        report(0, "preparing tokenizer and data")
        t0 = time.perf_counter()
        tokenizer, train_L, heldout_L, sources = _prepare(recipe, ckpt)
        prepare_s = time.perf_counter() - t0
        if train_L.numel() <= spec.seq_len:
            raise DataError(
                f"the training text is only {train_L.numel()} tokens long",
                f"give more text than one window of train.seq_len={spec.seq_len} tokens",
            )
        cfg = recipe.model.model_config(len(tokenizer))
        result = train(
            cfg,
            spec,
            train_L,
            recipe.seed,
            ckpt,
            step_done=lambda step, total, loss: report(step, f"training, loss {loss:.3f}"),
            log_every=max(1, spec.steps // 100),
        )
        report(spec.steps, "evaluating on held-out text")
        t0 = time.perf_counter()
        eval_WT = windows(heldout_L, recipe.data.heldout_tokens, spec.seq_len)
        metrics = evaluate(result.model, eval_WT, train_L, corpus.token_byte_lengths(tokenizer))
        eval_s = time.perf_counter() - t0

        report(spec.steps, "converting to MixtralForCausalLM and saving")
        eos = int(tokenizer.eos_token_id)
        hf = to_hf(result.model, bos_id=eos, eos_id=eos, aux_coef=spec.aux_coef)
        some_WT = eval_WT if eval_WT.numel() else windows(train_L, 4 * spec.seq_len, spec.seq_len)
        check_BT = some_WT[:4]
        diff = hf_max_abs_diff(result.model, hf, check_BT)
        if not diff <= HF_TOLERANCE:
            raise RuntimeError(
                f"converted model differs from the trained one by {diff:.2e} > {HF_TOLERANCE}"
            )
        hf.save_pretrained(out)
        tokenizer.save_pretrained(out)

    shutil.rmtree(ckpt, ignore_errors=True)
    timings = {
        "prepare": prepare_s,
        "eval": eval_s,
        "total": time.perf_counter() - t_start,
        # CPU time of this process (all threads): the cost without other processes' load.
        "total_cpu": time.process_time() - cpu_start,
    }
    return _report(recipe, result, sources, train_L, heldout_L, metrics, diff, timings)


def _report(
    recipe: Recipe,
    result: Any,
    sources: list[dict[str, Any]],
    train_L: torch.Tensor,
    heldout_L: torch.Tensor,
    metrics: dict[str, Any],
    hf_diff: float,
    timings: dict[str, float],
) -> dict[str, Any]:
    """The build report (``build.json``); timings cover this run only, not the part of
    an interrupted build it resumed."""
    model, spec = result.model, recipe.train
    cfg = model.cfg
    params = sum(p.numel() for p in model.parameters())
    experts = sum(b.moe.w13_E2FD.numel() + b.moe.w2_EDF.numel() for b in model.block_list)
    tokens_seen = spec.steps * spec.batch * spec.seq_len
    return {
        "recipe_parsed": recipe_dict(recipe),
        "vocab_size": cfg.vocab_size,
        "params": params,
        # Each token runs top_k of the experts' weights, plus everything else.
        "active_params_per_token": params - experts + experts * cfg.top_k // cfg.experts,
        "data": {
            "sources": sources,
            "train_tokens": int(train_L.numel()),
            "heldout": recipe.data.heldout,
            "heldout_tokens_available": int(heldout_L.numel()),
        },
        "train": {
            "steps": result.steps,
            "resumed_from_step": result.resumed_from,
            "tokens_seen": tokens_seen,
            "epochs": round(tokens_seen / max(1, train_L.numel()), 3),
            "wall_s": round(result.wall_s, 2),
            "cpu_s": round(result.cpu_s, 2),
            "tokens_per_s": round(result.tokens_per_s, 1),
            "threads": spec.threads,
            "precision": spec.precision,
            "bf16": result.bf16,  # "native" autocast, "emulated" in float32, or None
            "curve": [[s, round(ce, 4), round(aux, 4)] for s, ce, aux in result.curve],
        },
        "heldout_eval": metrics,
        "hf_max_abs_logit_diff": hf_diff,
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
    }


def _load(path: Path, name: str) -> MoEModelAdapter:
    from moefleet.models.registry import load_adapter

    adapter = load_adapter(path)
    adapter.name = name
    return adapter


DEFAULT_RECIPE: dict[str, Any] = recipe_dict(Recipe())

ENTRY = ZooEntry(
    name=NAME,
    description="Mixtral class, 4 layers, 8 experts top-2, hidden 256, trained by moefleet "
    "on WikiText-2 test + C4 demo + Alpaca + ShareGPT prompts (byte-level BPE 8192); "
    "routing is learned, for generation and routing studies",
    recipe=DEFAULT_RECIPE,
    build=build,
    load=_load,
    code_version="1",
    tags=("trained", "decoder"),
)
register(ENTRY)
