"""Valid seed files (no model weights needed) and the hostile variants the findings list
(``shared/findings/bad-input-2026-11.md``) is made of, by class.

The seed model is the hand-built BERT-sized profile of ``tests/plan_helpers`` with a
synthetic routing trace of the same model, so every command that reads files runs in
well under a second."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from moefleet.traces.schema import Trace, arrow_schema, write_trace
from tests.plan_helpers import bert_profile

MODEL = "bert-moe-hand"
LAYERS = 2
EXPERTS = 8
TOP_K = 2


def make_trace(tokens: int = 256, seed: int = 0, model: str = MODEL) -> Trace:
    """A routing trace of ``tokens`` tokens in one request per 64 tokens (seeded)."""
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {n: [] for n in arrow_schema(TOP_K).names}
    for layer in range(LAYERS):
        for t in range(tokens):
            rows["request_id"].append(f"r{t // 64}")
            rows["layer"].append(layer)
            rows["position_id"].append(t % 64)
            rows["token_id"].append(int(rng.integers(0, 1000)))
            rows["attention_id"].append(-1)
            ids = rng.choice(EXPERTS, size=TOP_K, replace=False)
            rows["expert_ids"].append([int(i) for i in ids])
            w = rng.random(TOP_K)
            rows["gate_weights"].append((w / w.sum()).tolist())
    table = pa.table(rows, schema=arrow_schema(TOP_K))
    # Rows ordered by request, then layer, then position (the schema's order).
    order = sorted(range(table.num_rows),
                   key=lambda i: (rows["request_id"][i], rows["layer"][i], rows["position_id"][i]))
    table = table.take(pa.array(order))
    meta = {"model": model, "family": "bert", "dataset": "synthetic", "tokenizer": "none",
            "moe_layers": list(range(LAYERS)), "num_experts": [EXPERTS] * LAYERS,
            "top_k": TOP_K, "num_requests": (tokens + 63) // 64, "num_tokens": tokens}
    return Trace(table, meta)


def seed_files(folder: Path) -> dict[str, Path]:
    """profile.json, trace.parquet, counts.npy in ``folder`` (valid, one model)."""
    folder.mkdir(parents=True, exist_ok=True)
    prof = bert_profile(layers=LAYERS)
    paths = {"profile": prof.save(folder / "profile.json"),
             "trace": write_trace(make_trace(), folder / "trace.parquet")}
    np.save(folder / "counts.npy", np.full((LAYERS, EXPERTS), 64))
    paths["counts"] = folder / "counts.npy"
    return paths


def files_under(folder: Path) -> set[str]:
    """Every file (relative path) under ``folder``, for 'no partial output' checks."""
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def binary_file(path: Path) -> Path:
    path.write_bytes(bytes(range(256)) * 8)
    return path


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def write_json(path: Path, obj: object) -> Path:
    path.write_text(json.dumps(obj))
    return path


def umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
