"""Paged attention: FlexAttention over the KV cache's pools, with no per-row gather.

Two attention paths read the KV cache (:mod:`moefleet.models.kv`):

- ``gather`` (the default): ``update`` copies each row's blocks into a padded ``[B, H, S,
  C]`` history and the model's own attention (SDPA or eager) runs on that copy;
- ``paged``: ``update`` returns the pools themselves, viewed ``[1, H, num_blocks * P,
  C]``, and :func:`paged_attention_forward` runs ``flex_attention`` with a ``BlockMask``
  whose kv blocks for row ``b`` are exactly ``b``'s block table. A kernel that honours
  block sparsity (the compiled CUDA one) visits only those blocks; the query batch ``B``
  broadcasts against the pools' batch of 1.

The mask is exact on its own, because eager ``flex_attention`` evaluates it over every
pool slot: slot ``j`` is visible to query ``(b, t)`` iff ``slot_tag[j]`` is row ``b``'s
sequence tag (so the slot is written and is ``b``'s), ``slot_pos[j] <= pos[b, t]``, the
query is a real token, and, on sliding-window layers, ``pos[b, t] - slot_pos[j] <
window``. Fully masked (padding) queries come out as zeros, never NaN.

Cost: on the CPU eager ``flex_attention`` materialises scores over the *whole pool*
(every block of every sequence), so the paged path there is for correctness tests only;
``auto`` (:mod:`moefleet.models.attention`) picks it on CUDA only. Models that cache a
latent (DeepSeek-V2's MLA) are exact here too, but their attention module expands what
``update`` returns, which on this path is every slot of the pool, in every layer.

How HF modules reach it: the function is registered with transformers'
``AttentionInterface`` as :data:`PAGED_IMPL`; the adapter calls, in paged steps, a
shallow copy of each attention module whose config copy names that implementation
(:func:`moefleet.models.attention.with_implementation`), so the model's own config,
and every other caller of it, is untouched.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface

from moefleet.models.kv import KVCacheError, StepCacheView

PAGED_IMPL = "moefleet_paged"
Q_BLOCK = 128  # query rows per sparse block: the flex kernels' usual tile

# Eager flex_attention warns that it is unfused; on the CPU that is the documented
# trade-off of this path (tests), not news to the user.
warnings.filterwarnings("ignore", message=r"flex_attention called without torch\.compile",
                        category=UserWarning)


@dataclass(frozen=True)
class PagedMask:
    """What a paged step hands the attention function in place of an additive mask."""

    block_mask: BlockMask
    kernel_options: dict[str, Any] | None = None


def step_masks(view: StepCacheView, pos_BT: torch.Tensor,
               windows: dict[str, int | None]) -> dict[str, PagedMask]:
    """One :class:`PagedMask` per layer kind (``windows``: kind -> sliding window or
    None) for a paged step. Reads nothing back from the device: the row sizes are
    host-known and the rest are device tensors the mask closes over."""
    if not view.paged:
        raise KVCacheError("step_masks needs a paged cache view", "build the cache paged")
    if view._valid_BT is None:
        raise KVCacheError("the step view has no valid mask", "call set_valid() first")
    cache = view.cache
    P, dev = cache.block_size, cache.device
    B, T = pos_BT.shape
    num_q = math.ceil(T / Q_BLOCK)
    # every query block of row b may read all of b's blocks: the mask_mod does the rest
    num_BHQ = (torch.tensor(view.blocks_per_row, dtype=torch.int32, device=dev)
               .view(B, 1, 1).expand(B, 1, num_q).contiguous())
    table_BM = view._table_BM.to(torch.int32)
    # The table padded to the cache's mask width, and to at least 2 columns (a width of 1
    # is a shape of its own to dynamo): one width for every step, so that growing
    # sequences never hand the compiled kernel a new shape. Columns past a row's count
    # are unread.
    width = max(table_BM.shape[1], cache.mask_width, 2)
    if width > table_BM.shape[1]:
        table_BM = torch.nn.functional.pad(table_BM, (0, width - table_BM.shape[1]))
    idx_BHQM = table_BM.view(B, 1, 1, -1).expand(B, 1, num_q, table_BM.shape[1]).contiguous()
    tag_S, spos_S, row_tag_B = cache.slot_tag, cache.slot_pos, view.row_tag_B
    qpos_BT, valid_BT = pos_BT.to(dev), view._valid_BT
    kernel_options = _kernel_options(P) if dev.type == "cuda" else None

    def visible(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor,
                kv: torch.Tensor) -> torch.Tensor:
        return ((tag_S[kv] == row_tag_B[b]) & (spos_S[kv] <= qpos_BT[b, q])
                & valid_BT[b, q])

    def windowed(window: int) -> Callable[..., torch.Tensor]:
        def mask(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor,
                 kv: torch.Tensor) -> torch.Tensor:
            return visible(b, h, q, kv) & (qpos_BT[b, q] - spos_S[kv] < window)
        return mask

    out = {}
    for kind, window in windows.items():
        mask_mod = visible if window is None else windowed(int(window))
        block_mask = BlockMask.from_kv_blocks(
            num_BHQ, idx_BHQM, BLOCK_SIZE=(Q_BLOCK, P), mask_mod=mask_mod,
            seq_lengths=(T, cache.num_blocks * P),
            compute_q_blocks=False)  # the transposed indices serve backward only
        out[kind] = PagedMask(block_mask, kernel_options)
    return out


def _kernel_options(block_size: int) -> dict[str, Any]:
    """The Triton kernel's kv tile must divide the sparse block (one cache block): tiles
    of the block size itself, up to 64. Untested on a GPU (see docs)."""
    if block_size < 16 or block_size & (block_size - 1):
        raise KVCacheError(f"paged attention on CUDA needs a power-of-two block size >= 16 "
                           f"(got {block_size})", "use --attention gather or block_size 16")
    return {"BLOCK_N": min(block_size, 64)}


_compiled: Callable[..., Any] | None = None


def _flex_for(device: torch.device) -> Callable[..., Any]:
    """The compiled kernel on CUDA (compiled once, on first use); eager elsewhere.

    Rows, query length and block-table width change every step, and dynamo compiles
    again for new sizes (sizes of 1 keep graphs of their own). On an H100 its default
    limit of 8 compiles was reached in the second paged engine of one process; that
    engine and the next failed every request within 17 steps (docs/real-sizes.md). An
    engine's steps make 4 graphs (measured with dynamo's eager backend on the CPU), and
    a ``TorchFunctionMode`` (the benchmark's host-read counter) compiles them again. The
    block table's width is the cache's (:func:`step_masks`), so growing sequences add
    none; rows and query length still vary. Not yet run on a GPU."""
    global _compiled
    if device.type != "cuda":
        return flex_attention
    if _compiled is None:
        _compiled = torch.compile(flex_attention)
    return _compiled


def paged_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: Any,
                            dropout: float = 0.0, scaling: float | None = None,
                            **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query [B, Hq, T, D]``, ``key [1, Hk,
    S, D]`` and ``value [1, Hk, S, Dv]`` (the pools; ``Dv`` may differ from ``D``, as in
    MLA) -> ``([B, T, Hq, Dv], None)``. ``attention_mask`` must be a :class:`PagedMask`;
    ``scaling`` is the module's softmax scale. Inference only (no dropout)."""
    if not isinstance(attention_mask, PagedMask):
        raise KVCacheError(f"{PAGED_IMPL} attention got {type(attention_mask).__name__}, "
                           "not a paged step's mask", "this is a bug")
    if dropout:
        raise KVCacheError("paged attention is inference-only (dropout > 0)",
                           "put the model in eval mode")
    flex = _flex_for(query.device)
    # The scale goes into the query, not flex's ``scale=``: dynamo (which traces flex even
    # in eager mode) turns a float argument that changes between calls (two models in one
    # process) into a tensor it reads on the host in every call.
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling  # None: flex's default
    # contiguous: HF hands a transposed view whose strides differ between decode and
    # prefill, and each stride pattern would be a compile of its own
    q_BHTD = (query * scale).contiguous()
    out_BHTD = flex(q_BHTD, key.to(query.dtype), value.to(query.dtype),
                    block_mask=attention_mask.block_mask, scale=1.0,
                    enable_gqa=query.shape[1] != key.shape[1],
                    kernel_options=attention_mask.kernel_options)
    return out_BHTD.transpose(1, 2).contiguous(), None


AttentionInterface.register(PAGED_IMPL, paged_attention_forward)
