"""Which dtype a model runs in: ``--dtype auto|bfloat16|float16|float32``.

- an explicit dtype is checked against the device (bf16 on a GPU without it, fp16 matmul on a
  CPU without fp16 units: one line naming the alternative) and used as given;
- ``auto`` on a GPU is the checkpoint's own dtype (when the GPU runs it, else float16);
  on the CPU it is the faster of bfloat16 and float32, measured once per machine (a
  matmul of a decode step's shape) and cached in ``<cache>/cpu_dtype.json``.

Invariant: nothing upcasts silently. Whenever the chosen dtype differs from the
checkpoint's, :func:`resolve_dtype` says so in its ``reason`` (the CLI prints it).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from moefleet.errors import MoefleetError

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_CHOICES: tuple[str, ...] = ("auto", *DTYPES)
_log = logging.getLogger(__name__)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_dtype_name(name: str) -> str:
    if name not in DTYPE_CHOICES:
        raise MoefleetError(f"unknown --dtype {name!r}", f"use one of {', '.join(DTYPE_CHOICES)}")
    return name


def unsupported_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why ``device`` cannot run ``dtype`` (None: it can)."""
    if dtype == torch.float32:
        return None
    if device.type == "cuda":
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            return "this GPU has no bfloat16 support; use --dtype float16"
        return None
    if device.type == "cpu" and dtype == torch.float16:
        fp16 = getattr(torch.cpu, "_is_amx_fp16_supported", lambda: False)()
        if not fp16:
            return ("this CPU has no float16 matmul units (float16 would run emulated); "
                    "use --dtype bfloat16 or float32")
    return None


def check_supported(dtype: torch.dtype, device: torch.device) -> None:
    reason = unsupported_reason(dtype, device)
    if reason is not None:
        head, fix = reason.split("; ", 1)
        raise MoefleetError(f"--dtype {dtype_name(dtype)} on {device}: {head}", fix)


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str  # "" when it is simply what was asked for / the checkpoint's dtype


def resolve_dtype(requested: str | torch.dtype | None, checkpoint: torch.dtype,
                  device: torch.device | str = "cpu") -> DtypeChoice:
    """The dtype a model with ``checkpoint`` weights runs in on ``device``; ``requested``
    None means the checkpoint's own (library default)."""
    dev = torch.device(device)
    if requested is None:
        return DtypeChoice(checkpoint, "")
    if isinstance(requested, str):
        check_dtype_name(requested)
        if requested != "auto":
            requested = DTYPES[requested]
    if isinstance(requested, torch.dtype):
        check_supported(requested, dev)
        why = "" if requested == checkpoint else (
            f"dtype {dtype_name(requested)} as asked (checkpoint {dtype_name(checkpoint)})")
        return DtypeChoice(requested, why)
    if dev.type != "cpu":
        chosen = checkpoint if unsupported_reason(checkpoint, dev) is None else torch.float16
        why = "" if chosen == checkpoint else (
            f"dtype auto: {dtype_name(chosen)} (this GPU cannot run the checkpoint's "
            f"{dtype_name(checkpoint)})")
        return DtypeChoice(chosen, why)
    chosen, speedup = fastest_cpu_dtype()
    why = "" if chosen == checkpoint else (
        f"dtype auto: {dtype_name(chosen)} on this CPU (checkpoint {dtype_name(checkpoint)}; "
        f"bfloat16 matmul measured {speedup:.2f}x float32's speed)")
    return DtypeChoice(chosen, why)


def concrete_cpu_dtype(name: str | None) -> str | None:
    """``auto`` as the dtype it picks on this CPU (measured once); other names, and None
    (the checkpoint's), unchanged."""
    return dtype_name(fastest_cpu_dtype()[0]) if name == "auto" else name


def fastest_cpu_dtype() -> tuple[torch.dtype, float]:
    """(bfloat16 or float32, bf16's speed over fp32's), measured once and cached."""

    def measure() -> dict[str, Any]:
        speedup = _bf16_speedup()
        return {"dtype": dtype_name(torch.bfloat16 if speedup > 1.0 else torch.float32),
                "bf16_speedup": speedup}

    got = cached_cpu_measure("cpu_dtype.json", measure)
    return DTYPES[got["dtype"]], float(got["bf16_speedup"])


def cached_cpu_measure(filename: str, measure: Callable[[], dict[str, Any]]
                       ) -> dict[str, Any]:
    """``measure()``'s result, cached in ``<cache>/filename`` per torch build, CPU
    capability and thread count (a change of any of them measures again)."""
    from moefleet.io import write_json_atomic
    from moefleet.paths import cache_dir

    path = cache_dir() / filename
    key = f"{torch.__version__}/{torch.backends.cpu.get_cpu_capability()}/" \
          f"{torch.get_num_threads()}"
    try:
        cached = json.loads(path.read_text())
        if isinstance(cached, dict) and cached.get("key") == key:
            return cached
    except (OSError, ValueError):
        pass
    got = {**measure(), "key": key}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, got)
    except OSError as err:  # a read-only cache only costs a re-measurement next time
        _log.warning("could not cache a CPU measurement in %s: %s", path, err)
    return got


class MeasuredSwitch:
    """A CPU path that runs only where it measured faster: ``measure()`` (a dict with a
    bool ``"pays"``) runs once per machine (:func:`cached_cpu_measure`, in ``filename``)
    and is remembered for the process; environment variable ``env`` set to ``0`` or
    ``1`` overrides it either way."""

    def __init__(self, env: str, filename: str, measure: Callable[[], dict[str, Any]]) -> None:
        self.env, self.filename, self.measure = env, filename, measure
        self.memo: bool | None = None

    def forced(self) -> bool | None:
        """The override, or None when ``env`` is unset (or neither 0 nor 1)."""
        value = os.environ.get(self.env, "")
        return value == "1" if value in ("0", "1") else None

    def __call__(self) -> bool:
        forced = self.forced()
        if forced is not None:
            return forced
        if self.memo is None:
            self.memo = bool(cached_cpu_measure(self.filename, self.measure)["pays"])
        return self.memo


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of ``reps`` calls of ``fn`` after one untimed warm-up call (first
    calls pick kernels)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2]


def _bf16_speedup(m: int = 64, k: int = 2048, n: int = 1024, reps: int = 7) -> float:
    """fp32 time / bf16 time of a [m, k] x [k, n] matmul (median of ``reps``)."""

    def median_s(dtype: torch.dtype) -> float:
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        return median_seconds(lambda: a @ b, reps)

    return median_s(torch.float32) / median_s(torch.bfloat16)
