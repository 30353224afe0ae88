"""The KV cache: per-sequence attention state in fixed-size blocks, under a byte budget.

Shape legend: B rows of a step, T new tokens per row (padded), S cached + new keys per
row (padded to whole blocks), H heads of a cached tensor, C its channels, M blocks per
row, P positions per block (``block_size``).

Every attention layer caches two tensors per token (keys and values for multi-head
attention; DeepSeek-V2's compressed latent and rotary key for MLA). Their shapes differ
between families, so the cache learns them once from a probe (:class:`KVLayout`)
and keeps, per layer, two pools ``[H, num_blocks, P, C]`` (heads first, so a
gathered ``[H, B, M, P, C]`` views as ``[B, H, S, C]`` without a second copy). A
sequence owns a list of blocks (its block table); its token ``i`` lives in block
``table[i // P]`` at offset ``i % P``.

A step hands the attention modules a :class:`StepCacheView`, which HF attention calls as
``past_key_values.update(a, b, layer_idx)``: the view writes each row's *valid* new
tokens into that row's blocks and returns the row's whole history (cached + new),
gathered and padded to ``S``; the step's attention mask hides the padding.

Paged mode (``attention="paged"``, :mod:`moefleet.models.paged`): ``update`` writes the
same tokens but returns the pools themselves, viewed ``[1, H, num_blocks * P, C]`` (no
copy); FlexAttention then reads only each row's blocks through a block mask built from the
block tables. Its mask needs to know, for every pool slot, whose token it holds and at
which position: ``slot_tag[num_blocks * P]`` (the owning sequence's tag, -1 when nothing
is written there) and ``slot_pos``. Tags are unique per ``alloc`` (never reused, even when
a sequence id is), and a block's slots go back to -1 when a sequence reserves it, so a
reused block's stale tokens are never visible.

Invariants: ``bytes_used <= budget_bytes`` at all times (allocation past the budget
raises :class:`KVCacheFull` and changes nothing); ``length(seq)`` counts the tokens
written; ``free`` returns a sequence's blocks at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moefleet.errors import MoefleetError
from moefleet.models.attention import ATTENTION_PATHS, AttentionPath


class KVCacheError(MoefleetError):
    """A cache misuse (unknown sequence, a model without a cache, a bad budget)."""


class KVCacheFull(KVCacheError):
    """Not enough free blocks for the tokens a step wants to write."""


@dataclass(frozen=True)
class KVLayout:
    """What one token caches in each attention layer: (heads, channels) of both tensors."""

    shapes: tuple[tuple[tuple[int, int], tuple[int, int]], ...]  # per layer: (a, b)
    dtype: torch.dtype

    @property
    def num_layers(self) -> int:
        return len(self.shapes)

    @property
    def bytes_per_token(self) -> int:
        elems = sum(ha * ca + hb * cb for (ha, ca), (hb, cb) in self.shapes)
        return elems * torch.empty((), dtype=self.dtype).element_size()


class KVCache:
    """Block-allocated K/V storage for many sequences (see module docstring)."""

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int = 16,
                 device: torch.device | str = "cpu", attention: AttentionPath = "gather"
                 ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise KVCacheError(
                f"a cache needs >= 1 block of >= 1 token (got {num_blocks} blocks of "
                f"{block_size})", "raise the cache budget")
        if attention not in ATTENTION_PATHS:
            raise KVCacheError(f"unknown attention path {attention!r}",
                               f"use one of {', '.join(ATTENTION_PATHS)}")
        self.attention: AttentionPath = attention
        self.layout = layout
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        P = block_size
        self._pools: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(ha, num_blocks, P, ca, dtype=layout.dtype, device=self.device),
             torch.zeros(hb, num_blocks, P, cb, dtype=layout.dtype, device=self.device))
            for (ha, ca), (hb, cb) in layout.shapes
        ]
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() from the end
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        # paged mode only: what each pool slot holds (see the module docstring)
        self._tags: dict[int, int] = {}
        self._next_tag = 0
        slots = num_blocks * P if attention == "paged" else 0
        self.slot_tag = torch.full((slots,), -1, dtype=torch.long, device=self.device)
        self.slot_pos = torch.zeros(slots, dtype=torch.long, device=self.device)
        # paged mode: the block masks' table width (blocks a sequence can hold; the runner
        # sets it from max_model_len). One width for every step keeps the compiled
        # attention kernel's shapes from changing as sequences grow. 0: each step's own.
        self.mask_width = 0

    @property
    def paged(self) -> bool:
        return self.attention == "paged"

    @classmethod
    def from_budget(cls, layout: KVLayout, budget_bytes: int, block_size: int = 16,
                    device: torch.device | str = "cpu", attention: AttentionPath = "gather"
                    ) -> KVCache:
        """The largest cache whose pools fit in ``budget_bytes``."""
        per_block = layout.bytes_per_token * block_size
        blocks = int(budget_bytes) // per_block
        if blocks < 1:
            raise KVCacheError(
                f"a KV cache budget of {budget_bytes} bytes holds no block "
                f"({per_block} bytes each)", f"give at least {per_block} bytes")
        return cls(layout, blocks, block_size, device, attention)

    # -- accounting ------------------------------------------------------------------
    @property
    def budget_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.layout.bytes_per_token

    @property
    def bytes_used(self) -> int:
        used = self.num_blocks - len(self._free)
        return used * self.block_size * self.layout.bytes_per_token

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Share of blocks held by sequences, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tables

    def alloc(self, seq_id: int) -> None:
        """Register an empty sequence (its blocks come as tokens are written)."""
        if seq_id in self._tables:
            raise KVCacheError(f"sequence {seq_id} already has a cache", "free it first")
        self._tables[seq_id] = []
        self._lengths[seq_id] = 0
        self._tags[seq_id] = self._next_tag
        self._next_tag += 1

    def free(self, seq_id: int) -> None:
        """Give a sequence's blocks back; unknown ids are ignored (free is idempotent)."""
        table = self._tables.pop(seq_id, None)
        self._lengths.pop(seq_id, None)
        self._tags.pop(seq_id, None)
        if table:
            self._free.extend(reversed(table))

    def length(self, seq_id: int) -> int:
        try:
            return self._lengths[seq_id]
        except KeyError:
            raise KVCacheError(f"sequence {seq_id} has no cache",
                               "alloc() it before its first step") from None

    def blocks_needed(self, seq_id: int, new_tokens: int) -> int:
        have = len(self._tables[seq_id])
        return max(0, math.ceil((self._lengths[seq_id] + new_tokens) / self.block_size) - have)

    def reserve(self, seq_ids: Sequence[int], new_tokens: Sequence[int]) -> None:
        """Make room for a step's new tokens, all or nothing."""
        need = [self.blocks_needed(s, n) for s, n in zip(seq_ids, new_tokens, strict=True)]
        if sum(need) > len(self._free):
            raise KVCacheFull(
                f"the step needs {sum(need)} blocks, {len(self._free)} are free",
                "schedule fewer tokens or preempt a sequence")
        fresh: list[int] = []
        for s, n in zip(seq_ids, need, strict=True):
            got = [self._free.pop() for _ in range(n)]
            self._tables[s].extend(got)
            fresh.extend(got)
        if self.paged and fresh:
            # a reused block still holds its last owner's tag; nothing written here yet
            blocks = torch.tensor(fresh, dtype=torch.long, device=self.device)
            slots = (blocks[:, None] * self.block_size
                     + torch.arange(self.block_size, device=self.device)).reshape(-1)
            self.slot_tag[slots] = -1

    # -- a step --------------------------------------------------------------------
    def view(self, seq_ids: Sequence[int], new_lens: Sequence[int]) -> StepCacheView:
        """Reserve blocks for a step and return the object its attention layers update.

        Lengths advance when the view is :meth:`StepCacheView.commit`-ed, after the
        step's last layer wrote its keys.
        """
        for s in seq_ids:
            self.length(s)  # raises for unknown sequences
        self.reserve(seq_ids, new_lens)
        return StepCacheView(self, list(seq_ids), list(new_lens))


class StepCacheView:
    """One step's window on the cache; quacks like the part of HF ``Cache`` that
    attention modules call (``update``)."""

    def __init__(self, cache: KVCache, seq_ids: list[int], new_lens: list[int]) -> None:
        self.cache = cache
        self.seq_ids = seq_ids
        self.past_lens = [cache.length(s) for s in seq_ids]
        self.new_lens = new_lens
        P = cache.block_size
        dev = cache.device
        total = [p + n for p, n in zip(self.past_lens, new_lens, strict=True)]
        self.kv_len = max(total) if total else 0
        M = max(1, math.ceil(self.kv_len / P))
        tables = [cache._tables[s] for s in seq_ids]
        # rows with fewer blocks point their tail at block 0: masked out, never written
        self._table_BM = torch.tensor(
            [t[:M] + [0] * (M - len(t[:M])) for t in tables], dtype=torch.long, device=dev)
        # where each valid new token goes, in row-major (row, t) order
        blk, off = [], []
        for t, past, n in zip(tables, self.past_lens, new_lens, strict=True):
            for i in range(past, past + n):
                blk.append(t[i // P])
                off.append(i % P)
        self._dst_blk = torch.tensor(blk, dtype=torch.long, device=dev)
        self._dst_off = torch.tensor(off, dtype=torch.long, device=dev)
        self._valid_BT: torch.Tensor | None = None
        self._index_N: torch.Tensor | None = None
        self.paged = cache.paged
        self.blocks_per_row: list[int] = []
        if self.paged:
            # blocks each row holds after this step (host-known: the block mask's row sizes)
            self.blocks_per_row = [math.ceil(n / P) for n in total]
            # The slots' owners and positions are set before any layer runs: every layer
            # writes the step's tokens before it attends, and the causal test keeps a
            # query from seeing its row's later tokens. Built here, on the host side, so
            # that the layers read nothing back.
            tags = [cache._tags[s] for s in seq_ids]
            slot_tag = [tg for tg, n in zip(tags, new_lens, strict=True) for _ in range(n)]
            slot_pos = [i for past, n in zip(self.past_lens, new_lens, strict=True)
                        for i in range(past, past + n)]
            slots = self._dst_blk * P + self._dst_off
            cache.slot_tag[slots] = torch.tensor(slot_tag, dtype=torch.long, device=dev)
            cache.slot_pos[slots] = torch.tensor(slot_pos, dtype=torch.long, device=dev)
            self.row_tag_B = torch.tensor(tags, dtype=torch.long, device=dev)

    def set_valid(self, valid_BT: torch.Tensor, index_N: torch.Tensor | None = None) -> None:
        """The step's real tokens: a mask, and optionally their flat positions (``b * T +
        t``, row-major) so that writing them needs no host read of the mask."""
        self._valid_BT = valid_BT.to(self.cache.device)
        self._index_N = None if index_N is None else index_N.to(self.cache.device)

    def update(self, a_BHTC: torch.Tensor, b_BHTC: torch.Tensor, layer_idx: int,
               cache_kwargs: object = None, **kwargs: object
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the valid new tokens of both tensors; return each row's full history
        (gather mode, ``[B, H, S, C]``) or the whole pools (paged mode, ``[1, H,
        num_blocks * P, C]``, views that share the pools' storage). Extra arguments
        (``cache_kwargs``; ``kwargs=`` from transformers 5.24 on) are not needed:
        positions come from the step, not from the attention call."""
        if self._valid_BT is None:
            raise KVCacheError("the step view has no valid mask", "call set_valid() first")
        pools = self.cache._pools[layer_idx]
        out = []
        for x_BHTC, pool in zip((a_BHTC, b_BHTC), pools, strict=True):
            # [B, H, T, C] -> [B, T, H, C] -> [N_valid, H, C] -> [H, N_valid, C]
            x_BTHC = x_BHTC.transpose(1, 2)
            if self._index_N is not None:  # positions known on the host: no mask read
                B, T = x_BTHC.shape[:2]
                new_HNC = x_BTHC.reshape(B * T, *x_BTHC.shape[2:])[self._index_N].transpose(0, 1)
            else:
                new_HNC = x_BTHC[self._valid_BT].transpose(0, 1)
            pool[:, self._dst_blk, self._dst_off] = new_HNC.to(pool.dtype)
            if self.paged:  # the pool as one long row: the block mask picks the slots
                H, NB, P, C = pool.shape
                out.append(pool.view(1, H, NB * P, C).to(x_BHTC.dtype))
                continue
            # the one copy: each row's blocks. index_select, not pool[:, table]: on the
            # CPU advanced indexing copies element by element (OLMoE's K pool, 8 rows of 6
            # blocks: 1.05 ms against 0.11, one-off), and a step does it twice per layer
            H, _, P, C = pool.shape
            B, M = self._table_BM.shape
            g_HBMPC = pool.index_select(1, self._table_BM.reshape(-1)).view(H, B, M, P, C)
            out.append(g_HBMPC.permute(1, 0, 2, 3, 4).reshape(B, H, M * P, C)
                       .to(x_BHTC.dtype))
        return out[0], out[1]

    def commit(self) -> None:
        for s, n in zip(self.seq_ids, self.new_lens, strict=True):
            self.cache._lengths[s] += n

    @property
    def key_len(self) -> int:
        """S: keys each row sees, padded to whole blocks."""
        return int(self._table_BM.shape[1]) * self.cache.block_size


class LayoutProbe:
    """A throw-away ``past_key_values`` that records what each layer would cache."""

    def __init__(self) -> None:
        self.shapes: dict[int, tuple[tuple[int, int], tuple[int, int]]] = {}
        self.dtype: torch.dtype = torch.float32

    def update(self, a_BHTC: torch.Tensor, b_BHTC: torch.Tensor, layer_idx: int,
               cache_kwargs: object = None, **kwargs: object
               ) -> tuple[torch.Tensor, torch.Tensor]:
        self.shapes[layer_idx] = ((a_BHTC.shape[1], a_BHTC.shape[3]),
                                  (b_BHTC.shape[1], b_BHTC.shape[3]))
        self.dtype = a_BHTC.dtype
        return a_BHTC, b_BHTC

    def layout(self, num_layers: int) -> KVLayout:
        missing = [i for i in range(num_layers) if i not in self.shapes]
        if missing:
            raise KVCacheError(f"layers {missing} wrote nothing to the cache probe",
                               "this model's attention does not use past_key_values")
        return KVLayout(tuple(self.shapes[i] for i in range(num_layers)), self.dtype)
