"""Memory a function needs besides its parameters and its tokens (ODS/BO eq. 12c).

Two measured quantities, stored in the compute profile next to the time laws:

- **runtime footprint** per backend: the resident set (RSS, bytes) of a freshly started
  Python process that has imported what that backend's function process imports (torch,
  the handlers, the backend's entry point) and nothing else. Measured in a new
  interpreter each time (``python -c``), because a real platform starts one process per
  function instance: this is the floor below which no function of ours can start. On the
  aws backend the process also imports the Lambda entry point's store client (boto3).
- **intermediate bytes per token** of an expert: the slope, over two batch sizes, of the
  peak bytes of tensors alive during one expert forward, counted by a torch dispatch mode
  that sees every tensor the forward allocates (the input is the caller's and not
  counted; the output is, and :func:`intermediate_per_token` subtracts the output
  bytes, which eq. 12c already counts as ``D_out``). Allocator slack is not included.

Invariants: both are > 0 when measured; an old profile without them reports 0 and
:func:`moefleet.profiles.cache.profile_for` measures and saves them on first use.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import weakref
from typing import Any

from moefleet.errors import MoefleetError

# What each backend's function process imports before it can serve an invocation.
BACKEND_IMPORTS: dict[str, tuple[str, ...]] = {
    "local": ("torch", "moefleet.runtime.local_worker", "moefleet.runtime.handlers",
              "moefleet.runtime.stores", "moefleet.models.hf"),
    # The Lambda entry point builds the model skeleton (transformers) at its cold start.
    "aws": ("torch", "boto3", "moefleet.runtime.base", "moefleet.runtime.handlers",
            "moefleet.runtime.stores", "moefleet.models.hf"),
}
# After the imports, one small forward (matmul + activation) initialises torch's CPU
# kernels and thread pool, as a handler's first call would.
_PROBE = (
    "import importlib, json, sys\n"
    "for m in sys.argv[1:]: importlib.import_module(m)\n"
    "import torch\n"
    "x = torch.nn.functional.gelu(torch.randn(64, 256) @ torch.randn(256, 256))\n"
    "rss = [int(l.split()[1]) * 1024 for l in open('/proc/self/status') "
    "if l.startswith('VmRSS')][0]\n"
    "print(json.dumps({'rss_bytes': rss}))\n"
)


def measure_runtime_footprint(backend: str, *, timeout_s: float = 300.0) -> int:
    """RSS in bytes of a fresh interpreter after ``backend``'s imports (module doc)."""
    if backend not in BACKEND_IMPORTS:
        raise MoefleetError(f"no footprint probe for backend {backend!r}",
                            f"use one of {', '.join(sorted(BACKEND_IMPORTS))}")
    mods = [m for m in BACKEND_IMPORTS[backend] if _importable(m)]
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE, *mods], capture_output=True,
                             text=True, timeout=timeout_s, check=True)
        return int(json.loads(out.stdout.strip().splitlines()[-1])["rss_bytes"])
    except (subprocess.SubprocessError, ValueError, KeyError, IndexError) as err:
        raise MoefleetError(f"could not measure the {backend} runtime footprint: {err}",
                            "check that torch imports in a fresh interpreter") from None


@functools.cache
def _footprints() -> tuple[tuple[str, int], ...]:
    return tuple((b, measure_runtime_footprint(b)) for b in BACKEND_IMPORTS)


def measure_runtime_footprints() -> dict[str, int]:
    """:func:`measure_runtime_footprint` for every backend with a probe; measured once per
    process (a property of this interpreter and machine, not of a model)."""
    return dict(_footprints())


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def peak_forward_bytes(module: Any, x_ND: Any) -> int:
    """Peak bytes of tensors the forward of ``module`` on ``x_ND`` holds at once."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class _Live(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live, self.peak = 0, 0
            self.seen: set[int] = set()

        def _free(self, ptr: int, nbytes: int) -> None:
            self.seen.discard(ptr)
            self.live -= nbytes

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if not isinstance(t, torch.Tensor):
                    continue
                ptr = t.untyped_storage().data_ptr()
                if ptr in self.seen or ptr == 0:
                    continue  # a view of a tensor already counted
                nbytes = t.untyped_storage().nbytes()
                self.seen.add(ptr)
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, ptr, nbytes)
            return out

    with torch.inference_mode(), _Live() as mode:
        y = module(x_ND)
        del y
    return mode.peak


def intermediate_per_token(module: Any, hidden: int, *, small: int = 64,
                           large: int = 512) -> int:
    """Bytes per token an expert holds beyond its input and output (module doc)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    dtype = next(module.parameters()).dtype  # activations in the expert's own dtype
    lo = peak_forward_bytes(module, torch.randn(small, hidden, generator=gen).to(dtype))
    hi = peak_forward_bytes(module, torch.randn(large, hidden, generator=gen).to(dtype))
    slope = (hi - lo) / (large - small)
    out_bytes = hidden * dtype.itemsize  # eq. 12c's D_out
    return max(0, round(slope) - out_bytes)
