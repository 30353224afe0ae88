"""Model runners: execute one :class:`SchedulerOutput`.

A runner owns the KV cache (sequences live only in the scheduler, K/V only here). It
drops the cache of preempted sequences, runs the step's rows and returns the logits the
engine samples from, plus per-expert token counts and how long the forward took.

Failures: the expert stack the runner is given retries transient expert failures itself
(:mod:`moefleet.experts.retry`, outermost in every stack the composition root builds). When
the retries run out, or the error is not transient, or anything else in the forward raises,
:meth:`InProcessRunner.execute` raises :class:`StepFailedError` naming every sequence of the step;
the engine fails
exactly those requests (see ``engine.py``) and frees their cache, so a step whose first
forward committed and whose second failed leaves no half-advanced sequence behind.

Shape legend: B rows, V vocabulary, T tokens of a row.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from moefleet.engine import kv_sizing
from moefleet.engine.request import EngineError
from moefleet.engine.scheduler import SchedulerOutput
from moefleet.models.attention import resolve_attention
from moefleet.models.base import MoEModelAdapter
from moefleet.models.kv import KVCache
from moefleet.models.step import StepInput

_log = logging.getLogger(__name__)


@dataclass
class RunnerOutput:
    """``sample_logits_BV`` rows follow ``sample_ids`` (the rows with ``sample``);
    ``prompt_logits[seq_id]`` is ``[T, V]`` for rows that asked for every position."""

    sample_ids: list[int]
    sample_logits_BV: torch.Tensor | None
    prompt_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    expert_counts: dict[int, torch.Tensor] = field(default_factory=dict)
    forward_s: float = 0.0


class StepFailedError(EngineError):
    """A step's forward failed for good; ``seq_ids`` are the sequences it carried."""

    def __init__(self, seq_ids: list[int], cause: BaseException) -> None:
        super().__init__(f"model step failed: {type(cause).__name__}: {cause}",
                         "retry the request")
        self.seq_ids = seq_ids
        self.cause = cause


class StepExperts(Protocol):
    """What a runner calls the routed experts through (seam 1; ``moefleet.experts`` builds
    it): an ExpertFn that is told, before each forward, whose each token row is."""

    def __call__(self, layer: int, x_ND: torch.Tensor, ids_NK: torch.Tensor,
                 w_NK: torch.Tensor) -> torch.Tensor: ...

    def set_owners(self, owners_N: Sequence[str] | None) -> None: ...


class ModelRunner(Protocol):
    """Seam 2: where a step's layer loop runs. ``vocab_size`` bounds the token ids a
    request may carry; ``max_model_len`` a sequence's length; the cache's blocks
    (``num_cache_blocks`` of ``block_size`` tokens) bound what the scheduler admits."""

    num_cache_blocks: int
    block_size: int
    max_model_len: int

    @property
    def vocab_size(self) -> int: ...

    def execute(self, out: SchedulerOutput) -> RunnerOutput: ...

    def free(self, seq_ids: list[int]) -> None: ...


class InProcessRunner:
    """Runs ``adapter.forward_step`` in this process; experts through ``experts`` (the
    expert stack the composition root built). The cache is sized by
    :mod:`moefleet.engine.kv_sizing` (``kv_budget_bytes`` given; else from GPU memory with
    ``gpu_memory_utilization``; else the CPU default) and logs its capacity
    (``kv_capacity``). The cache owns the block accounting; the scheduler is told its size.
    ``attention``: how attention reads the cache, ``gather``, ``paged`` or ``auto``
    (:mod:`moefleet.models.paged`); resolved once, on the adapter's device, into
    ``self.attention``."""

    def __init__(self, adapter: MoEModelAdapter, *, experts: StepExperts,
                 kv_budget_bytes: int | None = None,
                 block_size: int = 16, max_num_seqs: int = 64,
                 max_model_len: int | None = None, gpu_memory_utilization: float = 0.9,
                 max_num_batched_tokens: int = 2048, attention: str = "gather") -> None:
        if not adapter.causal:
            raise EngineError(
                f"{adapter.name} ({adapter.family}) is an encoder: it cannot generate",
                "generate with a decoder model, e.g. tiny-moe-lm")
        self.adapter = adapter
        self.experts = experts
        context = int(getattr(getattr(adapter.model, "config", None),
                              "max_position_embeddings", 2048) or 2048)
        self.max_model_len = min(max_model_len or context, context)
        layout = adapter.kv_layout()
        budget, source = kv_sizing.budget_bytes(
            adapter, layout.bytes_per_token, given=kv_budget_bytes,
            gpu_memory_utilization=kv_sizing.check_fraction(gpu_memory_utilization),
            max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
            max_num_batched_tokens=max_num_batched_tokens, experts=experts)
        self.attention = resolve_attention(attention, adapter.device, adapter.latent_cache)
        if self.attention == "paged" and not adapter.supports_paged:
            raise EngineError(f"{adapter.name} ({adapter.family}) has no paged attention",
                              "use attention 'gather'")
        self.cache = KVCache.from_budget(layout, budget, block_size, adapter.device,
                                         self.attention)
        self.num_cache_blocks = self.cache.num_blocks
        self.block_size = block_size
        self.kv_capacity = kv_sizing.KVCapacity(self.cache.num_blocks, block_size,
                                                layout.bytes_per_token, source)
        self.max_model_len = kv_sizing.check_fits(self.kv_capacity, self.max_model_len,
                                                  explicit=max_model_len is not None)
        self.cache.mask_width = -(-self.max_model_len // block_size)  # paged masks' width
        _log.info("%s; %s; %s attention", self.kv_capacity.describe(), str(layout.dtype),
                  self.attention)

    @property
    def vocab_size(self) -> int:
        return self.adapter.vocab_size

    def free(self, seq_ids: list[int]) -> None:
        for s in seq_ids:
            self.cache.free(s)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.free(out.preempted)
        rows = out.rows
        for r in rows:
            if r.seq_id not in self.cache:
                self.cache.alloc(r.seq_id)
        # Rows are right-padded to their part's longest, so one prefill chunk in a step of
        # decodes would pad every decode row to the chunk's length: single-token rows and
        # longer rows are two parts of one forward (attention per part, experts shared).
        parts = [[b for b, r in enumerate(rows) if len(r.token_ids) == 1],
                 [b for b, r in enumerate(rows) if len(r.token_ids) > 1]]
        subs = [[rows[b] for b in part] for part in parts if part]
        steps = []
        for sub in subs:
            want_all = [i for i, r in enumerate(sub) if r.prompt_logprobs]
            steps.append(StepInput.from_lists(
                [r.seq_id for r in sub], [r.token_ids for r in sub], [r.start for r in sub],
                logits="all" if want_all else "last", all_rows=want_all,
                device=self.adapter.device))
        # remote experts bill each token row's sequence: owners are sequence ids, in the
        # order the rows reach the experts (step by step, row-major; a retried call keeps
        # them)
        self.experts.set_owners([str(r.seq_id) for sub in subs for r in sub
                                 for _ in r.token_ids])
        t0 = time.perf_counter()
        try:
            # one layer loop: attention per part, each MoE layer's experts once for all
            results = self.adapter.forward_steps(steps, self.cache, self.experts)
        except Exception as err:
            raise StepFailedError([r.seq_id for r in rows], err) from err
        forward_s = time.perf_counter() - t0
        last: dict[int, torch.Tensor] = {}
        prompt: dict[int, torch.Tensor] = {}
        for sub, res in zip(subs, results, strict=True):
            for i, r in enumerate(sub):
                last[r.seq_id] = res.last_logits_BV[i]
                if res.all_logits[i] is not None:
                    prompt[r.seq_id] = res.all_logits[i]  # type: ignore[assignment]
        counts = results[0].expert_counts
        counts = _read_counts(counts)
        sample_ids = [r.seq_id for r in rows if r.sample]
        logits = torch.stack([last[s] for s in sample_ids]) if sample_ids else None
        return RunnerOutput(sample_ids, logits, prompt, counts, forward_s)


def _read_counts(counts: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Every layer's per-expert counts on the host with one read (the step's statistics);
    the layers left them on the device so that none of them waited for the device."""
    if not counts:
        return counts
    layers = list(counts)
    flat = torch.cat([counts[layer].reshape(-1) for layer in layers]).cpu()
    out, start = {}, 0
    for layer in layers:
        n = counts[layer].numel()
        out[layer] = flat[start:start + n]
        start += n
    return out
