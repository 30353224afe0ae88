"""FCFS continuous batching with chunked prefill and preempt-and-recompute.

Plain Python, no model and no tensors: its output (:class:`SchedulerOutput`) is the only
contract with a runner, so tests drive it with fabricated runner results and a fake
clock, and the simulator drives the same code with a runner that times a pass instead of
computing one.

Each step (``schedule``) spends at most ``max_num_batched_tokens`` tokens:
1. running sequences first, in admission order: each computes what it still lacks (one
   token when decoding, a chunk of the prompt otherwise);
2. then waiting sequences, first come first served, while a slot (``max_num_seqs``),
   tokens and cache blocks remain; a prompt longer than what is left is chunked.
A running sequence that needs a cache block when none is free preempts the most recently
admitted running sequence (its blocks are freed; it goes back to the head of the queue
and is recomputed later from its prompt and the tokens it already produced). No request
is ever dropped: every sequence added is eventually finished or aborted.

Cache accounting mirrors the runner's :class:`~moefleet.models.kv.KVCache`: the same
number of blocks of the same size, so a schedule the scheduler accepts always fits.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from moefleet.engine.request import EngineError, SamplingParams, Sequence, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    num_cache_blocks: int = 4096
    block_size: int = 16
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_cache_blocks",
                     "block_size", "max_model_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise EngineError(f"{name} must be an integer >= 1, got {v!r}",
                                  f"set {name} to a positive integer")

    @property
    def cache_tokens(self) -> int:
        return self.num_cache_blocks * self.block_size


@dataclass(frozen=True)
class ScheduledSeq:
    """One row of a step: compute ``token_ids`` at positions ``start`` onwards."""

    seq_id: int
    token_ids: list[int]
    start: int
    sample: bool  # the chunk reaches the sequence's end: a token is sampled after it
    prompt_logprobs: bool  # the runner returns its output at every position of the chunk
    prefill: bool = False  # the chunk computes prompt tokens (a first pass or a recompute)


@dataclass
class SchedulerOutput:
    """A step's plan. ``preempted``: sequences whose cache the runner must drop first."""

    rows: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)

    @property
    def empty(self) -> bool:
        return not self.rows

    @property
    def has_prefill(self) -> bool:
        return any(r.prefill for r in self.rows)


class Scheduler:
    """Owns every live :class:`Sequence` (see module docstring for the policy)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[int, Sequence] = {}
        self.free_blocks = config.num_cache_blocks
        self.num_preemptions = 0
        self._next_id = 0

    # -- requests ------------------------------------------------------------------
    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
            arrival: float) -> Sequence:
        cfg = self.config
        if not prompt_ids:
            raise EngineError("the prompt is empty", "send at least one token")
        total = len(prompt_ids) + params.max_tokens
        if total > cfg.max_model_len:
            raise EngineError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{total} exceeds the model's context of {cfg.max_model_len} tokens",
                "shorten the prompt or lower max_tokens")
        if total > cfg.cache_tokens:
            raise EngineError(
                f"a request of {total} tokens can never fit the KV cache "
                f"({cfg.cache_tokens} tokens)", "raise the cache budget or lower max_tokens")
        seq = Sequence(self._next_id, request_id, list(prompt_ids), params, arrival)
        self._next_id += 1
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)
        return seq

    def finish(self, seq_id: int, reason: str) -> Sequence | None:
        """End a sequence (stopped, length, aborted) and free its blocks at once."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return None
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.free_blocks += seq.blocks
        seq.blocks = 0
        seq.status, seq.finish_reason = Status.FINISHED, reason
        return seq

    @property
    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    @property
    def cache_usage(self) -> float:
        return 1.0 - self.free_blocks / self.config.num_cache_blocks

    # -- a step --------------------------------------------------------------------
    def _blocks_for(self, seq: Sequence, tokens: int) -> int:
        return max(0, math.ceil((seq.num_computed + tokens) / self.config.block_size)
                   - seq.blocks)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.free_blocks += seq.blocks
        seq.blocks, seq.num_computed = 0, 0
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq.seq_id)

    def _row(self, seq: Sequence, tokens: int) -> ScheduledSeq:
        need = self._blocks_for(seq, tokens)
        self.free_blocks -= need
        seq.blocks += need
        start = seq.num_computed
        ids = seq.token_ids[start: start + tokens]
        p = seq.params
        # prefill-only requests return the model's output at every prompt position
        want_all = p.prefill_only or (p.prompt_logprobs and not seq.prompt_logprobs_done)
        sample = start + tokens == seq.num_tokens and not p.prefill_only
        return ScheduledSeq(seq.seq_id, ids, start, sample, want_all,
                            start < len(seq.prompt_ids) or tokens > 1)

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.remaining, budget)
            while self._blocks_for(seq, n) > self.free_blocks:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            out.rows.append(self._row(seq, n))
            budget -= n
        # admit new work only when nothing had to make room this step
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < cfg.max_num_seqs):
            seq = self.waiting[0]
            n = min(seq.remaining, budget)
            if self._blocks_for(seq, n) > self.free_blocks:
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.rows.append(self._row(seq, n))
            budget -= n
        return out

    def update(self, out: SchedulerOutput, sampled: dict[int, int]) -> None:
        """Advance the step's sequences and append their sampled tokens. Whether a request
        stops is decided by the caller (``engine.stops``), who ends it with :meth:`finish`."""
        for row in out.rows:
            seq = self.seqs.get(row.seq_id)
            if seq is None:  # aborted while the step ran
                continue
            seq.num_computed += len(row.token_ids)
            if row.prompt_logprobs and seq.num_computed >= len(seq.prompt_ids):
                seq.prompt_logprobs_done = True
            if row.sample:
                seq.output_ids.append(sampled[row.seq_id])
