"""Routing-trace schema and Parquet I/O.

A trace has one row per (token, MoE layer):

=============  ======================  =================================================
column         type                    meaning
=============  ======================  =================================================
request_id     string                  the prompt the token belongs to
layer          int16                   block index of the MoE layer (0-based, all blocks)
position_id    int32                   position of the token in its request (0-based)
token_id       int32                   the token's vocabulary id
attention_id   int32                   token id of the key with the highest attention
                                       probability summed over heads, in the attention
                                       block of the same layer (just before its experts);
                                       -1 if the trace was recorded without attention ids
expert_ids     fixed list<int16>[K]    the top-k experts, in the router's order
gate_weights   fixed list<float32>[K]  their gate weights (as the model combines them)
=============  ======================  =================================================

Rows are ordered by request, then layer, then position. File-level metadata (Parquet
schema metadata, key ``moefleet``) is a JSON object with ``schema_version``, ``model``,
``family``, ``dataset``, ``tokenizer``, ``moe_layers``, ``num_experts`` (per MoE layer),
``top_k``, ``num_requests``, ``num_tokens`` and ``created``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from moefleet.errors import DataError
from moefleet.io import atomic_path

SCHEMA_VERSION = 1
META_KEY = b"moefleet"
REQUIRED_META = ("model", "moe_layers", "num_experts", "top_k")


def arrow_schema(top_k: int) -> pa.Schema:
    return pa.schema(
        [
            ("request_id", pa.string()),
            ("layer", pa.int16()),
            ("position_id", pa.int32()),
            ("token_id", pa.int32()),
            ("attention_id", pa.int32()),
            ("expert_ids", pa.list_(pa.int16(), top_k)),
            ("gate_weights", pa.list_(pa.float32(), top_k)),
        ]
    )


@dataclass
class Trace:
    """A routing trace in memory: the Arrow table plus its metadata."""

    table: pa.Table
    meta: dict[str, Any]

    @property
    def moe_layers(self) -> list[int]:
        return [int(x) for x in self.meta["moe_layers"]]

    @property
    def top_k(self) -> int:
        return int(self.meta["top_k"])

    def num_experts(self, layer: int) -> int:
        return int(self.meta["num_experts"][self.moe_layers.index(layer)])

    @property
    def num_tokens(self) -> int:
        """Tokens per layer (every token appears once in each MoE layer)."""
        return self.table.num_rows // max(1, len(self.moe_layers))

    def column(self, name: str) -> np.ndarray:
        col = self.table.column(name)
        if name in ("expert_ids", "gate_weights"):
            flat = col.combine_chunks().flatten().to_numpy()
            return flat.reshape(-1, self.top_k)
        return col.to_numpy()

    def layer_rows(self, layer: int) -> Trace:
        mask = pc.equal(self.table.column("layer"), pa.scalar(layer, pa.int16()))
        return Trace(self.table.filter(mask), self.meta)

    def popularity(self) -> np.ndarray:
        """counts_LE: how many token slots each expert got, per MoE layer (padded to max E)."""
        layers = self.moe_layers
        max_e = max(int(e) for e in self.meta["num_experts"])
        counts_LE = np.zeros((len(layers), max_e), dtype=np.int64)
        layer_col = self.column("layer")
        ids_NK = self.column("expert_ids")
        for li, layer in enumerate(layers):
            sel = ids_NK[layer_col == layer].reshape(-1)
            counts_LE[li] = np.bincount(sel, minlength=max_e)[:max_e]
        return counts_LE


def write_trace(trace: Trace, path: str | Path) -> Path:
    """Write atomically; the file appears only once it is complete."""
    path = Path(path)
    meta = {"schema_version": SCHEMA_VERSION, **trace.meta}
    table = trace.table.replace_schema_metadata({META_KEY: json.dumps(meta).encode()})
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return path


def read_trace(path: str | Path) -> Trace:
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"trace file {path} does not exist",
            "record one with: moefleet profile --model M --dataset D --out trace.parquet",
        )
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise DataError(
            f"{path} is not a readable Parquet file: {err}", "re-record it with moefleet profile"
        ) from err
    raw = (table.schema.metadata or {}).get(META_KEY)
    if raw is None:
        raise DataError(
            f"{path} has no moefleet metadata; it was not written by moefleet profile",
            "re-record it with moefleet profile",
        )
    meta = json.loads(raw)
    missing_meta = [k for k in REQUIRED_META if k not in meta]
    expected = arrow_schema(int(meta.get("top_k", 1)))
    missing_cols = [n for n in expected.names if n not in table.column_names]
    if missing_meta or missing_cols:
        raise DataError(
            f"{path} is missing {', '.join(missing_meta + missing_cols)}",
            "re-record it with moefleet profile",
        )
    if meta.get("schema_version", 0) > SCHEMA_VERSION:
        raise DataError(
            f"{path} uses trace schema v{meta['schema_version']}, newer than this moefleet "
            f"(v{SCHEMA_VERSION})",
            "upgrade moefleet",
        )
    return Trace(table.select(expected.names).cast(expected), meta)
