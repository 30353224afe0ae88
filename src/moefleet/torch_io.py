"""Torch files at the boundary: the one ``torch.load`` (weights only, one-line errors)
and the one preparation of tensors for a safetensors file or packet (checkpoints,
payloads). Kept apart from :mod:`moefleet.io` so that plain file handling never imports
torch."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from moefleet.errors import DataError
from moefleet.io import check_input_file

#: torch releases whose ``weights_only`` unpickler is safe (CVE-2025-32434 before 2.6).
SAFE_TORCH = (2, 6)


def load_torch_data(path: str | os.PathLike[str], what: str, hint: str = "") -> Any:
    """What ``torch.save`` wrote to ``path`` (tensors in dicts, lists, tuples, numbers,
    strings), read with torch's ``weights_only`` unpickler: a file naming any other
    Python object is refused before anything in it runs. The only place moefleet calls
    ``torch.load``; errors are one ``DataError`` line naming the file."""
    import pickle
    import zipfile

    import torch

    p = check_input_file(path, what, hint)
    major, minor = (int("".join(c for c in x if c.isdigit()) or 0)
                    for x in torch.__version__.split(".")[:2])
    if (major, minor) < SAFE_TORCH:
        raise DataError(f"reading {what} {p} safely needs torch >= 2.6 (this is "
                        f"{torch.__version__})", "upgrade torch")
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise DataError(f"{what} {p} holds Python objects other than tensors and plain "
                        f"data; refused without loading them{refusal_reason(err)}",
                        hint or "re-create the file") from None
    except (RuntimeError, OSError, EOFError, ValueError, zipfile.BadZipFile) as err:
        line = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise DataError(f"{what} {p} is not a readable torch file ({line})",
                        hint or "re-create the file") from None


def refusal_reason(err: BaseException) -> str:
    """`` (<the global torch's weights_only loader refused>)`` from its error, or "".
    Its message also suggests ``weights_only=False``; that advice is never shown."""
    lines = [ln.strip() for ln in str(err).splitlines()
             if "unsupported" in ln.lower() or "GLOBAL" in ln]
    return f" ({lines[0][:160]})" if lines else ""


def safetensors_ready(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """``tensors`` (torch) as safetensors accepts them: detached and contiguous, and no
    two sharing storage (it refuses both). Copies only what must be: a non-contiguous
    tensor, and every tensor after the first whose storage an earlier one holds (e.g. a
    replay transition's next state is the following transition's state)."""
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        t = t.detach().contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else -1
        if ptr in seen:
            t = t.clone()
        elif ptr != -1:
            seen.add(ptr)
        out[name] = t
    return out
