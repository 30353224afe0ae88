"""Profile a model on a prompt set: tokenise, batch, record routing.

Prompts are taken in order; each is truncated to ``max_length`` tokens and the last one
is cut so the trace holds exactly ``max_tokens`` tokens (fewer only if the dataset runs
out, which the metadata reports). Batches are right-padded.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from typing import Any

import torch

from moefleet.errors import DataError, MoefleetError
from moefleet.models.base import MoEModelAdapter
from moefleet.traces.recorder import RoutingRecorder
from moefleet.traces.schema import Trace

ProgressFn = Callable[[int, int], None]  # (tokens done, tokens total)


def tokenize_prompts(
    adapter: MoEModelAdapter,
    texts: Sequence[str],
    *,
    max_tokens: int,
    max_length: int,
) -> list[tuple[int, list[int]]]:
    """(prompt index, token ids) per kept prompt, in order; prompts that tokenise to
    nothing are skipped. Total length == min(max_tokens, all tokens)."""
    if max_tokens <= 0:
        raise MoefleetError(
            f"--max-tokens must be positive, got {max_tokens}", "pass e.g. --max-tokens 2048"
        )
    if max_length <= 1:
        raise MoefleetError(f"--max-length must be > 1, got {max_length}", "use e.g. 256")
    tok = adapter.tokenizer
    if tok is None:
        raise MoefleetError(
            f"model {adapter.name!r} has no tokenizer",
            "save the tokenizer files next to the checkpoint (tokenizer.save_pretrained)",
        )
    out: list[tuple[int, list[int]]] = []
    total = 0
    for index, text in enumerate(texts):
        ids = tok(text, truncation=True, max_length=max_length)["input_ids"]
        if not ids:
            continue
        ids = ids[: max_tokens - total]
        out.append((index, list(ids)))
        total += len(ids)
        if total >= max_tokens:
            break
    if not out:
        raise DataError("the prompts produced no tokens", "use a dataset with non-empty text")
    return out


def profile(
    adapter: MoEModelAdapter,
    request_ids: Sequence[str],
    texts: Sequence[str],
    *,
    max_tokens: int,
    max_length: int = 256,
    batch_size: int = 8,
    attention_ids: bool = True,
    dataset: str = "",
    progress: ProgressFn | None = None,
) -> Trace:
    """Record the routing of up to ``max_tokens`` tokens of ``texts``."""
    if batch_size <= 0:
        raise MoefleetError(f"--batch-size must be positive, got {batch_size}", "use e.g. 8")
    if len(request_ids) != len(texts):
        raise ValueError("request_ids and texts must have the same length")
    kept = tokenize_prompts(adapter, texts, max_tokens=max_tokens, max_length=max_length)
    seqs = [s for _, s in kept]
    rids = [request_ids[i] for i, _ in kept]
    total = sum(len(s) for s in seqs)
    pad = 0
    if adapter.tokenizer is not None and adapter.tokenizer.pad_token_id is not None:
        pad = int(adapter.tokenizer.pad_token_id)
    done = 0
    with RoutingRecorder(adapter, attention_ids=attention_ids) as rec:
        for start in range(0, len(seqs), batch_size):
            batch = seqs[start : start + batch_size]
            T = max(len(s) for s in batch)
            ids_BT = torch.full((len(batch), T), pad, dtype=torch.long)
            mask_BT = torch.zeros((len(batch), T), dtype=torch.long)
            for b, s in enumerate(batch):
                ids_BT[b, : len(s)] = torch.tensor(s)
                mask_BT[b, : len(s)] = 1
            rec.record(rids[start : start + len(batch)], ids_BT, mask_BT)
            done += sum(len(s) for s in batch)
            if progress:
                progress(done, total)
        meta: dict[str, Any] = {
            "dataset": dataset,
            "tokenizer": getattr(adapter.tokenizer, "name_or_path", "") or type(
                adapter.tokenizer
            ).__name__,
            "max_tokens": max_tokens,
            "max_length": max_length,
            "dataset_exhausted": total < max_tokens,
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        }
        return rec.trace(**meta)
