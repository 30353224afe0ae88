"""Text sources of ``tiny-moe-lm``: named files under the data directories, as documents.

A *source* is one file under a data directory (:func:`moefleet.paths.shared_data_dirs`,
first match wins) read as a list of documents (non-empty strings, file order).

``wikitext2-tokens-valid`` is the held-out set: the recipe refuses it as a training
source. PIQA is deliberately not a source: its labelled validation split is what PIQA
accuracy would be measured on. ``wikitext2-raw-test`` (the raw form of the same articles
as ``wikitext2-tokens-test``) exists for runs that only have the package's embedded data.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moefleet import paths
from moefleet.errors import DataError


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8-sig")


def _whole_file(path: Path) -> list[str]:
    return [_read(path)]


def _jsonl_text(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in _read(path).splitlines() if line.strip()]


def _alpaca(path: Path) -> list[str]:
    out = []
    for item in json.loads(_read(path)):
        prompt = item["instruction"] + (f"\n\n{item['input']}" if item.get("input") else "")
        out.append(f"{prompt}\n\n{item['output']}")
    return out


def _sharegpt(path: Path) -> list[str]:
    return [turn["value"] for item in json.loads(_read(path)) for turn in item["conversations"]]


@dataclass(frozen=True)
class Source:
    folder: str
    file: str
    read: Callable[[Path], list[str]]


SOURCES: dict[str, Source] = {
    "wikitext2-tokens-test": Source("wikitext2_tokens", "test.txt", _whole_file),
    "wikitext2-tokens-valid": Source("wikitext2_tokens", "valid.txt", _whole_file),
    "wikitext2-raw-test": Source("wikitext2_raw_test", "wiki.test.raw", _whole_file),
    "c4": Source("c4_demo", "c4_demo.jsonl", _jsonl_text),
    "alpaca": Source("alpaca_en_demo", "alpaca_en_demo.json", _alpaca),
    "sharegpt": Source("sharegpt_v3_filtered_500", "ShareGPT_V3_filtered_500.json", _sharegpt),
}


def source_path(name: str) -> Path:
    """The file of source ``name`` in the first data directory that has it."""
    src = SOURCES[name]
    for base in paths.shared_data_dirs():
        candidate = base / src.folder / src.file
        if candidate.is_file():
            return candidate
    raise DataError(
        f"data file {src.folder}/{src.file} (source {name!r}) not found in "
        f"{', '.join(str(d) for d in paths.shared_data_dirs()) or 'any data directory'}",
        "point $MOEFLEET_DATA_DIR at a directory holding the shared data",
    )


def read_source(name: str, max_chars: int | None = None) -> list[str]:
    """Documents of ``name`` in file order; with ``max_chars``, the first documents up to
    that many characters in total (the last one cut)."""
    path = source_path(name)
    try:
        docs = [d for d in SOURCES[name].read(path) if d.strip()]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise DataError(f"{path} is malformed: {err!r}", "restore the file") from err
    if max_chars is None:
        return docs
    out: list[str] = []
    left = max_chars
    for doc in docs:
        if left <= 0:
            break
        out.append(doc[:left])
        left -= len(out[-1])
    return out
