"""Prompt datasets: named datasets from the shared data directory, or a user's own file.

    from moefleet.data import load_prompts, list_datasets
    prompts = load_prompts("wikitext2", split="test", limit=32)
    prompts = load_prompts("my_prompts.jsonl")

Every load returns a non-empty list of :class:`Prompt` with unique, stable request ids.
Names, folders, splits and licences: :func:`list_datasets`. Resolution rules:
:mod:`moefleet.data.registry`; file formats: :mod:`moefleet.data.files`.
"""

from moefleet.data.files import load_file
from moefleet.data.prompts import Prompt, paragraphs
from moefleet.data.registry import (
    DatasetInfo,
    dataset_names,
    list_datasets,
    load_prompts,
    split_dataset,
)

__all__ = [
    "DatasetInfo",
    "Prompt",
    "dataset_names",
    "list_datasets",
    "load_file",
    "load_prompts",
    "paragraphs",
    "split_dataset",
]
