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

import logging
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moefleet.errors import DataError, MoefleetError, UnknownNameError
from moefleet.models.base import MoEModelAdapter
from moefleet.models.config_schema import check_architecture, check_config, read_config
from moefleet.models.dtypes import DtypeChoice, resolve_dtype
from moefleet.models.hf import HF_FAMILIES, HFMoEAdapter
from moefleet.models.weights_check import check_weights
from moefleet.torch_io import refusal_reason

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
        loaded: Any = AutoModelForCausalLM.from_pretrained(ref, dtype="auto",
                                                           output_loading_info=True)
        model, info = loaded[0], dict(loaded[1])
    except pickle.UnpicklingError as err:  # torch's weights_only loader refused a .bin
        raise DataError(
            f"the weights at {ref!r} hold Python objects other than tensors; refused "
            f"without loading them{refusal_reason(err)}",
            "use a checkpoint in safetensors, or one from a source you trust") from None
    except (OSError, RuntimeError, ValueError, TypeError, KeyError, AttributeError,
            SafetensorError) as err:
        # Only config-driven failures reach here: the directory passed config_schema and
        # weights_check first, so a library error is a checkpoint the checks cannot see.
        raise DataError(
            f"could not load the checkpoint at {ref!r}: "
            f"{(str(err).splitlines() or [type(err).__name__])[0][:200]}",
            "the weights may be corrupt or truncated: rebuild it (moefleet models build NAME "
            "--force) or download it again",
        ) from None
    # transformers fills missing tensors with random values and only logs it: a
    # checkpoint missing weights would run and answer garbage.
    missing = list(info.get("missing_keys") or []) + [
        str(m[0]) if isinstance(m, tuple) else str(m) for m in info.get("mismatched_keys") or []]
    if missing:
        raise DataError(f"the checkpoint at {ref!r} lacks {len(missing)} weight(s) its "
                        f"config needs, e.g. {missing[0][:100]!r}",
                        "restore the missing weight files, or the matching config.json")
    return HFMoEAdapter(model, _load_tokenizer(ref), name=name)


for _arch in HF_FAMILIES:
    register_architecture(_arch, _load_hf)


def _read_architecture(config: dict[str, Any], where: str) -> str:
    return check_architecture(config, where, supported_architectures())


def check_model_dir(path: Path) -> str:
    """Validate a checkpoint directory before anything is allocated (config schema,
    memory estimate, safetensors headers against the config); its architecture."""
    config = read_config(path / "config.json")
    arch = _read_architecture(config, str(path))
    check_weights(path, check_config(config, path / "config.json", arch))
    return arch


def _finite(adapter: MoEModelAdapter, where: Path) -> MoEModelAdapter:
    """Refuse weights holding NaN or infinity: they would generate '' or NaN scores
    without any error (one pass over the weights, each tensor read once)."""
    for name, p in adapter.model.named_parameters():
        if p.is_floating_point() and not bool(torch.isfinite(p).all()):
            raise DataError(f"the weights in {where} hold NaN or infinite values ({name})",
                            "the checkpoint is corrupt: rebuild it or download it again")
    return adapter


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
    checkpoint = next(adapter.model.parameters()).dtype
    if dtype is None:
        return _noted(adapter, DtypeChoice(checkpoint, ""))
    choice = resolve_dtype(dtype, checkpoint, dev)
    if choice.dtype != checkpoint:
        adapter.model.to(dtype=choice.dtype)
    return _noted(adapter, choice)


def _device(device: str | torch.device) -> torch.device:
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _noted(adapter: MoEModelAdapter, choice: DtypeChoice) -> MoEModelAdapter:
    notes = [choice.reason] if choice.reason else []
    if choice.dtype == torch.bfloat16 and next(adapter.model.parameters()).is_cpu:
        from moefleet.models.cpu_bf16 import use_dpbf16_linears, use_upcast_linears

        if use_upcast_linears(adapter.model):
            notes.append("bfloat16 linears run through float32 blocks on this CPU (no "
                         "bf16 units; weights stay bf16, moefleet.models.cpu_bf16)")
        elif use_dpbf16_linears(adapter.model):
            notes.append("bfloat16 linears of 1-2 rows run through moefleet's "
                         "AVX512-BF16 kernel on this CPU (moefleet.models.cpu_dpbf16)")
    for note in notes:
        _log.info("%s: %s", adapter.name, note)
    adapter.notes = (*adapter.notes, *notes)
    return adapter


def _load_any(ref: str) -> MoEModelAdapter:
    from moefleet.models import zoo

    ref = str(ref)
    if zoo.has_entry(ref):
        return zoo.load(ref)
    path = Path(ref).expanduser()
    if path.is_dir():
        arch = check_model_dir(path)
        return _finite(ARCHITECTURES[arch](str(path), path.name), path)
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


def _real_names() -> list[str]:
    from moefleet.models.real_shapes import SHAPES

    return list(SHAPES)
