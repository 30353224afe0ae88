"""bf16 autocast for ``tiny-moe-lm`` training: native where the CPU has bf16 units,
emulated in float32 where it has not.

Why: on a CPU without bf16 units (AVX2 only) oneDNN runs bf16 matmuls in software,
measured 1/155 of float32's speed, so a bf16 recipe trained at 32 s a step (600 steps:
over 5 hours) where a CPU with AVX512-BF16/AMX takes 13-24 minutes. Training in plain
float32 instead would silently ignore the recipe's ``precision``.

The emulation keeps bf16 autocast's rounding points and changes only the arithmetic
inside a product. Under CPU autocast a matmul-class op (``linear``, ``matmul``, ``mm``,
``bmm``, ``addmm``, ``baddbmm``) casts its inputs to bf16, multiplies with float32
accumulation and rounds the result to bf16; its backward does the same to the incoming
bf16 gradient. Emulated, the same op is ``op(a.bf16().float(), b.bf16().float()).bf16()``:
the casts are exact copies of autocast's, and their autograd backwards round the
gradients at the same places (the float32 product's input gradients are rounded to
bf16 by ``.float()``'s backward; a float32 master weight then receives them as float32,
as it does from autocast's cast). What differs is only the float32 accumulation order
inside a product (oneDNN's blocked kernel vs the float32 one), i.e. the same kind of
difference as between two CPU instruction sets, which the build already treats as
machine-specific (:mod:`moefleet.models.tinylm.train`). Tested against native autocast.

Everything else under autocast is unchanged here: the model casts to float32 itself where
it needs it (router softmax, attention softmax, RMSNorm), and bf16 elementwise ops run at
full speed on AVX2.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# The CPU autocast ops that run in bf16 and that tinylm's model calls (conv and RNN ops
# of the same list are never used by it).
_PRODUCTS = frozenset({
    F.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
    torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.mm, torch.Tensor.bmm,
})
# bf16 matmuls this many times slower than float32 (a CPU without bf16 units) are emulated
SLOW_BF16 = 2.0

_active = 0  # depth of emulated-autocast regions (single-threaded training loop)


def _rounded(value: Any) -> Any:
    """A floating tensor rounded to bf16 and held as float32 (exact); anything else as is."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(torch.bfloat16).float()
    return value


class _EmulatedBf16(TorchFunctionMode):
    """Runs each product of :data:`_PRODUCTS` as bf16-rounded inputs -> float32 product ->
    bf16 output; every other function runs untouched."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in _PRODUCTS:
            return func(*args, **kwargs)
        out = func(*(_rounded(a) for a in args), **{k: _rounded(v) for k, v in kwargs.items()})
        return out.to(torch.bfloat16)


def bf16_is_slow() -> bool:
    """Whether this CPU runs bf16 matmuls :data:`SLOW_BF16` times slower than float32 or
    more (measured once per machine by :func:`~moefleet.models.dtypes.fastest_cpu_dtype`)."""
    from moefleet.models.dtypes import fastest_cpu_dtype

    return fastest_cpu_dtype()[1] <= 1.0 / SLOW_BF16


def lower_precision_matmuls() -> bool:
    """True inside bf16 autocast, native or emulated: the model then takes the code
    paths it has for bf16 products (e.g. attention as two explicit matmuls)."""
    return _active > 0 or torch.is_autocast_enabled("cpu")


@contextlib.contextmanager
def bf16_autocast(enabled: bool, emulate: bool) -> Iterator[None]:
    """CPU bf16 autocast over the block (nothing when ``enabled`` is False); with
    ``emulate`` the products run in float32 between bf16 roundings (module docstring)."""
    global _active
    if not enabled:
        yield
        return
    if not emulate:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield
        return
    _active += 1
    try:
        with _EmulatedBf16():
            yield
    finally:
        _active -= 1
