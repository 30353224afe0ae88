"""Find datasets by name or path and load their prompts.

Resolution of ``load_prompts(name_or_path)``:

1. a registered name (case-insensitive, surrounding spaces ignored) wins, even over a
   file of the same name in the current directory (write ``./c4`` for the file);
2. else an existing file is loaded by :func:`moefleet.data.files.load_file`;
3. else a string that looks like a path (has a separator or a prompt-file extension)
   is reported as a missing file, anything else as an unknown dataset name.

A named dataset is read from the first directory of
:func:`moefleet.paths.shared_data_dirs` whose dataset folder holds all of the dataset's
files; the package's embedded copies come last, so full copies win when present.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path

from moefleet import paths
from moefleet.data.builtin import DATASETS, DatasetSpec
from moefleet.data.files import SUPPORTED_EXTENSIONS, load_file
from moefleet.data.prompts import Prompt
from moefleet.errors import DataError, UnknownNameError

_BY_NAME: dict[str, DatasetSpec] = {spec.name: spec for spec in DATASETS}


@dataclass(frozen=True)
class DatasetInfo:
    """What :func:`list_datasets` reports for one named dataset.

    ``found`` is true exactly when ``location`` is not None, i.e. some data directory holds
    the folder with all its files; ``location`` is that folder.
    """

    name: str
    description: str
    folder: str
    licence: str
    splits: tuple[str, ...]
    default_split: str
    found: bool
    location: Path | None


def split_dataset(ref: str) -> tuple[str, str | None]:
    """``name:split`` -> (name, split); paths keep their colons only if they exist."""
    if ":" in ref and not Path(ref).exists():
        name, split = ref.rsplit(":", 1)
        return name, split or None
    return ref, None


def dataset_names() -> list[str]:
    """Registered dataset names, in listing order."""
    return [spec.name for spec in DATASETS]


def _locate(spec: DatasetSpec) -> Path | None:
    for base in paths.shared_data_dirs():
        folder = base / spec.folder
        if all((folder / name).is_file() for name in spec.files):
            return folder
    return None


def list_datasets() -> list[DatasetInfo]:
    """Every named dataset, with whether (and where) it was found on disk."""
    out: list[DatasetInfo] = []
    for spec in DATASETS:
        location = _locate(spec)
        out.append(
            DatasetInfo(
                name=spec.name,
                description=spec.description,
                folder=spec.folder,
                licence=spec.licence,
                splits=spec.splits,
                default_split=spec.default_split,
                found=location is not None,
                location=location,
            )
        )
    return out


def _require_folder(spec: DatasetSpec) -> Path:
    location = _locate(spec)
    if location is not None:
        return location
    searched = [str(d) for d in paths.shared_data_dirs()]
    where = ", ".join(searched) if searched else "no data directory exists"
    files = ", ".join(spec.files)
    raise DataError(
        f"dataset {spec.name!r} not found: no folder {spec.folder}/ with {files} in: {where}",
        f"set MOEFLEET_DATA_DIR to a directory that contains {spec.folder}/",
    )


def _check_limit(limit: int | None) -> None:
    if limit is None:
        return
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise DataError(
            f"limit must be a positive integer, got {limit!r}",
            "pass limit >= 1, or leave it out to load every prompt",
        )


def _resolve_split(spec: DatasetSpec, split: str | None) -> str:
    if split is None:
        return spec.default_split
    key = split.strip().lower()
    if key not in spec.splits:
        raise DataError(
            f"unknown split {split!r} for dataset {spec.name!r}",
            f"valid splits: {', '.join(spec.splits)} (default {spec.default_split})",
        )
    return key


def fraction_split(prompts: list[Prompt], split: str, train_percent: int) -> list[Prompt]:
    """``train`` = first ``n * train_percent // 100`` prompts, ``test`` = the rest, else all.

    Integer arithmetic keeps the cut exact and platform-independent; the two parts are
    contiguous, disjoint and together are the whole list.
    """
    cut = len(prompts) * train_percent // 100
    if split == "train":
        return prompts[:cut]
    if split == "test":
        return prompts[cut:]
    return prompts


def _load_named(spec: DatasetSpec, split: str | None) -> list[Prompt]:
    chosen = _resolve_split(spec, split)
    folder = _require_folder(spec)
    prompts = spec.load(folder, chosen)
    if spec.train_percent is not None:
        prompts = fraction_split(prompts, chosen, spec.train_percent)
    if not prompts:
        raise DataError(
            f"dataset {spec.name!r} split {chosen!r} has no prompts (read from {folder})",
            "use another split, or point MOEFLEET_DATA_DIR at the full data",
        )
    return prompts


def _looks_like_path(text: str) -> bool:
    if os.sep in text or "/" in text or (os.altsep is not None and os.altsep in text):
        return True
    return Path(text).suffix.lower() in SUPPORTED_EXTENSIONS


def _unknown_name(name: str) -> UnknownNameError:
    names = dataset_names()
    close = difflib.get_close_matches(name.strip().lower(), names, n=1)
    guess = f"did you mean {close[0]!r}? " if close else ""
    return UnknownNameError(
        f"unknown dataset {name!r}",
        f"{guess}known datasets: {', '.join(names)}; "
        "a path to a .txt, .jsonl or .json prompt file works too",
    )


def load_prompts(
    name_or_path: str | os.PathLike[str],
    *,
    split: str | None = None,
    limit: int | None = None,
) -> list[Prompt]:
    """Prompts of a named dataset or a prompt file, in file order.

    ``split`` picks a named dataset's split (see :func:`list_datasets`; ``None`` = its
    default); files have no splits and accept only ``None`` or ``"all"``. ``limit`` keeps
    the first ``limit`` prompts of the split. The result is never empty and request ids
    are unique and do not depend on ``limit``.

    Raises UnknownNameError for an unknown name and DataError for missing, empty or
    malformed data, an unknown split, or ``limit <= 0``.
    """
    _check_limit(limit)
    if isinstance(name_or_path, str):
        text = name_or_path
        if not text.strip():
            raise _unknown_name(text)
        spec = _BY_NAME.get(text.strip().lower())
    else:
        text = os.fspath(name_or_path)
        spec = None  # an explicit path object is always a file
    if spec is not None:
        prompts = _load_named(spec, split)
    else:
        path = Path(text).expanduser()
        if not path.exists() and not _looks_like_path(text) and isinstance(name_or_path, str):
            raise _unknown_name(text)
        if split is not None and split.strip().lower() != "all":
            raise DataError(
                f"unknown split {split!r} for prompt file {path}",
                "files have no splits: valid split is 'all' (or leave split out)",
            )
        prompts = load_file(path)
    return prompts[:limit] if limit is not None else prompts
