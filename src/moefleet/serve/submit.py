"""Turning one API request into engine requests, and collecting their deltas.

A request with P prompts and ``n`` choices becomes P*n engine requests whose deltas share
one asyncio queue; choice ``index`` = prompt * n + choice. Admission runs in the engine
thread (it tokenizes), so a bad prompt fails with 400 before any response starts.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from moefleet.engine import Engine, EngineError, SamplingParams
from moefleet.serve.errors import APIError
from moefleet.serve.state import ServeState
from moefleet.serve.worker import Delta, WorkerDied

_ids = itertools.count()
DISCONNECT_POLL_S = 0.25

SIMPLE_CHAT_TEMPLATE = "{role}: {content}\n"  # documented in README; last line "assistant:"


@dataclass
class Submitted:
    rids: list[str]
    queue: asyncio.Queue[Any]
    prompt_lens: list[int]
    echo_texts: list[str]
    created: int = field(default_factory=lambda: int(time.time()))
    request_id: str = ""


def chat_prompt(engine: Engine, messages: Sequence[tuple[str, str]]) -> str:
    """The model's chat template if its tokenizer has one, else ``role: content`` lines."""
    tok = engine.tokenizer
    if tok is not None and getattr(tok, "chat_template", None):
        try:
            text = tok.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                           tokenize=False, add_generation_prompt=True)
        except Exception as err:
            raise EngineError(f"messages do not fit the model's chat template: {err}",
                              "check the roles and their order") from err
        return str(text)
    return "".join(SIMPLE_CHAT_TEMPLATE.format(role=r, content=c) for r, c in messages) + \
        "assistant:"


async def submit(state: ServeState, prompts: list[str | list[int]], body: Any, *,
                 max_tokens: int | None, logprobs: int | None, echo: bool = False) -> Submitted:
    """Admit every choice of every prompt, or none (all-or-nothing)."""
    state.admit()
    loop = asyncio.get_running_loop()
    q: asyncio.Queue[Any] = asyncio.Queue()
    base = f"cmpl-{next(_ids)}-{int(time.time() * 1000) % 10**9}"
    n = body.n
    kw = body.engine_kwargs()
    vocab = state.vocab_size
    bad = [t for t in kw["stop_token_ids"] if t >= vocab]
    if bad:
        raise APIError(400, f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                       param="stop_token_ids", code="invalid_value")
    biased = [t for t, _ in kw["logit_bias"] if t >= vocab]
    if biased:
        raise APIError(400, f"logit_bias token ids {biased[:5]} are outside the vocabulary "
                       f"[0, {vocab})", param="logit_bias", code="invalid_value")
    if kw["top_k"] > vocab:
        kw["top_k"] = 0  # more than the vocabulary keeps every token anyway
    worker = state.worker

    def add(engine: Engine) -> Submitted:
        rids: list[str] = []
        lens: list[int] = []
        echoes: list[str] = []
        try:
            for pi, prompt in enumerate(prompts):
                ids = engine.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
                bad = [t for t in ids if not 0 <= t < vocab]
                if bad:
                    raise EngineError(f"prompt {pi}: token ids {bad[:5]} are outside the "
                                      f"vocabulary [0, {vocab})", "tokenize with /tokenize")
                if not ids:
                    raise EngineError(f"prompt {pi} is empty after tokenization",
                                      "send some text or token ids")
                room = state.max_model_len - len(ids)
                limit = max_tokens if max_tokens is not None else max(
                    min(room, state.default_max_tokens or room), 1)
                lens.append(len(ids))
                if echo:
                    echoes.append(prompt if isinstance(prompt, str) else
                                  engine.tokenizer.decode(ids) if engine.tokenizer else "")
                for c in range(n):
                    seed = kw["seed"] if kw["seed"] is None else kw["seed"] + c
                    params = SamplingParams(**{**kw, "seed": seed}, max_tokens=limit,
                                            logprobs=logprobs,
                                            prompt_logprobs=echo and logprobs is not None)
                    rid = engine.add_request(ids, params, request_id=f"{base}-{pi}-{c}")
                    rids.append(rid)
                    worker.register(rid, q, loop, pi * n + c, token_strs=logprobs is not None,
                                    prompt_strs=echo and logprobs is not None)
                    state.metrics.prompt_tokens.labels(state.model_name).inc(len(ids))
        except BaseException:
            for rid in rids:
                worker.abort(rid)
            raise
        return Submitted(rids, q, lens, echoes, request_id=base)

    return await state.call(add)


def abort_soon(state: ServeState, rids: list[str]) -> None:
    """Abort from any coroutine, even one being cancelled: nothing is awaited."""
    if rids and state.worker.alive:
        state.worker.call(lambda _e: [state.worker.abort(r) for r in rids])


async def deltas(state: ServeState, sub: Submitted, request: Request | None
                 ) -> AsyncIterator[Delta]:
    """Every delta of ``sub`` until all its choices finish. The client going away (checked
    every ``DISCONNECT_POLL_S``) or this iterator closing early aborts what still runs.
    A choice whose model step failed raises a 500, a stalled engine a 503 (the other
    choices are aborted): a request in flight never hangs and never vanishes."""
    live = set(sub.rids)
    total = len(live)
    finished = 0
    checked = time.monotonic()
    try:
        while finished < total:
            if request is not None and time.monotonic() - checked >= DISCONNECT_POLL_S:
                checked = time.monotonic()
                if await request.is_disconnected():
                    return
            try:
                item = await asyncio.wait_for(sub.queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                state.check_stalled()
                continue
            if isinstance(item, WorkerDied):
                raise APIError(503, item.message, code="engine_dead")
            if item.out.finish_reason == "error":
                live.discard(item.out.request_id)
                raise APIError(500, item.out.error or "model step failed",
                               code="step_failed")
            if item.out.finished:
                finished += 1
                live.discard(item.out.request_id)
            yield item
    finally:
        abort_soon(state, sorted(live))
