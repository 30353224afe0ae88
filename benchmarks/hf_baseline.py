"""The Hugging Face ``generate`` baseline the engine benchmarks compare against: static
left-padded greedy batches (or one request at a time), each row held to its exact
output length so both sides do the same work."""

from __future__ import annotations

import time
from typing import Any

import torch


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so a wall-clock reading covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_generate(model: Any, batch: list[list[int]], new: int, device: str) -> list[list[int]]:
    """One left-padded greedy batch of exactly ``new`` tokens; each row's new tokens."""
    width = max(len(p) for p in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        out = model.generate(ids.to(device), attention_mask=mask.to(device),
                             max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0)
    return out[:, width:].tolist()


def run_hf(model: Any, ids: list[list[int]], lens: list[int], size: int,
           device: str) -> tuple[list[list[int]], float, list[int]]:
    """Batches of ``size`` (1: one request at a time): (tokens, wall, rows of each decode
    step: a static batch steps every row until its longest request is done)."""
    got: list[list[int]] = []
    steps: list[int] = []
    t0 = time.perf_counter()
    for s in range(0, len(ids), size):
        b, n = ids[s: s + size], lens[s: s + size]
        rows = hf_generate(model, b, max(n), device)
        got += [r[:k] for r, k in zip(rows, n, strict=True)]
        steps += [len(b)] * (max(n) - 1)  # the first token comes from the prefill
    sync(torch.device(device))
    return got, time.perf_counter() - t0, steps
