"""A checkpoint's safetensors files, checked against themselves and the config.

Reads only each file's header (8-byte length + JSON), never the tensor data, so a
truncated, padded or mismatched file is refused in milliseconds and before the loader
allocates anything:

- the header length fits the file and is at most 100 MiB; the header is a JSON object
  whose entries each have a known dtype, a shape of non-negative integers and
  ``data_offsets`` that are in order, inside the data, and exactly ``prod(shape) x dtype
  size`` bytes long; the last tensor ends exactly at the end of the file;
- a sharded checkpoint's index names only shards that exist;
- the shapes that the config determines agree with it: the token embedding is
  ``[vocab, hidden]``, layer indices run over exactly ``0..layers-1``, expert indices and
  router rows stay below the expert count.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import struct
from pathlib import Path
from typing import Any

from moefleet.errors import DataError
from moefleet.models.config_schema import ModelConfigCheck

MAX_HEADER_BYTES = 100 << 20
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
               "I8": 1, "U8": 1, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1,
               "F8_E5M2": 1}
_HINT = "the weights are corrupt, truncated or from another model: rebuild or download again"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_ROUTER = re.compile(r"\.(?:block_sparse_moe|mlp)\.gate\.weight$")
_FUSED = re.compile(r"\.experts\.(?:gate_up_proj|down_proj)$")


def read_header(path: Path) -> dict[str, dict[str, Any]]:
    """The tensor entries of one safetensors file, each checked against the file."""
    size = path.stat().st_size
    if size < 8:
        raise DataError(f"{path} is {size} bytes, too short for a safetensors file", _HINT)
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise DataError(f"{path}: its header claims {n} bytes but the file has {size}",
                            _HINT)
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise DataError(f"{path}: the safetensors header is not valid JSON", _HINT) from None
    if not isinstance(header, dict):
        raise DataError(f"{path}: the safetensors header is not a JSON object", _HINT)
    header.pop("__metadata__", None)
    data = size - 8 - n
    end = 0
    spans = []
    for name, entry in header.items():
        entry = entry if isinstance(entry, dict) else {}
        dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(dtype, str) and dtype in DTYPE_BYTES and isinstance(shape, list)
                and isinstance(offs, list) and len(offs) == 2
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                        for d in [*shape, *offs])):
            raise DataError(f"{path}: tensor {name[:80]!r} has a malformed header entry", _HINT)
        begin, stop = offs
        if not begin <= stop <= data:
            raise DataError(f"{path}: tensor {name[:80]!r} lies outside the file's {data} "
                            "bytes of data (truncated?)", _HINT)
        if stop - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise DataError(f"{path}: tensor {name[:80]!r} has shape {shape} but "
                            f"{stop - begin} bytes", _HINT)
        spans.append((begin, stop))
        end = max(end, stop)
    spans.sort()
    for (_, prev_stop), (begin, _) in itertools.pairwise(spans):
        if begin < prev_stop:
            raise DataError(f"{path}: two tensors overlap in the data", _HINT)
    if end != data:
        raise DataError(f"{path}: the tensors end at byte {end} of {data} bytes of data "
                        f"({'truncated' if end > data else 'trailing bytes'})", _HINT)
    return header


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint (via its index when sharded)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        from moefleet.io import load_json_input

        blob = load_json_input(index, "safetensors index")
        wmap = blob.get("weight_map") if isinstance(blob, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise DataError(f"{index} has no weight_map of tensor -> file", _HINT)
        files = []
        for shard in sorted(set(wmap.values())):
            p = (folder / shard).resolve()
            if p.parent != folder.resolve() or not p.is_file():
                raise DataError(f"{index} names shard {shard[:80]!r}, which is not a file "
                                f"in {folder}", _HINT)
            files.append(p)
        return files
    return sorted(p for p in folder.glob("*.safetensors") if p.is_file())


def check_weights(folder: Path, cfg: ModelConfigCheck) -> None:
    """Refuse weights that are malformed or disagree with the checked config."""
    files = weight_files(folder)
    if not files:
        if any(folder.glob("*.bin")):
            return  # torch's weights_only loader reads (or refuses) these itself
        raise DataError(f"{folder} has a config.json but no weights (*.safetensors)",
                        "copy the checkpoint's weight files next to its config.json")
    tensors: dict[str, list[int]] = {}
    for f in files:
        tensors.update({k: v["shape"] for k, v in read_header(f).items()})
    _check_shapes(folder, tensors, cfg)


def _check_shapes(folder: Path, tensors: dict[str, list[int]], cfg: ModelConfigCheck) -> None:
    def wrong(what: str) -> DataError:
        return DataError(f"{folder}: {what}, but config.json says otherwise",
                         "the weights and config.json come from different models: "
                         "restore the matching pair")

    layers: set[int] = set()
    for name, shape in tensors.items():
        if name.endswith("embed_tokens.weight") and shape != [cfg.vocab, cfg.hidden]:
            raise wrong(f"the token embedding is {shape}, not [{cfg.vocab}, {cfg.hidden}]")
        if (m := _LAYER.search(name)) is not None:
            layers.add(int(m.group(1)))
        if (m := _EXPERT.search(name)) is not None and int(m.group(1)) >= cfg.experts:
            raise wrong(f"{name[:80]} is expert {m.group(1)} of a layer")
        if _ROUTER.search(name) and shape != [cfg.experts, cfg.hidden]:
            raise wrong(f"router {name[:80]} is {shape}, not [{cfg.experts}, {cfg.hidden}]")
        if _FUSED.search(name) and (not shape or shape[0] != cfg.experts):
            raise wrong(f"{name[:80]} stacks {shape[:1]} experts, not {cfg.experts}")
    if layers and layers != set(range(cfg.layers)):
        missing = sorted(set(range(cfg.layers)) - layers)[:5]
        extra = sorted(layers - set(range(cfg.layers)))[:5]
        raise wrong(f"the weights hold layers {min(layers)}..{max(layers)} "
                    f"(missing {missing}, extra {extra}) for {cfg.layers} layers")
