"""The expert-popularity predictor interface and what every implementation shares.

Shape legend (suffixes on array names):
    L MoE layers (in ``ModelShape.moe_layers`` order), E experts per layer (padded to the
    largest layer), K experts per token (top-k), T tokens of one request, N rows/tokens,
    P training prompts, D embedding size.

A predictor is fitted on a routing trace (:mod:`moefleet.traces.schema`) and then, for a
batch of requests it has not seen run, predicts ``counts_LE``: the expected number of
token slots each expert of each MoE layer receives. Invariants every implementation keeps
(checked by ``tests/contracts/test_predictors.py``):

- ``counts_LE`` has shape (L, E), is finite and >= 0, and is 0 on padded experts;
- every row sums to K x (tokens in the batch), because each token takes exactly K slots;
- predictions are deterministic for a fixed fitted state (seeded where random);
- ``save`` writes an ``.npz`` (arrays + one JSON string, never pickle) and ``load``
  restores a predictor whose predictions are identical. The JSON records
  ``FORMAT_VERSION``; ``load`` refuses any other version (older or newer) by name,
  since the arrays' meaning is only defined for the version that wrote them;
- a fitted predictor remembers its model (name and :class:`ModelShape`) and refuses a
  trace of another one (:meth:`ExpertPredictor.check_trace`).
"""

from __future__ import annotations

import json
import zipfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Self, TypeVar

import numpy as np

from moefleet import __version__
from moefleet.errors import DataError, MoefleetError
from moefleet.io import atomic_path
from moefleet.models.shape import ModelShape
from moefleet.traces.schema import Trace

FORMAT_VERSION = 1
_META = "__meta__"


@dataclass(frozen=True)
class Request:
    """One request to predict for: its token ids in order (position = index)."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


RequestLike = Request | Sequence[int]


def as_requests(requests: Sequence[RequestLike]) -> list[Request]:
    """Normalise a batch: plain token-id lists become ``Request("req-<i>", ids)``.

    Raises DataError for non-integer or negative token ids.
    """
    out: list[Request] = []
    for i, req in enumerate(requests):
        raw: Sequence[int]
        if isinstance(req, Request):
            rid, text, raw = req.request_id, req.text, req.token_ids
        else:
            rid, text, raw = f"req-{i}", None, req
        arr = np.asarray(raw)
        if arr.size and (arr.ndim != 1 or arr.dtype.kind not in "iu" or int(arr.min()) < 0):
            raise DataError(
                f"request {rid!r} has token ids that are not non-negative integers: "
                f"{arr.reshape(-1)[:8].tolist()}",
                "pass each request as a list of vocabulary ids (ints >= 0)",
            )
        out.append(Request(rid, tuple(int(t) for t in arr.tolist()), text))
    return out


def token_array(requests: Iterable[Request]) -> np.ndarray:
    """Every token id of ``requests``, request after request, as one int64 array."""
    return np.fromiter((t for r in requests for t in r.token_ids), np.int64)


def add_topk_counts(
    counts_LE: np.ndarray, layer_U: np.ndarray, top_UK: np.ndarray, mult_U: np.ndarray
) -> None:
    """Add ``mult_U[u]`` to each expert of ``top_UK[u]`` in layer ``layer_U[u]``, in place.

    ``u`` indexes unique (layer, context) rows; ``mult_U`` is how many tokens share one.
    """
    k = top_UK.shape[1]
    np.add.at(counts_LE, (np.repeat(layer_U, k), top_UK.reshape(-1)), np.repeat(mult_U, k))


def check_same_model(what: str, model_a: str, shape_a: ModelShape, model_b: str,
                     shape_b: ModelShape) -> None:
    """DataError naming both values of every difference between two (model, shape).

    ``what`` names the two sides, e.g. ``"the predictor and the trace"``; the values are
    listed in that order. A missing model name (``""``) matches any name, since traces
    and predictor files may predate the field; the shape must always match.
    """
    diffs = shape_a.differences(shape_b)
    if model_a and model_b and model_a != model_b:
        diffs.insert(0, f"model {model_a!r} vs {model_b!r}")
    if diffs:
        raise DataError(f"{what} come from different models: {'; '.join(diffs)}",
                        "profile with the same --model the predictor was fitted on, or "
                        "refit the predictor on this model's trace")


class ExpertPredictor(ABC):
    """Predicts per-expert token counts for batches of requests from their token ids.

    Subclasses implement ``_fit``, ``_predict_counts``, ``_state`` and ``_from_state``;
    the public methods validate inputs and keep the invariants in the module docstring.
    """

    kind: ClassVar[str]  # the name stored in saved files

    def __init__(self) -> None:
        self.shape: ModelShape | None = None
        self.model: str = ""  # the fitted trace's model name ("" if it recorded none)

    # -- public API ------------------------------------------------------------------
    def fit(self, trace: Trace) -> Self:
        """Learn from a routing trace; returns ``self``. DataError on an empty trace."""
        if trace.table.num_rows == 0 or trace.num_tokens == 0:
            raise DataError(
                "cannot fit a predictor on an empty trace (0 rows)",
                "profile more prompts: moefleet profile --model M --dataset D",
            )
        self.shape = ModelShape.from_trace(trace)
        self.model = str(trace.meta.get("model") or "")
        self._fit(trace)
        return self

    def check_trace(self, trace: Trace) -> None:
        """DataError (naming both values) unless ``trace`` is of the fitted model: same
        model name, MoE layers, experts per layer and top-k."""
        shape = self._require_fitted()
        check_same_model("the predictor and the trace", self.model, shape,
                         str(trace.meta.get("model") or ""), ModelShape.from_trace(trace))

    def predict_counts(self, requests: Sequence[RequestLike]) -> np.ndarray:
        """counts_LE: expected token slots per expert per MoE layer for the whole batch."""
        shape = self._require_fitted()
        reqs = as_requests(requests)
        counts_LE = np.asarray(self._predict_counts(reqs), dtype=np.float64)
        counts_LE[~shape.mask_LE()] = 0.0
        return counts_LE

    def predict_topk(self, token_ids: Sequence[int], k: int) -> np.ndarray:
        """ids_LTK: the k most likely experts of each token (one request), per MoE layer."""
        raise NotImplementedError(
            f"{type(self).__name__} predicts prompt-level expert counts only; it has no "
            "per-token top-k prediction (use bayes, lina or dop for that)"
        )

    def save(self, path: str | Path) -> Path:
        """Write the fitted state as ``.npz`` (arrays + JSON metadata) atomically."""
        shape = self._require_fitted()
        arrays, params = self._state()
        meta = {"kind": self.kind, "format": FORMAT_VERSION, "moefleet": __version__,
                "model": self.model, "shape": shape.to_dict(), "params": params}
        if _META in arrays:
            raise ValueError(f"{_META} is reserved")
        path = Path(path)
        with atomic_path(path) as tmp, open(tmp, "wb") as fh:
            # A file object keeps numpy from appending ".npz" to the temporary name.
            payload: dict[str, Any] = {_META: np.array(json.dumps(meta)), **arrays}
            np.savez(fh, **payload)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Self:
        """Read a file written by ``save`` of this class (see :func:`load_predictor`)."""
        meta, arrays = read_npz(path)
        if meta["kind"] != cls.kind:
            raise DataError(
                f"{path} holds a {meta['kind']!r} predictor, not {cls.kind!r}",
                "load it with moefleet.predict.load_predictor(path)",
            )
        shape = ModelShape.from_dict(meta["shape"])
        obj = cls._from_state(shape, arrays, meta["params"])
        obj.shape = shape
        obj.model = str(meta.get("model") or "")
        return obj

    # -- implementation hooks --------------------------------------------------------
    @abstractmethod
    def _fit(self, trace: Trace) -> None: ...

    @abstractmethod
    def _predict_counts(self, requests: list[Request]) -> np.ndarray: ...

    @abstractmethod
    def _state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """(arrays, JSON-able params) that fully determine the fitted predictor."""

    @classmethod
    @abstractmethod
    def _from_state(
        cls, shape: ModelShape, arrays: dict[str, np.ndarray], params: dict[str, Any]
    ) -> Self:
        """Rebuild a fitted predictor from what ``_state`` returned."""

    # -- helpers ---------------------------------------------------------------------
    def _require_fitted(self) -> ModelShape:
        if self.shape is None:
            raise MoefleetError(
                f"{type(self).__name__} is not fitted", "call .fit(trace) or load a saved one"
            )
        return self.shape

    def _zero_counts_and_tokens(self, requests: list[Request]) -> tuple[np.ndarray, np.ndarray]:
        """A zero counts_LE of the fitted shape and :func:`token_array` of ``requests``."""
        shape = self._require_fitted()
        return np.zeros((shape.num_moe_layers, shape.max_experts)), token_array(requests)

    def _check_k(self, k: int) -> None:
        shape = self._require_fitted()
        if not 1 <= k <= min(shape.num_experts):
            raise DataError(
                f"k must be between 1 and {min(shape.num_experts)} (experts per layer), got {k}",
                f"the model routes each token to top_k={shape.top_k} experts",
            )


_C = TypeVar("_C", bound=type[ExpertPredictor])
# kind -> class; filled by ``register_kind``.
_KINDS: dict[str, type[ExpertPredictor]] = {}


def register_kind(cls: _C) -> _C:
    """Class decorator: make ``load_predictor`` know ``cls.kind``; duplicates are errors."""
    if cls.kind in _KINDS:
        raise ValueError(f"predictor kind {cls.kind!r} is already registered")
    _KINDS[cls.kind] = cls
    return cls


def read_npz(path: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(meta, arrays) of a saved predictor; DataError for anything else."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"predictor file {path} does not exist",
                        "write one with: moefleet predict fit ... -o predictor.npz")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as err:
        raise DataError(f"{path} is not a readable .npz file: {err or type(err).__name__}",
                        "re-create it with moefleet predict fit") from None
    if _META not in arrays:
        raise DataError(f"{path} is not a moefleet predictor (no {_META} entry)",
                        "re-create it with moefleet predict fit")
    try:
        meta = json.loads(str(arrays.pop(_META)))
        if not isinstance(meta, dict):
            raise ValueError("metadata is not a JSON object")
        version = int(meta.get("format", 0))
    except (ValueError, TypeError, AttributeError) as err:
        raise DataError(f"{path} has unreadable predictor metadata: {err}",
                        "re-create it with moefleet predict fit") from err
    if version != FORMAT_VERSION:
        # Files carry no migration path: the arrays' meaning is defined per version.
        writer = f" by moefleet {meta['moefleet']}" if meta.get("moefleet") else ""
        newer = version > FORMAT_VERSION
        raise DataError(
            f"{path} was written{writer} in predictor format v{version}; this moefleet "
            f"({__version__}) reads format v{FORMAT_VERSION} only",
            "upgrade moefleet to read it" if newer else
            "refit it with this moefleet: moefleet predict fit ... -o predictor.npz",
        )
    for key in ("kind", "shape", "params"):
        if key not in meta:
            raise DataError(f"{path} predictor metadata lacks {key!r}",
                            "re-create it with moefleet predict fit")
    for name, arr in arrays.items():
        # Fitted state is numeric: a NaN or an empty table is a corrupt file, not a model.
        if arr.dtype.kind not in "biuf" or arr.size == 0 or (
                arr.dtype.kind == "f" and not np.all(np.isfinite(arr))):
            raise DataError(f"{path}: array '{name}' is empty, non-numeric or holds NaN/inf",
                            "re-create it with moefleet predict fit")
    return meta, arrays


def load_predictor(path: str | Path, **kwargs: Any) -> ExpertPredictor:
    """Load any saved predictor; ``kwargs`` go to the class's ``load`` (e.g. ``embed``)."""
    meta, _ = read_npz(path)
    cls = _KINDS.get(meta["kind"])
    if cls is None:
        raise DataError(f"{path} holds an unknown predictor kind {meta['kind']!r}",
                        f"known kinds: {', '.join(sorted(_KINDS))}")
    loader: Callable[..., ExpertPredictor] = cls.load
    try:
        return loader(path, **kwargs)
    except DataError as err:
        if str(path) in err.message:
            raise
        raise DataError(f"{path}: {err.message}", err.hint) from None
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
        raise DataError(f"{path} is not a valid '{meta['kind']}' predictor: {err!r}",
                        "re-create it with moefleet predict fit") from None
