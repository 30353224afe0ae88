"""Fabricated routing traces with known structure, for tests, examples and sanity checks.

Shape legend: N rows, K top-k, T tokens of a request.

``synthetic_trace`` routes each (layer, token id) to a fixed random expert ranking, so a
token-feature predictor should learn it; ``position_effect`` rotates that ranking at odd
positions (only a position-aware predictor can see it) in every layer, or in the MoE
layers it lists, and ``noise`` replaces a token's
experts by random ones with that probability. Attention id = the previous token (the
token itself at position 0), mimicking a causal model's local attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from moefleet.traces.schema import Trace, arrow_schema


def build_trace(request_ids: Sequence[str], layer_N: np.ndarray, pos_N: np.ndarray,
                tok_N: np.ndarray, att_N: np.ndarray, ids_NK: np.ndarray,
                num_experts: Sequence[int], moe_layers: Sequence[int],
                model: str = "synthetic", **meta: Any) -> Trace:
    """A Trace from row-aligned columns (``request_ids`` has one entry per row)."""
    K = int(ids_NK.shape[1])
    schema = arrow_schema(K)
    ids = np.asarray(ids_NK, np.int16)
    weights = np.full(ids.shape, 1.0 / K, np.float32)
    cols = {
        "request_id": pa.array(list(request_ids), pa.string()),
        "layer": pa.array(np.asarray(layer_N, np.int16)),
        "position_id": pa.array(np.asarray(pos_N, np.int32)),
        "token_id": pa.array(np.asarray(tok_N, np.int32)),
        "attention_id": pa.array(np.asarray(att_N, np.int32)),
        "expert_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1)), K),
        "gate_weights": pa.FixedSizeListArray.from_arrays(pa.array(weights.reshape(-1)), K),
    }
    table = pa.table(cols, schema=schema)
    n_req = len(set(request_ids))
    layers = list(moe_layers)
    full = {"model": model, "family": "synthetic", "moe_layers": layers,
            "num_experts": [int(e) for e in num_experts], "top_k": K,
            "num_requests": n_req, "num_tokens": table.num_rows // max(1, len(layers)),
            "attention_ids": bool((np.asarray(att_N) >= 0).any()), **meta}
    return Trace(table, full)


def synthetic_trace(
    num_requests: int = 20,
    tokens: tuple[int, int] = (5, 30),
    vocab: int = 50,
    moe_layers: Sequence[int] = (0, 1),
    num_experts: int | Sequence[int] = 4,
    top_k: int = 2,
    noise: float = 0.1,
    position_effect: bool | Sequence[int] = False,
    seed: int = 0,
    request_prefix: str = "syn",
) -> Trace:
    """A seeded trace whose routing is a function of (layer, token[, position parity])."""
    rng = np.random.default_rng(seed)
    L = len(moe_layers)
    # Fixed per-(layer, token) expert ranking: the routing "truth" (same for every seed
    # offset of the requests, so train and test traces share it via ``seed`` of the rule).
    rule_rng = np.random.default_rng(12345)
    experts_L = [num_experts] * L if isinstance(num_experts, int) else list(num_experts)
    ranks = [np.argsort(rule_rng.random((vocab, e)), axis=1) for e in experts_L]
    rid: list[str] = []
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("layer", "pos", "tok", "att", "ids")}
    for r in range(num_requests):
        T = int(rng.integers(tokens[0], tokens[1] + 1))
        # Zipf-like token ids so some tokens are frequent and some rare.
        tok = np.minimum(rng.zipf(1.3, T) - 1, vocab - 1).astype(np.int64)
        pos = np.arange(T)
        att = np.r_[tok[:1], tok[:-1]]
        for li, layer in enumerate(moe_layers):
            rank_TE = ranks[li][tok]
            if position_effect is True or (
                not isinstance(position_effect, bool) and layer in position_effect
            ):
                rank_TE = np.where((pos % 2 == 1)[:, None], np.roll(rank_TE, 1, axis=1), rank_TE)
            ids = rank_TE[:, :top_k].copy()
            flip = rng.random(T) < noise
            if flip.any():
                rand = rng.random((int(flip.sum()), experts_L[li]))
                ids[flip] = np.argsort(rand, axis=1)[:, :top_k]
            rid.extend([f"{request_prefix}:{r:04d}"] * T)
            cols["layer"].append(np.full(T, layer))
            cols["pos"].append(pos)
            cols["tok"].append(tok)
            cols["att"].append(att)
            cols["ids"].append(ids)
    return build_trace(
        rid, np.concatenate(cols["layer"]), np.concatenate(cols["pos"]),
        np.concatenate(cols["tok"]), np.concatenate(cols["att"]),
        np.concatenate(cols["ids"]), experts_L, moe_layers,
    )
