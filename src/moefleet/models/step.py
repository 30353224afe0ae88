"""A step: some sequences, each advancing by a few tokens (a prefill chunk or one decode
token) against the KV cache, and :func:`run_layers`, the only layer loop.

The loop drives a :class:`LayerStack`: every model adapter is one (its blocks run in this
process), and so is the segment runner's view of a deployment whose blocks run in segment
functions (``moefleet.runtime.segments``). What a stack passes between its own methods
(``h``, ``residual``, ``x``) is its business: tensors for an adapter, handles to remote
activations for segment functions; the loop only hands them on.

Shape legend: B rows (sequences), T new tokens per row (right-padded), V vocabulary,
E experts of a layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from moefleet.errors import MoefleetError

LogitsWanted = Literal["last", "all"]


class StepError(MoefleetError):
    """A malformed step (empty rows, ragged lists that disagree)."""


@dataclass
class StepInput:
    """The tokens of one step. Invariants: row ``b`` has ``valid_BT[b].sum()`` real tokens,
    all at the left; ``position_ids_BT[b, t] = start[b] + t`` for them.

    ``logits``: ``"last"`` computes the head only at each row's last real token (what
    sampling needs); ``"all"`` at every real token (prompt logprobs, the prefill-only
    forward). ``all_rows`` limits ``"all"`` to some rows (others get their last only).
    ``host_lengths``: each row's real tokens, known on the host when the step was built
    from lists, so the layers never read them back from the device (no synchronisation).
    """

    seq_ids: list[int]
    input_ids_BT: torch.Tensor
    position_ids_BT: torch.Tensor
    valid_BT: torch.Tensor
    logits: LogitsWanted = "last"
    all_rows: frozenset[int] | None = None
    host_lengths: list[int] | None = None

    @classmethod
    def from_lists(cls, seq_ids: Sequence[int], tokens: Sequence[Sequence[int]],
                   starts: Sequence[int], *, logits: LogitsWanted = "last",
                   all_rows: Sequence[int] | None = None,
                   device: torch.device | str = "cpu") -> StepInput:
        if not tokens or len(tokens) != len(seq_ids) or len(starts) != len(seq_ids):
            raise StepError(
                f"a step needs as many token lists and starts as sequences (got "
                f"{len(seq_ids)} ids, {len(tokens)} lists, {len(starts)} starts)",
                "build the step from the scheduler's output")
        if any(len(t) == 0 for t in tokens):
            raise StepError("a step row has no tokens", "drop rows with nothing to compute")
        B, T = len(tokens), max(len(t) for t in tokens)
        ids = torch.zeros(B, T, dtype=torch.long)
        valid = torch.zeros(B, T, dtype=torch.bool)
        for b, row in enumerate(tokens):
            ids[b, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
            valid[b, : len(row)] = True
        pos = torch.as_tensor(list(starts), dtype=torch.long)[:, None] + torch.arange(T)[None]
        return cls(list(seq_ids), ids.to(device), (pos * valid).to(device), valid.to(device),
                   logits, frozenset(all_rows) if all_rows is not None else None,
                   [len(t) for t in tokens])

    @property
    def num_rows(self) -> int:
        return len(self.seq_ids)

    @property
    def lengths(self) -> list[int]:
        if self.host_lengths is not None:
            return list(self.host_lengths)
        return [int(n) for n in self.valid_BT.sum(dim=1).tolist()]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def all_valid(self) -> bool:
        """Every row is full (no padding): decode steps, equal prefill chunks."""
        T = self.valid_BT.shape[1]
        return all(n == T for n in self.lengths)

    def valid_index(self) -> torch.Tensor:
        """Flat positions (``b * T + t``) of the real tokens, row-major, on the step's
        device; built from the host lengths (indexing by it reads nothing back). A step
        built from a mask (``host_lengths`` None: a layer-wise prefill whose padding may
        sit anywhere, e.g. on the left) takes the mask's positions instead."""
        if self.host_lengths is None:
            return self.valid_BT.reshape(-1).nonzero().squeeze(1)
        T = self.valid_BT.shape[1]
        idx = [b * T + t for b, n in enumerate(self.lengths) for t in range(n)]
        return torch.tensor(idx, dtype=torch.long, device=self.valid_BT.device)


@dataclass
class StepOutput:
    """``last_logits_BV``: each row's last real token (None for encoders' hidden states,
    which come in ``all_logits``). ``all_logits[b]``: ``[n_b, V]`` for the rows that asked
    for every position, else None. ``expert_counts[layer]``: tokens routed to each expert
    of that MoE layer in this step (real tokens only), ``[E]``; its sum is tokens × k."""

    last_logits_BV: torch.Tensor
    all_logits: list[torch.Tensor | None]
    expert_counts: dict[int, torch.Tensor] = field(default_factory=dict)


class LayerStack(Protocol):
    """What :func:`run_layers` drives: ``num_layers`` blocks, the MoE ones routed."""

    @property
    def num_layers(self) -> int: ...

    @property
    def moe_layers(self) -> list[int]: ...

    def pre_moe(self, layer: int, h: Any, ctx: Any) -> tuple[Any, Any]: ...

    def moe(self, layer: int, x: Any, step: StepInput, experts: Any,
            counts: dict[int, torch.Tensor]) -> Any: ...

    def post_moe(self, layer: int, residual: Any, x: Any, routed: Any) -> Any: ...

    def finish(self, h: Any, ctx: Any) -> torch.Tensor: ...


def run_layers(stack: LayerStack, step: StepInput, h: Any, ctx: Any, experts: Any,
               counts: dict[int, torch.Tensor]) -> torch.Tensor:
    """The layer loop: ``pre_moe -> moe (MoE blocks only) -> post_moe`` for every block,
    then the head (``finish``). With ``step.logits == "last"`` the head runs only at each
    row's last real token (what sampling needs); ``h`` is then a tensor ``[B, T, D]``."""
    return run_layers_parts(stack, [(step, h, ctx)], experts, counts)[0]


def run_layers_parts(stack: LayerStack, parts: Sequence[tuple[StepInput, Any, Any]],
                     experts: Any, counts: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """:func:`run_layers` over several steps of distinct sequences in lockstep: each block's
    attention per step, its routed experts once for all of them (``stack.moe_parts``,
    which a stack of several parts must have), so a step mixing decode rows and a prefill
    chunk reads the experts' weights once, with no row padded to another's length."""
    moe = set(stack.moe_layers)
    steps = [p[0] for p in parts]
    hs = [p[1] for p in parts]
    ctxs = [p[2] for p in parts]
    for layer in range(stack.num_layers):
        pre = [stack.pre_moe(layer, h, ctx) for h, ctx in zip(hs, ctxs, strict=True)]
        routed: list[Any] = [None] * len(parts)
        if layer in moe:
            xs = [x for _, x in pre]
            routed = ([stack.moe(layer, xs[0], steps[0], experts, counts)] if len(parts) == 1
                      else stack.moe_parts(layer, xs, steps, experts, counts))  # type: ignore[attr-defined]
        hs = [stack.post_moe(layer, r, x, y) for (r, x), y in zip(pre, routed, strict=True)]
    out = []
    for step, h, ctx in zip(steps, hs, ctxs, strict=True):
        if step.logits == "last":
            last_B = torch.tensor([n - 1 for n in step.lengths], device=step.valid_BT.device)
            h = h[torch.arange(h.shape[0], device=h.device), last_B][:, None]
        out.append(stack.finish(h, ctx))
    return out
