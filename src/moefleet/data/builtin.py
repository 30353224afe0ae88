"""The named datasets: where each lives under a data directory and how it is parsed.

Each loader takes the dataset's folder and a split and returns every prompt of that split
(in file order, ids independent of ``limit``). Fraction splits (train/test by position)
are applied by the registry, not here, so they work the same for every dataset that has
them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moefleet.data.files import load_file, parse_jsonl, read_text
from moefleet.data.prompts import Prompt
from moefleet.errors import DataError

# (folder, split) -> prompts, in file order.
Loader = Callable[[Path, str], list[Prompt]]


@dataclass(frozen=True)
class DatasetSpec:
    """A named dataset.

    ``splits`` lists every accepted split; ``default_split`` is one of them. When
    ``train_percent`` is set the splits are ``all``/``train``/``test`` and the registry
    cuts the full list: ``train`` = the first ``n * train_percent // 100`` prompts,
    ``test`` = the rest (contiguous, deterministic, disjoint, together all ``n``).
    """

    name: str
    description: str
    folder: str
    files: tuple[str, ...]
    licence: str
    splits: tuple[str, ...]
    default_split: str
    load: Loader
    train_percent: int | None = None


def _wikitext2(folder: Path, split: str) -> list[Prompt]:
    return load_file(folder / "wiki.test.raw", id_prefix="wikitext2", fmt="text")


def _wikitext2_tokens(folder: Path, split: str) -> list[Prompt]:
    # Both files number from 0, so the split is part of the id to keep ids distinct.
    return load_file(folder / f"{split}.txt", id_prefix=f"wikitext2-tokens:{split}", fmt="text")


def _c4(folder: Path, split: str) -> list[Prompt]:
    return load_file(folder / "c4_demo.jsonl", id_prefix="c4", fmt="jsonl")


def _sharegpt(folder: Path, split: str) -> list[Prompt]:
    # Items carry their own ids, so request_id is the ShareGPT id; text is the first
    # human turn (the file holds only that turn, so reference stays None).
    return load_file(folder / "ShareGPT_V3_filtered_500.json", id_prefix="sharegpt", fmt="json")


def _alpaca(folder: Path, split: str) -> list[Prompt]:
    return load_file(folder / "alpaca_en_demo.json", id_prefix="alpaca", fmt="json")


def _piqa(folder: Path, split: str) -> list[Prompt]:
    """Goal as text; reference = ``sol1`` when the line-aligned label is 0, ``sol2`` when 1."""
    data_path = folder / "valid.jsonl"
    labels_path = folder / "valid-labels.lst"
    records = parse_jsonl(data_path, read_text(data_path))
    labels = [line.strip() for line in read_text(labels_path).split("\n") if line.strip()]
    if len(labels) != len(records):
        raise DataError(
            f"{labels_path} has {len(labels)} labels but {data_path} has {len(records)} items",
            "the two files must be line-aligned; restore them from the PIQA release",
        )
    out: list[Prompt] = []
    for (where, record), label in zip(records, labels, strict=True):
        if label not in ("0", "1"):
            raise DataError(
                f"{labels_path}: label {label!r} for {data_path} {where} is not 0 or 1",
                "restore the labels file from the PIQA release",
            )
        fields = ("id", "goal", "sol1", "sol2")
        if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in fields):
            raise DataError(
                f"{data_path} {where}: expected an object with string id, goal, sol1, sol2",
                "restore the file from the PIQA release",
            )
        out.append(
            Prompt(
                request_id=record["id"],
                text=record["goal"],
                reference=record["sol1"] if label == "0" else record["sol2"],
            )
        )
    return out


_FRACTION_SPLITS = ("all", "train", "test")

DATASETS: tuple[DatasetSpec, ...] = (
    DatasetSpec(
        name="wikitext2",
        description="WikiText-2 raw test split, one prompt per paragraph "
        "(train = first 95%, test = last 5%)",
        folder="wikitext2_raw_test",
        files=("wiki.test.raw",),
        licence="CC BY-SA 3.0 / GFDL (Merity et al. 2016)",
        splits=_FRACTION_SPLITS,
        default_split="all",
        load=_wikitext2,
        train_percent=95,
    ),
    DatasetSpec(
        name="wikitext2-tokens",
        description="WikiText-2 tokenized (<unk>, @-@), test or valid, one prompt per paragraph",
        folder="wikitext2_tokens",
        files=("test.txt", "valid.txt"),
        licence="CC BY-SA 3.0 (WikiText-2); repo BSD-3-Clause",
        splits=("test", "valid"),
        default_split="test",
        load=_wikitext2_tokens,
    ),
    DatasetSpec(
        name="c4",
        description="300 C4 web documents, one prompt per document",
        folder="c4_demo",
        files=("c4_demo.jsonl",),
        licence="ODC-BY (C4, allenai/c4); repo Apache-2.0",
        splits=("all",),
        default_split="all",
        load=_c4,
    ),
    DatasetSpec(
        name="sharegpt",
        description="500 ShareGPT V3 first human turns (train = first 400, test = last 100)",
        folder="sharegpt_v3_filtered_500",
        files=("ShareGPT_V3_filtered_500.json",),
        licence="Apache-2.0 per dataset card; user-shared ChatGPT conversations, ToS caveats",
        splits=_FRACTION_SPLITS,
        default_split="all",
        load=_sharegpt,
        train_percent=80,
    ),
    DatasetSpec(
        name="alpaca",
        description="999 Alpaca-GPT4 instructions (+input), reference = the answer",
        folder="alpaca_en_demo",
        files=("alpaca_en_demo.json",),
        licence="CC BY-NC 4.0 (non-commercial); repo Apache-2.0",
        splits=("all",),
        default_split="all",
        load=_alpaca,
    ),
    DatasetSpec(
        name="piqa",
        description="1,838 PIQA validation goals, reference = the correct solution",
        folder="piqa",
        files=("valid.jsonl", "valid-labels.lst"),
        licence="AFL-3.0 (PIQA, Bisk et al. 2020); repo MIT",
        splits=("all",),
        default_split="all",
        load=_piqa,
    ),
)
