"""In-process expert functions (``ExpertFn``), three kernels with the same result:

- ``"loop"``: one call per expert on its tokens (BrownoutServe's "non-fused" baseline);
- ``"stacked"``: every expert of a layer in one pair of batched matmuls over the layer's
  stacked weights, tokens grouped by expert and padded to the largest group;
- ``"fused"``: (token, expert) pairs sorted by expert and one grouped GEMM per projection
  over the sorted rows (``torch._grouped_mm``, what transformers' own ``grouped_mm``
  experts use; it runs on CPUs and GPUs): no loop over experts, no padding, no host
  read (segment ends are a device-side cumsum).

Pairs whose expert id is ``>= E`` are *skipped* by the fused kernel (they sort after every
real expert, past the last segment, and contribute 0): brownout marks the pairs it sends
elsewhere that way instead of selecting the kept ones, which would need their count on
the host (:data:`SKIPS_MARKED_PAIRS`).

Shape legend: N tokens, K experts per token, D hidden, F expert intermediate size,
E experts in the layer, C tokens of the largest expert group, P = N * K pairs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from moefleet.errors import MoefleetError
from moefleet.experts import cpu_gemv
from moefleet.models import cpu_bf16, cpu_dpbf16
from moefleet.models.base import ExpertFn, MoEModelAdapter, count_experts

Kernel = Literal["auto", "loop", "stacked", "fused"]
KERNELS: tuple[Kernel, ...] = ("auto", "loop", "stacked", "fused")
# attribute set on expert functions that skip pairs with an id >= E (see the docstring)
SKIPS_MARKED_PAIRS = "skips_marked_pairs"
# attribute: (layer, x_ND, pairs) -> whether uniting pairs could save work (ExpertStack)
UNITING_PAYS = "uniting_pays"


def in_process_experts(adapter: MoEModelAdapter, kernel: Kernel = "auto") -> ExpertFn:
    """Every routed expert of ``adapter`` in this process, computed with ``kernel``.

    ``auto``: the fused kernel wherever the family keeps stacked expert weights (one
    grouped GEMM per projection, no padding, no host read: faster than the loop on CPUs
    too, benchmarks/engine_scale.py), else the loop.
    """
    first = adapter.stacked_expert_weights(adapter.moe_layers[0])
    stacked_ok = first is not None
    if kernel == "auto":
        kernel = "fused" if stacked_ok else "loop"
    if kernel == "loop":
        return adapter.local_expert_fn()
    if kernel not in ("stacked", "fused"):
        raise MoefleetError(f"unknown expert kernel {kernel!r}", f"use one of {list(KERNELS)}")
    if not stacked_ok:
        raise MoefleetError(
            f"{adapter.family} keeps no stacked expert weights, so the {kernel} kernel "
            "cannot run it", "use kernel='loop'")
    if kernel == "fused":
        assert first is not None
        # a bf16 CPU model: measure and build its kernel now, not in a request's step
        if not cpu_dpbf16.prepare(first[0]):
            cpu_gemv.prepare(first[0])

        def fused(layer: int, x_ND: torch.Tensor, ids_NK: torch.Tensor,
                  w_NK: torch.Tensor) -> torch.Tensor:
            stacked = adapter.stacked_expert_weights(layer)
            assert stacked is not None  # checked for the model above
            return fused_experts(x_ND, ids_NK, w_NK, *stacked)

        def uniting_pays(layer: int, x_ND: torch.Tensor, pairs: int) -> bool:
            stacked = adapter.stacked_expert_weights(layer)
            assert stacked is not None
            # the AVX512-BF16 kernel pays per expert read, as uniting assumes
            return cpu_dpbf16.runs(x_ND, pairs, stacked[0]) \
                or cpu_gemv.uniting_pays(x_ND, pairs, stacked[0])

        setattr(fused, SKIPS_MARKED_PAIRS, True)
        setattr(fused, UNITING_PAYS, uniting_pays)
        return fused

    def run(layer: int, x_ND: torch.Tensor, ids_NK: torch.Tensor,
            w_NK: torch.Tensor) -> torch.Tensor:
        stacked = adapter.stacked_expert_weights(layer)
        assert stacked is not None  # checked for the model above
        gate_up_E2FD, down_EDF, act = stacked
        return grouped_matmul(x_ND, ids_NK, w_NK, gate_up_E2FD, down_EDF, act)

    return run


def grouped_matmul(x_ND: torch.Tensor, ids_NK: torch.Tensor, w_NK: torch.Tensor,
                   gate_up_E2FD: torch.Tensor, down_EDF: torch.Tensor, act) -> torch.Tensor:
    """y_N = sum_k w_NK * expert_{ids_NK}(x_N) with two ``bmm`` calls for all experts."""
    N, K = ids_NK.shape
    E, D = gate_up_E2FD.shape[0], x_ND.shape[1]
    if N == 0:
        return torch.zeros_like(x_ND)
    flat = ids_NK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    counts_E = torch.bincount(flat, minlength=E)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank = torch.arange(N * K, device=x_ND.device) - starts_E[sorted_e]
    token = order // K
    C = int(counts_E.max())
    x_ECD = x_ND.new_zeros(E, C, D)
    x_ECD[sorted_e, rank] = x_ND[token]
    gate_ECF, up_ECF = torch.bmm(x_ECD, gate_up_E2FD.transpose(1, 2)).chunk(2, dim=-1)
    y_ECD = torch.bmm(act(gate_ECF) * up_ECF, down_EDF.transpose(1, 2))
    slots = y_ECD[sorted_e, rank] * w_NK.reshape(-1)[order, None].to(x_ND.dtype)
    # back to (token, k) order, then sum over k: no scatter-add needed
    y_NKD = torch.empty(N * K, D, dtype=x_ND.dtype, device=x_ND.device)
    y_NKD[order] = slots.to(x_ND.dtype)
    return y_NKD.view(N, K, D).sum(dim=1)


def fused_experts(x_ND: torch.Tensor, ids_NK: torch.Tensor, w_NK: torch.Tensor,
                  gate_up_E2FD: torch.Tensor, down_EDF: torch.Tensor, act) -> torch.Tensor:
    """y_N = sum_k w_NK * expert_{ids_NK}(x_N) as two grouped GEMMs over the pairs sorted
    by expert; pairs with an id >= E contribute 0 (skipped). No host synchronisation,
    except bf16 on a CPU without bf16 units in steps of at least
    :data:`CPU_SEGMENT_TOKENS` tokens (see :func:`_projections`). Shorter bf16 steps on
    such a CPU with many pairs per expert run :func:`_dense` instead (no host read)."""
    N, K = ids_NK.shape
    E = gate_up_E2FD.shape[0]
    if N < CPU_SEGMENT_TOKENS and _dense_pays(N, N * K, E) and cpu_bf16.applies(x_ND, N):
        return _dense(x_ND, ids_NK, w_NK, gate_up_E2FD, down_EDF, act)
    flat_P = ids_NK.reshape(-1)
    order_P = torch.argsort(flat_P, stable=True)  # marked pairs (>= E) sort last
    ends_E = torch.cumsum(count_experts(ids_NK, E), 0)
    token_P = order_P // K
    xs_PD = x_ND[token_P]
    project = _projections(xs_PD, N, E, ends_E)
    gate_PF, up_PF = project(xs_PD, gate_up_E2FD).chunk(2, dim=-1)
    ys_PD = project(act(gate_PF) * up_PF, down_EDF)
    # rows past the last segment are marked pairs: _grouped_mm leaves them unwritten
    kept_P = torch.arange(N * K, device=x_ND.device) < ends_E[-1]
    w_P = w_NK.reshape(-1)[order_P, None]
    ys_PD = torch.where(kept_P[:, None], ys_PD * w_P.to(ys_PD.dtype), 0)
    return torch.zeros_like(x_ND).index_add_(0, token_P, ys_PD.to(x_ND.dtype))


# When a bf16 step on a CPU without bf16 units goes segment by segment through
# cpu_bf16.linear: at 8 pairs per expert on average, where one segment of 8 rows runs 2.4x
# faster than PyTorch's bf16 matmul (whose cost grows with every row; _grouped_mm calls
# it per segment), and from 64 tokens (a prefill chunk's size), so that decode steps up
# to 64 rows keep the grouped GEMM and read nothing on the host.
CPU_SEGMENT_PAIRS = 8
CPU_SEGMENT_TOKENS = 64


def _dense_pays(tokens: int, pairs: int, E: int) -> bool:
    """Whether every expert on every row (:func:`_dense`) beats the grouped bf16 GEMM: at
    least ``4 + tokens / 4`` pair slots per expert. Measured on this project's AVX2 CPU
    (a 2048 x 2048 plus a 2048 x 1024 bf16 weight): a row of the grouped GEMM costs
    1.2-1.3 ms whatever the segment, the blocked path on all rows costs what 3 rows do
    at 4 rows, 4 at 8, 5 at 16, 6.5 at 32 and 11 at 63, i.e. about ``3 + tokens / 8``;
    the rule asks 1.5x that, because slots marked by brownout (a token's second pair in
    one united group) count here but are not computed by the grouped GEMM. So it holds
    for few experts with many rows each (brownout's united experts in a decode step:
    64 slots over 8 at 8 rows) and never for a decode step over 64 experts."""
    return 4 * pairs >= E * (16 + tokens)


def _dense(x_ND: torch.Tensor, ids_NK: torch.Tensor, w_NK: torch.Tensor,
           gate_up_E2FD: torch.Tensor, down_EDF: torch.Tensor, act) -> torch.Tensor:
    """:func:`fused_experts` as every expert on all N rows through the blocked float32
    path, each row's output kept only where the row routed to the expert (weighted):
    E loops of fixed shapes, no host read; sums in float32, rounded once."""
    N, E = x_ND.shape[0], gate_up_E2FD.shape[0]
    # a marked pair (id >= E) lands in column E, which is dropped
    col_NK = ids_NK.clamp(max=E)
    w_NE = torch.zeros(N, E + 1, dtype=torch.float32, device=x_ND.device).scatter_add_(
        1, col_NK, w_NK.float())[:, :E]
    routed_NE = torch.zeros(N, E + 1, dtype=torch.bool, device=x_ND.device).scatter_(
        1, col_NK, True)[:, :E]
    y_ND = torch.zeros(x_ND.shape, dtype=torch.float32, device=x_ND.device)
    for e in range(E):
        gate_NF, up_NF = cpu_bf16.linear(x_ND, gate_up_E2FD[e]).chunk(2, dim=-1)
        out_ND = cpu_bf16.linear(act(gate_NF) * up_NF, down_EDF[e]).float()
        # where, not a product: a row that did not route here adds 0 even if its
        # output is not finite
        y_ND += torch.where(routed_NE[:, e, None], out_ND * w_NE[:, e, None], 0)
    return y_ND.to(x_ND.dtype)


def _projections(xs_PD: torch.Tensor, tokens: int, E: int, ends_E: torch.Tensor
                 ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """How the two projections run: the grouped GEMM; segment by segment when the rows
    are bf16 on a CPU without bf16 units and the step is long enough (above), which reads
    the segment ends (E ints) on the host once per layer (on a CPU that waits for
    nothing); bf16 on a CPU with AVX512-BF16 and few rows per expert, our kernel that
    reads each expert once (:mod:`.cpu_dpbf16`, no host read); or, failing that, at most
    one pair per expert, one matrix-vector product per pair (:mod:`.cpu_gemv`)."""
    P = xs_PD.shape[0]
    if tokens >= CPU_SEGMENT_TOKENS and P >= CPU_SEGMENT_PAIRS * E \
            and cpu_bf16.applies(xs_PD, P):
        ends = ends_E.tolist()
        return lambda a_PI, w_EOI: _segments(a_PI, w_EOI, ends)
    return lambda a_PI, w_EOI: _project(a_PI, w_EOI, ends_E)


def _project(a_PI: torch.Tensor, w_EOI: torch.Tensor, ends_E: torch.Tensor) -> torch.Tensor:
    """One projection of the sorted pair rows, by the first path that runs here."""
    if cpu_dpbf16.runs(a_PI, a_PI.shape[0], w_EOI):
        return cpu_dpbf16.segments(a_PI, w_EOI, ends_E)
    if cpu_gemv.applies(a_PI, w_EOI):
        return cpu_gemv.pairs(a_PI, w_EOI, ends_E)
    return _grouped(a_PI, w_EOI, ends_E)


def _grouped(a_PI: torch.Tensor, w_EOI: torch.Tensor, ends_E: torch.Tensor) -> torch.Tensor:
    """Rows of segment e (ending at ``ends_E[e]``) times ``w_EOI[e]``^T: ``[P, O]``."""
    w_EIO = w_EOI.transpose(1, 2)
    if _HAS_GROUPED_MM and _aligned(a_PI) and _aligned(w_EIO):
        return torch._grouped_mm(a_PI, w_EIO, offs=ends_E.to(torch.int32))
    # Reference path where torch has no grouped GEMM, or the shapes break its 16-byte
    # stride rule (toy widths): one matmul per segment (reads the segment ends on the
    # host once). Same interface and result.
    return _segments(a_PI, w_EOI, ends_E.tolist())


def _segments(a_PI: torch.Tensor, w_EOI: torch.Tensor, ends: list[int]) -> torch.Tensor:
    """:func:`_grouped` with the segment ends on the host: one matmul per non-empty
    segment; rows past the last end stay 0."""
    out = a_PI.new_zeros(a_PI.shape[0], w_EOI.shape[1])
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            out[start:end] = cpu_bf16.linear(a_PI[start:end], w_EOI[e])
        start = end
    return out


def _aligned(t: torch.Tensor) -> bool:
    """``torch._grouped_mm``'s rule: every non-unit stride a multiple of 16 bytes."""
    size = t.element_size()
    return all(s == 1 or (s * size) % 16 == 0 for s in t.stride()) \
        and t.data_ptr() % 16 == 0


_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")
