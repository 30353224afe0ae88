"""Load any supported MoE checkpoint as a :class:`MoEModelAdapter`.

``load_adapter(ref, dtype=..., device=...)`` accepts, in this order:
0. a real-shape name (``olmoe-1b-7b[:layers=N]``, :mod:`moefleet.models.real_shapes`):
   published configs, random weights, built on ``device`` in the dtype;
1. a zoo name (``moefleet models list``): built once into the cache, then loaded;
2. a local directory holding ``config.json`` + weights (``save_pretrained`` layout);
3. a Hugging Face hub id (needs network; offline the error says so).

Checkpoints load in their own dtype (``dtype="auto"`` to transformers), then run in what
:func:`moefleet.models.dtypes.resolve_dtype` chooses for ``dtype``; a change of dtype is
stated in the adapter's ``notes`` (never silent).

Architectures are looked up in ``ARCHITECTURES``; anything else is rejected with the list
of supported ones. Other modules (e.g. dense->MoE conversion) add their own loader with
:func:`register_architecture`; registering a name twice is an error, not an override.
"""

from __future__ import annotations

import json
import logging
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moefleet.errors import DataError, MoefleetError, UnknownNameError, UnsupportedModelError
from moefleet.io import refusal_reason
from moefleet.models.base import MoEModelAdapter
from moefleet.models.dtypes import DtypeChoice, resolve_dtype
from moefleet.models.hf import HF_FAMILIES, HFMoEAdapter

# architecture class name -> loader(path_or_id, name) -> adapter
Loader = Callable[[str, str], MoEModelAdapter]
ARCHITECTURES: dict[str, Loader] = {}
_log = logging.getLogger(__name__)


def register_architecture(arch: str, loader: Loader) -> None:
    if arch in ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is already registered")
    ARCHITECTURES[arch] = loader


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def _load_tokenizer(ref: str) -> Any | None:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(ref)
    except (OSError, ValueError, TypeError):
        # A checkpoint without tokenizer files still runs on token ids.
        return None


def _load_hf(ref: str, name: str) -> MoEModelAdapter:
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        # the checkpoint's own dtype: a bf16 checkpoint never passes through float32
        model = AutoModelForCausalLM.from_pretrained(ref, dtype="auto")
    except pickle.UnpicklingError as err:  # torch's weights_only loader refused a .bin
        raise DataError(
            f"the weights at {ref!r} hold Python objects other than tensors; refused "
            f"without loading them{refusal_reason(err)}",
            "use a checkpoint in safetensors, or one from a source you trust") from None
    except (OSError, RuntimeError, ValueError, SafetensorError) as err:
        raise DataError(
            f"could not load the checkpoint at {ref!r}: {str(err).splitlines()[0]}",
            "the weights may be corrupt or truncated: rebuild it (moefleet models build NAME "
            "--force) or download it again",
        ) from err
    return HFMoEAdapter(model, _load_tokenizer(ref), name=name)


for _arch in HF_FAMILIES:
    register_architecture(_arch, _load_hf)


def _read_architecture(config: dict[str, Any], where: str) -> str:
    archs = config.get("architectures") or []
    if not archs:
        raise UnsupportedModelError(
            f"{where} has no 'architectures' entry in config.json",
            f"supported architectures: {', '.join(supported_architectures())}",
        )
    arch = str(archs[0])
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} ({where}) is not supported",
            f"supported architectures: {', '.join(supported_architectures())}",
        )
    return arch


def load_adapter(ref: str | Path, *, dtype: str | torch.dtype | None = None,
                 device: str | torch.device = "cpu") -> MoEModelAdapter:
    """Resolve ``ref`` (real shape, zoo name, directory or hub id) and return its adapter in
    ``dtype`` (None: the checkpoint's; ``"auto"``: see :mod:`moefleet.models.dtypes`).
    ``device``: where a real shape is built (others load on the CPU; the engine moves
    them)."""
    from moefleet.models import real_shapes

    ref = str(ref)
    dev = _device(device)
    if real_shapes.is_real_shape(ref) or real_shapes.looks_sliced(ref):
        choice = resolve_dtype(dtype, torch.bfloat16, dev)
        adapter = real_shapes.load_real_shape(ref, dtype=choice.dtype, device=dev)
        return _noted(adapter, choice)
    adapter = _load_any(ref)
    if dtype is None:
        return adapter
    checkpoint = next(adapter.model.parameters()).dtype
    choice = resolve_dtype(dtype, checkpoint, dev)
    if choice.dtype != checkpoint:
        adapter.model.to(dtype=choice.dtype)
    return _noted(adapter, choice)


def _device(device: str | torch.device) -> torch.device:
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _noted(adapter: MoEModelAdapter, choice: DtypeChoice) -> MoEModelAdapter:
    if choice.reason:
        _log.info("%s: %s", adapter.name, choice.reason)
        adapter.notes = (*adapter.notes, choice.reason)
    return adapter


def _load_any(ref: str) -> MoEModelAdapter:
    from moefleet.models import zoo

    if zoo.has_entry(ref):
        return zoo.load(ref)
    path = Path(ref).expanduser()
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise DataError(
                f"{path} has no config.json",
                "point --model at a directory written by save_pretrained, or a zoo name",
            )
        try:
            config = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as err:
            raise DataError(f"{cfg_file} is not valid JSON: {err}", "restore the file") from err
        arch = _read_architecture(config, str(path))
        return ARCHITECTURES[arch](str(path), path.name)
    if path.exists() or ref.startswith((".", "/", "~")) or ref.count("/") > 1:
        raise DataError(
            f"model path {ref!r} is not a directory",
            "pass a directory with config.json + weights, a zoo name, or a hub id",
        )
    if ref.count("/") != 1:
        # Hub MoE checkpoints are always "org/name"; anything else is a typo, and asking
        # the hub would only add retries before the same answer.
        raise UnknownNameError(
            f"unknown model {ref!r}",
            f"zoo models: {', '.join(zoo.names())}; real shapes (random weights): "
            f"{', '.join(_real_names())}[:layers=N]; or a checkpoint directory, or a hub id "
            "like mistralai/Mixtral-8x7B-v0.1",
        )
    return _load_from_hub(ref)


def _real_names() -> list[str]:
    from moefleet.models.real_shapes import SHAPES

    return list(SHAPES)


def _load_from_hub(ref: str) -> MoEModelAdapter:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(ref)
    except (OSError, ValueError) as err:
        from moefleet.models import zoo

        raise MoefleetError(
            f"unknown model {ref!r}: not a zoo name, not a local directory, and the hub "
            "could not provide it (offline?)",
            f"zoo models: {', '.join(zoo.names())}; or pass a local checkpoint directory",
        ) from err
    arch = _read_architecture(config.to_dict(), ref)
    return ARCHITECTURES[arch](ref, ref)
