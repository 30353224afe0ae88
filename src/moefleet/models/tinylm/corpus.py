"""The tokenizer and token streams for ``tiny-moe-lm`` (text comes from :mod:`.sources`).

Shape legend: L tokens in a stream, V vocabulary.

A training stream is every document of every training source, in recipe order, each
encoded and followed by ``<|endoftext|>``.
Long documents are cut at line ends into pieces of at most ``_PIECE_CHARS`` characters
before encoding (so the Rust tokenizer can encode them in parallel); the cut points are a
pure function of the text, so the stream is deterministic.
"""

from __future__ import annotations

from typing import Any

import torch

from moefleet.models.tinylm.sources import SOURCES, read_source, source_path

__all__ = ["EOS", "SOURCES", "encode_docs", "pieces", "read_source", "source_path",
           "token_byte_lengths", "train_bpe", "wrap_tokenizer"]

EOS = "<|endoftext|>"
_PIECE_CHARS = 8192


def pieces(doc: str) -> list[str]:
    """``doc`` cut after line ends into pieces of at most ``_PIECE_CHARS`` characters
    (a single longer line stays whole); ``"".join(pieces(doc)) == doc``."""
    out: list[str] = []
    current: list[str] = []
    size = 0
    for line in doc.splitlines(keepends=True):
        if size + len(line) > _PIECE_CHARS and current:
            out.append("".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line)
    if current:
        out.append("".join(current))
    return out


def train_bpe(docs: list[str], vocab_size: int) -> Any:
    """A byte-level BPE (GPT-2 pre-tokenisation, ``<|endoftext|>`` = id 0) trained on
    ``docs``; returns a ``transformers.PreTrainedTokenizerFast``.

    Deterministic for the same ``docs`` (checked: identical ``tokenizer.json`` from
    separate processes, and the build determinism test retrains it), although the
    trainer itself runs multi-threaded.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator((p for d in docs for p in pieces(d)), trainer=trainer)
    return wrap_tokenizer(core)


def wrap_tokenizer(core: Any) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=EOS, eos_token=EOS, unk_token=EOS, pad_token=EOS
    )


def encode_docs(tokenizer: Any, docs: list[str], eos_after_each: bool) -> torch.Tensor:
    """ids_L (int64) of ``docs`` concatenated; optionally ``eos`` after every document."""
    eos = int(tokenizer.eos_token_id)
    out: list[int] = []
    for doc in docs:
        for ids in tokenizer(pieces(doc), add_special_tokens=False)["input_ids"]:
            out.extend(ids)
        if eos_after_each:
            out.append(eos)
    return torch.tensor(out, dtype=torch.long)


def token_byte_lengths(tokenizer: Any) -> torch.Tensor:
    """bytes_V: UTF-8 bytes each token stands for (0 for special tokens), so that
    bits per byte = total NLL / ln 2 / sum of the predicted tokens' bytes."""
    byte_of = _byte_decoder()
    special = set(tokenizer.all_special_ids)
    vocab: dict[str, int] = tokenizer.get_vocab()
    lengths = torch.zeros(len(tokenizer), dtype=torch.long)
    for token, idx in vocab.items():
        if idx not in special and idx < len(lengths):
            lengths[idx] = sum(1 for ch in token if ch in byte_of)
    return lengths


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character -> byte table (the inverse of ``bytes_to_unicode``)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}
