"""The engine: ``step()`` = schedule -> execute -> update, streaming deltas.

Requests come in with :meth:`Engine.add_request` and leave finished or aborted; nothing
accepted is ever dropped (cache exhaustion preempts and recomputes). Every request's
clock readings (arrival, first schedule, each token, finish) give TTFT, TPOT,
inter-token latency and end-to-end latency; every step's per-expert token counts and
timings are kept in :attr:`Engine.stats`.

Failures (the engine's fault semantics, tested in tests/faults/test_engine_faults.py):

- A transient expert or runner failure (crashed, timed-out or throttled expert
  function, dropped connection) is retried in place by the runner; the step's requests
  only see added latency, and their outputs are unchanged (see ``runner.py``).
- When a step fails for good (retries exhausted, or an error that is not transient),
  every request with a row in that step ends at once with ``finish_reason="error"`` and
  ``error`` naming the cause; its cache is freed. The step's rows shared one batched
  expert call, so none of them can be trusted. Every other request (waiting, or not
  scheduled in that step) is untouched and the engine keeps serving: one bad step never
  takes the others down. Step hooks do not see a failed step.
- Any other exception (scheduler, sampler, detokenizer: a bug, not a fault) propagates
  out of :meth:`Engine.step`; the server then marks the engine dead (``/health`` 503)
  and fails every request in flight with a clear error (``serve/worker.py``).
- A stalled step (an expert call that does not return) cannot be interrupted in
  process: it delays the step's requests. The server's watchdog reports a step running
  past its ``step_timeout_s`` on ``/health`` (503) and fails the requests waiting on it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from moefleet.engine.detok import Detokenizer
from moefleet.engine.request import (
    EngineError,
    RequestOutput,
    RequestTimes,
    SamplingParams,
    Sequence,
)
from moefleet.engine.runner import ModelRunner, StepFailedError
from moefleet.engine.sampler import Sampler, prompt_top_logprobs
from moefleet.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from moefleet.engine.stops import token_stop

Clock = Callable[[], float]


class StepHook(Protocol):
    """Seam 3 inside the engine: a controller that sees each step's plan before it runs
    (e.g. SALC setting a brownout threshold for a prefill or a decode step) and the
    outputs after it (latencies to learn from). Hooks must not change the schedule."""

    def before_step(self, out: SchedulerOutput, now: float) -> None: ...

    def after_step(self, outputs: list[RequestOutput], now: float) -> None: ...


@dataclass
class StepStats:
    """One step: what ran and where the time went (``forward_s`` is the model's)."""

    num_rows: int
    num_tokens: int
    num_running: int
    num_waiting: int
    preempted: int
    forward_s: float
    total_s: float


@dataclass
class EngineStats:
    steps: list[StepStats] = field(default_factory=list)
    expert_tokens: dict[int, torch.Tensor] = field(default_factory=dict)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    failed_steps: int = 0
    failed_requests: int = 0
    max_steps_kept: int = 100_000  # a long-running server keeps a bounded history

    def record(self, s: StepStats, counts: dict[int, torch.Tensor]) -> None:
        if len(self.steps) >= self.max_steps_kept:
            del self.steps[: len(self.steps) // 2]
        self.steps.append(s)
        for layer, c in counts.items():
            prev = self.expert_tokens.get(layer)
            self.expert_tokens[layer] = c.clone() if prev is None else prev + c


@dataclass
class _Live:
    seq: Sequence
    times: RequestTimes
    detok: Detokenizer | None
    sent_prompt_logprobs: bool = False
    prompt_lps: list[float | None] = field(default_factory=list)
    prompt_tops: list[dict[int, float] | None] = field(default_factory=list)
    prompt_outputs: list[torch.Tensor] = field(default_factory=list)  # prefill-only chunks


class Engine:
    """One model, one runner, one scheduler. Not thread-safe: one thread drives it."""

    def __init__(self, runner: ModelRunner, *, tokenizer=None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, clock: Clock = time.monotonic,
                 eos_token_id: int | None = None, hooks: list[StepHook] | None = None
                 ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            num_cache_blocks=runner.num_cache_blocks, block_size=runner.block_size,
            max_model_len=runner.max_model_len))
        self.sampler = Sampler()
        self.clock = clock
        self.eos = eos_token_id if eos_token_id is not None else getattr(
            tokenizer, "eos_token_id", None)
        self.stats = EngineStats()
        self.hooks: list[StepHook] = list(hooks or [])
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count()

    # -- requests ------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise EngineError("this engine has no tokenizer, so it takes token ids only",
                              "pass prompt_token_ids")
        return list(self.tokenizer.encode(prompt))

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, arrival: float | None = None) -> str:
        params = params or SamplingParams()
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self._vocab()
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        biased = [t for t, _ in params.logit_bias if t >= vocab]
        if biased:
            raise EngineError(f"logit_bias token ids {biased[:5]} are outside the vocabulary "
                              f"[0, {vocab})", "bias token ids this model's tokenizer makes")
        if bad:
            raise EngineError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                              "tokenize with this model's tokenizer")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._live:
            raise EngineError(f"request id {rid!r} is already running", "use a fresh id")
        now = self.clock() if arrival is None else arrival
        seq = self.scheduler.add(rid, ids, params, now)
        detok = Detokenizer(self.tokenizer) if self.tokenizer is not None else None
        self._live[rid] = _Live(seq, RequestTimes(now), detok)
        self.stats.prompt_tokens += len(ids)
        return rid

    def _vocab(self) -> int:
        return self.runner.vocab_size

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its cache; False if it is not running."""
        live = self._live.pop(request_id, None)
        if live is None:
            return False
        self.scheduler.finish(live.seq.seq_id, "abort")
        self.runner.free([live.seq.seq_id])
        self.sampler.forget(live.seq.seq_id)
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the step ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.empty:
            return []
        now = self.clock()
        for row in sched.rows:
            live = self._live[self.scheduler.seqs[row.seq_id].request_id]
            if live.times.scheduled is None:
                live.times.scheduled = now
        for hook in self.hooks:
            hook.before_step(sched, now)
        try:
            res = self.runner.execute(sched)
        except StepFailedError as err:
            return self._fail_step(sched, err)
        seqs = self.scheduler.seqs
        for seq_id, logits_TV in res.prompt_logits.items():
            seq = seqs[seq_id]
            start = next(r.start for r in sched.rows if r.seq_id == seq_id)
            if seq.params.prefill_only:
                chunks = self._live[seq.request_id].prompt_outputs
                if start == 0:  # a preempted prompt is computed again from its start
                    chunks.clear()
                chunks.append(logits_TV)
            if seq.params.prompt_logprobs:
                self._prompt_logprobs(seq, start, logits_TV)
        tokens: list[int] = []
        lps: list = []
        if res.sample_logits_BV is not None:
            params = [seqs[s].params for s in res.sample_ids]
            try:
                tokens, lps = self.sampler.sample(
                    res.sample_logits_BV, res.sample_ids, params,
                    [seqs[s].output_ids for s in res.sample_ids])
            except (RuntimeError, ValueError) as err:  # e.g. NaN logits: fail these requests,
                return self._fail_step(sched, StepFailedError(res.sample_ids, err))  # not all
        sampled = dict(zip(res.sample_ids, tokens, strict=True))
        self.scheduler.update(sched, sampled)
        now = self.clock()
        outputs = [self._emit(seqs[s], tok, lp, now)
                   for s, tok, lp in zip(res.sample_ids, tokens, lps, strict=True)]
        outputs += [self._emit_prefilled(seqs[r.seq_id], now) for r in sched.rows
                    if r.seq_id in seqs and seqs[r.seq_id].params.prefill_only
                    and seqs[r.seq_id].num_computed >= len(seqs[r.seq_id].prompt_ids)]
        for hook in self.hooks:
            hook.after_step(outputs, now)
        self.stats.generation_tokens += len(tokens)
        self.stats.record(StepStats(
            len(sched.rows), sched.num_tokens, self.num_running, self.num_waiting,
            len(sched.preempted), res.forward_s, time.perf_counter() - t0), res.expert_counts)
        return outputs

    def _fail_step(self, sched: SchedulerOutput, err: StepFailedError) -> list[RequestOutput]:
        """End every request of a failed step with its error; the rest keep running."""
        now = self.clock()
        msg = str(err)
        outputs: list[RequestOutput] = []
        for row in sched.rows:
            seq = self.scheduler.seqs.get(row.seq_id)
            if seq is None:
                continue
            live = self._live.pop(seq.request_id)
            live.times.finished = now
            self.scheduler.finish(seq.seq_id, "error")
            self.runner.free([seq.seq_id])
            self.sampler.forget(seq.seq_id)
            outputs.append(RequestOutput(seq.request_id, [], "", True, "error", times=live.times,
                                         num_prompt_tokens=len(seq.prompt_ids),
                                         num_output_tokens=len(seq.output_ids), error=msg))
        self.stats.failed_steps += 1
        self.stats.failed_requests += len(outputs)
        return outputs

    def _prompt_logprobs(self, seq: Sequence, start: int, logits_TV: torch.Tensor) -> None:
        live = self._live[seq.request_id]
        if start == 0:
            live.prompt_lps, live.prompt_tops = [None], [None]
        n = len(seq.prompt_ids)
        stop = min(start + logits_TV.shape[0], n - 1)  # the last prompt row predicts output
        if stop > start:
            # the same top-n as the sampled tokens get (OpenAI's echo + logprobs=n)
            lps, tops = prompt_top_logprobs(logits_TV[: stop - start],
                                            seq.prompt_ids[start + 1: stop + 1],
                                            seq.params.logprobs or 0)
            live.prompt_lps.extend(lps)
            live.prompt_tops.extend(tops)

    def _emit(self, seq: Sequence, token: int, lp, now: float) -> RequestOutput:
        live = self._live[seq.request_id]
        t = live.times
        if t.first_token is None:
            t.first_token = now
        t.token_times.append(now)
        reason = token_stop(seq.params, token, len(seq.output_ids), self.eos)
        text = ""
        if live.detok is not None:
            text, hit = live.detok.add(token, seq.params.stop, final=reason is not None)
            if hit:
                reason = "stop"
                text = live.detok.flush_before_stop()
        out = RequestOutput(seq.request_id, [token], text, reason is not None, reason,
                            [lp] if lp is not None else None, times=t,
                            num_prompt_tokens=len(seq.prompt_ids),
                            num_output_tokens=len(seq.output_ids))
        self._attach_prompt(live, seq, out)
        if reason is not None:
            self._finish(seq, reason, now)
        return out

    def _emit_prefilled(self, seq: Sequence, now: float) -> RequestOutput:
        """The one output of a prefill-only request, once its whole prompt is computed."""
        live = self._live[seq.request_id]
        live.times.first_token = now
        out = RequestOutput(seq.request_id, [], "", True, "length", times=live.times,
                            num_prompt_tokens=len(seq.prompt_ids),
                            prompt_outputs=torch.cat(live.prompt_outputs))
        self._attach_prompt(live, seq, out)
        self._finish(seq, "length", now)
        return out

    def _attach_prompt(self, live: _Live, seq: Sequence, out: RequestOutput) -> None:
        if not live.sent_prompt_logprobs:
            live.sent_prompt_logprobs = True
            out.prompt_token_ids = list(seq.prompt_ids)
            if seq.params.prompt_logprobs:
                out.prompt_logprobs = live.prompt_lps
                out.prompt_top_logprobs = live.prompt_tops

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        self._live[seq.request_id].times.finished = now
        self.scheduler.finish(seq.seq_id, reason)
        self.runner.free([seq.seq_id])
        self.sampler.forget(seq.seq_id)
        del self._live[seq.request_id]

    # -- convenience ---------------------------------------------------------------
    def generate(self, prompts: Iterable[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 max_steps: int = 1_000_000) -> list[RequestOutput]:
        """Run prompts to completion; one merged output per prompt, in order."""
        plist = list(prompts)
        ps = params if isinstance(params, list) else [params or SamplingParams()] * len(plist)
        ids = [self.add_request(p, sp) for p, sp in zip(plist, ps, strict=True)]
        merged = {rid: RequestOutput(rid, [], "", False) for rid in ids}
        for _ in range(max_steps):
            if not self.has_unfinished:
                break
            for o in self.step():
                merge_into(merged[o.request_id], o)
        else:
            raise EngineError(f"generation did not finish in {max_steps} steps",
                              "raise max_steps")
        return [merged[r] for r in ids]


def merge_into(acc: RequestOutput, delta: RequestOutput) -> None:
    """Fold a streamed delta into an accumulated output."""
    acc.new_token_ids.extend(delta.new_token_ids)
    acc.new_text += delta.new_text
    if delta.logprobs:
        acc.logprobs = (acc.logprobs or []) + delta.logprobs
    if delta.prompt_logprobs is not None:
        acc.prompt_logprobs = delta.prompt_logprobs
        acc.prompt_top_logprobs = delta.prompt_top_logprobs
    if delta.prompt_token_ids is not None:
        acc.prompt_token_ids = delta.prompt_token_ids
    if delta.prompt_outputs is not None:
        acc.prompt_outputs = delta.prompt_outputs
    acc.finished, acc.finish_reason = delta.finished, delta.finish_reason
    acc.times = delta.times or acc.times
    acc.num_prompt_tokens = delta.num_prompt_tokens
    acc.num_output_tokens = delta.num_output_tokens
    acc.error = delta.error or acc.error
