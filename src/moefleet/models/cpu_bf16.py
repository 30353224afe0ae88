"""bfloat16 matmuls on CPUs without bfloat16 units: weights converted block by block.

On a CPU with no bf16 instructions (AVX2 only: no AVX512-BF16, no AMX) PyTorch's bf16
``x @ W.T`` costs about one matrix-vector product *per row of x*: on this project's
2-core AVX2 machine a [2048, 2048] weight takes 0.8 ms at 1 row, 6.3 ms at 8 and 50 ms
at 64, while float32 takes 2.4 ms at 8. So a bf16 model's prefill and its larger decode
steps run far below the memory bound. :func:`linear` converts ``W`` to float32 one block
of output rows at a time (a ~2 MiB scratch that stays in cache), multiplies in float32
and rounds the result to bf16 once: 2.4x faster at 8 rows, 6x at 64, measured on that
machine (``tests/unit/test_cpu_bf16.py`` checks the result, not the speed;
``benchmarks/engine_scale.py`` measures the speed).

Invariants: weights stay bf16 in memory (nothing upcasts the model: the float32 copy is
a transient block); the result is bf16, equal to the plain bf16 matmul up to the order
of the float32 sums (PyTorch's bf16 CPU matmul also accumulates in float32). It runs
only where :func:`upcast_pays` measured it faster on this machine (cached like the
``--dtype auto`` measurement) and for at least :data:`MIN_ROWS` rows; everything else is
``F.linear`` unchanged. ``MOEFLEET_CPU_BF16_UPCAST=0`` turns it off, ``=1`` forces it.

On a CPU *with* bf16 units the same modules send a decode step's few rows to
:mod:`.cpu_dpbf16` instead (where it runs: :func:`use_dpbf16_linears`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from moefleet.models import cpu_dpbf16
from moefleet.models.dtypes import MeasuredSwitch

MIN_ROWS = 3  # 1 row: bf16 0.80 ms vs 1.11; 2 rows: 1.60 vs 1.54 (same machine, 2048^2)
_BLOCK_BYTES = 2 << 20  # float32 scratch per block: fits a core's L2 on common CPUs
_local = threading.local()  # one scratch per thread (servers step in worker threads)
_PAYS = MeasuredSwitch("MOEFLEET_CPU_BF16_UPCAST", "cpu_bf16_upcast.json",
                       lambda: _measure())


def upcast_pays() -> bool:
    """Whether the blocked conversion beats the plain bf16 matmul on this CPU (at 8 rows
    of a 2048 x 2048 weight), measured once per machine and torch build, cached in
    ``<cache>/cpu_bf16_upcast.json``; ``MOEFLEET_CPU_BF16_UPCAST`` overrides it."""
    return _PAYS()


def applies(x: torch.Tensor, rows: int) -> bool:
    """Whether :func:`linear` takes the blocked path for ``rows`` rows of ``x``."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and rows >= MIN_ROWS
            and upcast_pays())


def linear(x: torch.Tensor, w_OI: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``F.linear(x, w_OI, bias)``, through float32 blocks where :func:`applies`."""
    rows = x.numel() // max(x.shape[-1], 1)
    if w_OI.dtype != torch.bfloat16 or (
            torch.is_grad_enabled() and (x.requires_grad or w_OI.requires_grad)):
        return F.linear(x, w_OI, bias)  # autograd (training, distillation) keeps its path
    if cpu_dpbf16.runs_linear(x, rows, w_OI):  # a CPU with bf16 units, a decode step
        matmul = cpu_dpbf16.linear
    elif applies(x, rows):
        matmul = upcast_matmul
    else:
        return F.linear(x, w_OI, bias)
    y = matmul(x.reshape(rows, x.shape[-1]), w_OI, bias)
    return y.reshape(*x.shape[:-1], w_OI.shape[0])


def upcast_matmul(x_MI: torch.Tensor, w_OI: torch.Tensor, bias: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """``x_MI @ w_OI.T (+ bias)`` in float32 over blocks of ``w``'s rows; ``x``'s dtype out."""
    n_out, n_in = w_OI.shape
    xf = x_MI.float()
    out = torch.empty(x_MI.shape[0], n_out, dtype=torch.float32, device=x_MI.device)
    step = max(16, _BLOCK_BYTES // (4 * n_in) // 16 * 16)
    scratch = _scratch(min(step, n_out), n_in)
    for s in range(0, n_out, step):
        e = min(s + step, n_out)
        block = scratch[: e - s]
        block.copy_(w_OI[s:e])
        torch.mm(xf, block.T, out=out[:, s:e])
    if bias is not None:
        out += bias.float()
    return out.to(x_MI.dtype)


def _scratch(rows: int, cols: int) -> torch.Tensor:
    # one per thread and per inference mode: a buffer made under torch.inference_mode()
    # is an inference tensor, which may not be written outside it (and a normal one is
    # kept apart too, so neither mode ever writes the other's)
    name = "inference_buf" if torch.is_inference_mode_enabled() else "buf"
    have: torch.Tensor | None = getattr(_local, name, None)
    if have is None or have.numel() < rows * cols:
        have = torch.empty(rows * cols, dtype=torch.float32)
        setattr(_local, name, have)
    return have[: rows * cols].view(rows, cols)


class UpcastLinear(nn.Linear):
    """An ``nn.Linear`` whose bf16 CPU forward goes through :func:`linear`. Modules become
    one by a class swap (:func:`use_upcast_linears`): same parameters, same state-dict
    keys, no copy."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_upcast_linears(model: nn.Module) -> int:
    """Turn every plain ``nn.Linear`` of ``model`` into an :class:`UpcastLinear` when the
    blocked path pays on this CPU; the number turned (0 where it does not pay)."""
    return _turn(model) if upcast_pays() else 0


def use_dpbf16_linears(model: nn.Module) -> int:
    """The same where the AVX512-BF16 kernel (:mod:`.cpu_dpbf16`) runs on this machine:
    then a linear's calls of a decode step's few rows take it."""
    return _turn(model) if cpu_dpbf16.available() else 0


def _turn(model: nn.Module) -> int:
    turned = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = UpcastLinear
            turned += 1
    return turned


@contextlib.contextmanager
def plain_linears(model: nn.Module) -> Iterator[None]:
    """Within the block, ``model``'s linears are stock ``nn.Linear`` again (a baseline
    that must run transformers' own code, e.g. the HF side of a benchmark)."""
    turned: list[nn.Module] = [m for m in model.modules() if type(m) is UpcastLinear]
    for m in turned:
        m.__class__ = nn.Linear
    try:
        yield
    finally:
        for m in turned:
            m.__class__ = UpcastLinear


def _measure(reps: int = 5) -> dict[str, float | bool]:
    """Median time of 8 rows times a 2048 x 2048 bf16 weight, plain and blocked."""
    from moefleet.models.dtypes import median_seconds

    x = torch.randn(8, 2048).to(torch.bfloat16)
    w = torch.randn(2048, 2048).to(torch.bfloat16)
    plain = median_seconds(lambda: F.linear(x, w), reps)
    blocked = median_seconds(lambda: upcast_matmul(x, w), reps)
    # a clear margin: on CPUs with bf16 units the plain matmul wins by far
    return {"plain_ms": plain * 1e3, "blocked_ms": blocked * 1e3,
            "pays": blocked * 1.2 < plain}
