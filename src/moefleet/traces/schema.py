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


#: Experts per MoE layer at most (expert ids are int16).
MAX_EXPERTS = 32_767
#: Rows a trace may hold (tokens x MoE layers).
MAX_ROWS = 200_000_000


def read_trace(path: str | Path) -> Trace:
    """Read and validate a trace. Invariants of the result: the metadata names a model,
    increasing non-negative ``moe_layers`` with one positive ``num_experts`` each and
    ``1 <= top_k <= min(num_experts)``; at least one row; every row's layer is a MoE layer
    and every expert id is in ``[0, num_experts)`` of its layer; gate weights are finite;
    every MoE layer has the same number of rows. Anything else is a ``DataError``."""
    path = Path(path)
    hint = "re-record it with moefleet profile"
    if not path.is_file():
        raise DataError(
            f"trace file {path} does not exist",
            "record one with: moefleet profile --model M --dataset D --out trace.parquet",
        )
    try:
        pf = pq.ParquetFile(path)
        raw = (pf.schema_arrow.metadata or {}).get(META_KEY)
        if raw is None:
            raise DataError(
                f"{path} has no moefleet metadata; it was not written by moefleet profile", hint)
        meta = _check_meta(raw, path)
        if pf.metadata.num_rows > MAX_ROWS:
            raise DataError(f"{path} has {pf.metadata.num_rows} rows; the limit is {MAX_ROWS}",
                            "split the trace")
        table = pq.read_table(path)
    except (pa.ArrowException, OSError, ValueError) as err:
        if isinstance(err, DataError):
            raise
        raise DataError(f"{path} is not a readable Parquet file: {err}", hint) from None
    expected = arrow_schema(int(meta["top_k"]))
    missing_cols = [n for n in expected.names if n not in table.column_names]
    if missing_cols:
        raise DataError(f"{path} is missing {', '.join(missing_cols)}", hint)
    try:
        table = table.select(expected.names).cast(expected)
    except (pa.ArrowException, ValueError) as err:
        raise DataError(f"{path}: columns do not have the trace schema: {err}", hint) from None
    trace = Trace(table, meta)
    _check_rows(trace, path)
    return trace


def _check_meta(raw: bytes, path: Path) -> dict[str, Any]:
    hint = "re-record it with moefleet profile"
    try:
        meta = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: moefleet metadata is not valid JSON: {err}", hint) from None
    if not isinstance(meta, dict):
        raise DataError(f"{path}: moefleet metadata must be a JSON object", hint)
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise DataError(f"{path} is missing {', '.join(missing)}", hint)
    version = meta.get("schema_version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise DataError(f"{path}: metadata field 'schema_version' must be an integer", hint)
    if version > SCHEMA_VERSION:
        raise DataError(
            f"{path} uses trace schema v{version}, newer than this moefleet "
            f"(v{SCHEMA_VERSION})", "upgrade moefleet")

    def ints(name: str, lo: int, hi: int) -> list[int]:
        v = meta[name]
        if not isinstance(v, list) or not v or not all(
                isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi for x in v):
            raise DataError(f"{path}: metadata field '{name}' must be a non-empty list of "
                            f"integers in [{lo}, {hi}], got {str(v)[:80]}", hint)
        return list(v)

    if not isinstance(meta["model"], str) or not meta["model"]:
        raise DataError(f"{path}: metadata field 'model' must be a non-empty string", hint)
    layers = ints("moe_layers", 0, 32_767)
    experts = ints("num_experts", 1, MAX_EXPERTS)
    if layers != sorted(set(layers)):
        raise DataError(f"{path}: metadata field 'moe_layers' must be increasing", hint)
    if len(experts) != len(layers):
        raise DataError(f"{path}: metadata has {len(layers)} moe_layers but "
                        f"{len(experts)} num_experts", hint)
    k = meta["top_k"]
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= min(experts):
        raise DataError(f"{path}: metadata field 'top_k' must be an integer in "
                        f"[1, {min(experts)}], got {k!r}", hint)
    return meta


def _check_rows(trace: Trace, path: Path) -> None:
    hint = "re-record it with moefleet profile"
    table = trace.table
    if table.num_rows == 0:
        raise DataError(f"{path} has no rows", hint)
    for name in ("layer", "expert_ids", "gate_weights"):
        if table.column(name).null_count:
            raise DataError(f"{path}: column '{name}' has missing values", hint)
    layer_col = trace.column("layer")
    ids_NK = trace.column("expert_ids")
    layers = trace.moe_layers
    present, per_layer = np.unique(layer_col, return_counts=True)
    extra = sorted(set(present.tolist()) - set(layers))
    if extra:
        raise DataError(f"{path}: rows for layer(s) {extra[:5]} that metadata 'moe_layers' "
                        f"{layers} does not list", hint)
    if len(present) != len(layers) or len(set(per_layer.tolist())) != 1:
        raise DataError(f"{path}: MoE layers have different row counts "
                        f"{dict(zip(present.tolist(), per_layer.tolist(), strict=True))}; "
                        "every token passes every MoE layer once", hint)
    limit_N = np.zeros(layer_col.shape, dtype=np.int64)
    for layer, e in zip(layers, trace.meta["num_experts"], strict=True):
        limit_N[layer_col == layer] = int(e)
    bad = (ids_NK < 0) | (ids_NK >= limit_N[:, None])
    if bad.any():
        row = int(np.argwhere(bad)[0][0])
        raise DataError(f"{path}: row {row} routes to expert {int(ids_NK[bad][0])}, outside "
                        f"[0, {int(limit_N[row])}) of layer {int(layer_col[row])}", hint)
    gates_NK = trace.column("gate_weights")
    if not np.all(np.isfinite(gates_NK)) or np.any(np.abs(gates_NK) > 1e6):
        raise DataError(f"{path}: gate_weights hold NaN, infinite or absurd values "
                        "(a corrupt file?)", hint)
