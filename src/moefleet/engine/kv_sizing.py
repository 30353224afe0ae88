"""How big the KV cache is: sized from memory, not capped.

- a size given (``--kv-cache-memory 4GiB``, ``EngineOptions.kv_budget_bytes``): that;
- on a GPU: after the weights are resident, one profiling forward at the token budget
  (``max_num_batched_tokens``) measures the activation peak; ``gpu_memory_utilization`` of
  the device's total memory minus that peak goes to KV blocks (what vLLM does);
- on the CPU without a size: room for ``max_num_seqs`` sequences of ``max_model_len``, at
  most 2 GiB (host memory is shared with everything else on the machine: ask for more).

Invariant: the cache holds at least one sequence of ``max_model_len`` tokens; when a given
``max_model_len`` does not fit, :func:`check_fits` refuses with the size that would.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from moefleet.engine.request import EngineError

GiB = 1 << 30
CPU_DEFAULT_CAP = 2 * GiB
_log = logging.getLogger(__name__)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 10**6, "mb": 10**6,
          "mib": 1 << 20, "g": 10**9, "gb": 10**9, "gib": GiB, "t": 10**12, "tb": 10**12,
          "tib": 1 << 40}


def parse_size(text: str) -> int:
    """``"4GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"1000000"`` -> bytes (>= 1)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise EngineError(f"--kv-cache-memory {text!r} is not a size",
                          "write it like 4GiB, 512MiB or 2000000000")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size < 1:
        raise EngineError(f"--kv-cache-memory {text!r} is zero", "give a positive size, e.g. 4GiB")
    return size


def check_fraction(value: float) -> float:
    if not isinstance(value, int | float) or not 0.0 < value <= 1.0:  # also refuses nan
        raise EngineError(f"--gpu-memory-utilization must be in (0, 1], got {value!r}",
                          "e.g. 0.9 (the default)")
    return float(value)


@dataclass(frozen=True)
class KVCapacity:
    """What the cache holds; ``source`` says how its size was chosen."""

    blocks: int
    block_size: int
    bytes_per_token: int
    source: str

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    @property
    def bytes(self) -> int:
        return self.tokens * self.bytes_per_token

    def describe(self) -> str:
        return (f"KV cache: {self.blocks} blocks of {self.block_size} tokens = {self.tokens} "
                f"tokens, {self.bytes / GiB:.2f} GiB ({self.source})")

    def as_dict(self) -> dict[str, Any]:
        return {"blocks": self.blocks, "block_size": self.block_size, "tokens": self.tokens,
                "gib": self.bytes / GiB, "source": self.source}


def budget_bytes(adapter: Any, bytes_per_token: int, *, given: int | None,
                 gpu_memory_utilization: float, max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: int, experts: Any) -> tuple[int, str]:
    """(bytes for KV blocks, how they were chosen); see the module docstring."""
    if given is not None:
        return given, "as given"
    device = adapter.device
    if device.type == "cuda":
        return _gpu_budget(adapter, device, gpu_memory_utilization, max_model_len,
                           max_num_batched_tokens, experts)
    want = max_num_seqs * max_model_len * bytes_per_token
    if want <= CPU_DEFAULT_CAP:
        return want, f"room for {max_num_seqs} sequences of {max_model_len} tokens"
    return CPU_DEFAULT_CAP, "CPU default cap of 2 GiB; --kv-cache-memory sets it"


def _gpu_budget(adapter: Any, device: torch.device, fraction: float, max_model_len: int,
                max_num_batched_tokens: int, experts: Any) -> tuple[int, str]:
    """Weights are resident; a cacheless forward at the token budget measures the peak.
    UNMEASURED in CI (no GPU there): the arithmetic is vLLM's rule."""
    from moefleet.models.step import StepInput

    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    tokens = max_num_batched_tokens
    rows = [min(max_model_len, tokens - s) for s in range(0, tokens, max_model_len)]
    step = StepInput.from_lists(list(range(len(rows))), [[0] * n for n in rows],
                                [0] * len(rows), device=device)
    adapter.forward_step(step, None, experts)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    total = torch.cuda.mem_get_info(device)[1]
    budget = int(fraction * total) - peak
    if budget <= 0:
        raise EngineError(
            f"no GPU memory is left for the KV cache: weights and a forward of "
            f"{tokens} tokens peak at {peak / GiB:.1f} GiB of {fraction:g} x "
            f"{total / GiB:.1f} GiB", "raise --gpu-memory-utilization, lower "
            "--max-num-batched-tokens, or use a smaller --dtype or layer slice")
    torch.cuda.empty_cache()
    return budget, (f"{fraction:g} of {total / GiB:.1f} GiB GPU memory, after {peak / GiB:.2f}"
                    f" GiB of weights and activations at {tokens} tokens")


def check_fits(capacity: KVCapacity, max_model_len: int, explicit: bool) -> int:
    """The max_model_len to run with: refused when an explicit one does not fit; a default
    (the model's context) is lowered to what the cache holds, with a warning."""
    if capacity.tokens >= max_model_len:
        return max_model_len
    if explicit:
        need = math.ceil(max_model_len / capacity.block_size) * capacity.block_size \
            * capacity.bytes_per_token
        raise EngineError(
            f"the KV cache holds {capacity.tokens} tokens, less than one sequence of "
            f"max_model_len={max_model_len} ({need / GiB:.3f} GiB)",
            f"give --kv-cache-memory of at least {need} bytes (or a smaller --max-model-len)")
    _log.warning("max_model_len lowered to %d tokens: what the KV cache holds (%s)",
                 capacity.tokens, capacity.source)
    return capacity.tokens
