"""``POST /v1/completions`` and ``POST /v1/chat/completions``: JSON or server-sent events.

Usage carries the request's billed cost (``usage.billed_cost``, an extension field) summed
over its choices. Once a stream has started, errors are sent in-stream as
``data: {"error": ...}`` followed by ``data: [DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from moefleet.serve.errors import ERROR_RESPONSES, APIError, error_body
from moefleet.serve.protocol import ChatCompletionRequest, CompletionRequest
from moefleet.serve.submit import Submitted, chat_prompt, deltas, submit
from moefleet.serve.worker import Delta

_STREAM_DOC: dict[int | str, dict[str, Any]] = {
    200: {"description": "A completion (JSON), or server-sent events with stream=true",
          "content": {"application/json": {}, "text/event-stream": {}}},
    **ERROR_RESPONSES}


def router() -> APIRouter:
    r = APIRouter()

    @r.post("/v1/completions", responses=_STREAM_DOC)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        state = request.app.state.serve
        state.check_model(body.model)
        refuse_unsupported(body)
        sub = await submit(state, body.prompts(), body, max_tokens=body.max_tokens,
                           logprobs=body.logprobs, echo=body.echo)
        if body.stream:
            return _sse(_completion_events(state, sub, body, request))
        return JSONResponse(await _completion_json(state, sub, body, request))

    @r.post("/v1/chat/completions", responses=_STREAM_DOC)
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        state = request.app.state.serve
        state.check_model(body.model)
        refuse_unsupported(body)
        msgs = [(m.role, m.text()) for m in body.messages]
        prompt = await state.call(lambda e: chat_prompt(e, msgs))
        lp = (body.top_logprobs or 0) if body.logprobs else None
        sub = await submit(state, [prompt], body, max_tokens=body.limit(), logprobs=lp)
        if body.stream:
            return _sse(_chat_events(state, sub, body, request))
        return JSONResponse(await _chat_json(state, sub, body, request))

    return r


def refuse_unsupported(body: CompletionRequest | ChatCompletionRequest) -> None:
    """400 naming the first parameter this server would otherwise have to ignore."""
    bad = body.unsupported()
    if bad is not None:
        name, value = bad
        raise APIError(400, f"{name} is not supported by this server (got "
                       f"{json.dumps(value)[:80]}); omit it or send its default",
                       param=name, code="unsupported_parameter")


def _sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for ev in events:
                yield f"data: {json.dumps(ev, separators=(',', ':'))}\n\n"
        except APIError as err:
            body = error_body(err.status, err.message, err.param, err.code)
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _usage(sub: Submitted, completion_tokens: int, costs: list[Any], n: int) -> dict[str, Any]:
    prompt = sum(sub.prompt_lens) * n
    billed: dict[str, Any] = {"usd": 0.0, "compute": 0.0, "requests": 0.0, "storage": 0.0}
    for c in costs:
        for k, v in c.to_dict().items():
            if k == "invocations":  # records attributed to each choice (with --plan)
                billed[k] = int(billed.get(k, 0)) + int(v)
            elif isinstance(v, float) and (k in billed or k in ("main_usd", "remote_usd")):
                billed[k] = float(billed.get(k, 0.0)) + v  # Remoe: main and remote parts
            elif isinstance(v, str):
                billed[k] = v
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens, "billed_cost": billed}


# -- completions -----------------------------------------------------------------------
class _Logprobs:
    """OpenAI legacy logprobs: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top: list[dict[str, float] | None] = []
        self.offsets: list[int] = []
        self.offset = 0

    def add_prompt(self, d: Delta) -> None:
        strs = d.prompt_token_strs or []
        lps = d.out.prompt_logprobs or [None] * len(strs)
        tops = d.prompt_top_strs or [None] * len(strs)
        for s, lp, alt in zip(strs, lps, tops, strict=False):
            top = None
            if lp is not None:  # the n alternatives and the prompt token itself
                top = dict(alt or {})
                top.setdefault(s, lp)
            self._add(s, lp, top)

    def add(self, d: Delta) -> None:
        for i, s in enumerate(d.token_strs):
            lp = d.out.logprobs[i] if d.out.logprobs and i < len(d.out.logprobs) else None
            top = dict(d.top_strs[i]) if i < len(d.top_strs) else {}
            if lp is not None:
                top.setdefault(s, lp.logprob)
            self._add(s, None if lp is None else lp.logprob, top)

    def _add(self, s: str, lp: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(s)
        self.token_logprobs.append(lp)
        self.top.append(top)
        self.offsets.append(self.offset)
        self.offset += len(s)

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top, "text_offset": self.offsets}


def _echo(sub: Submitted, index: int, n: int) -> str:
    return sub.echo_texts[index // n] if sub.echo_texts else ""


async def _completion_json(state: Any, sub: Submitted, body: CompletionRequest,
                           request: Request) -> dict[str, Any]:
    n = body.n
    texts = {i: _echo(sub, i, n) for i in range(len(sub.rids))}
    lps = {i: _Logprobs() for i in range(len(sub.rids))}
    reasons: dict[int, str | None] = {}
    costs, tokens = [], 0
    async for d in deltas(state, sub, request):
        i = d.index
        if body.echo and d.prompt_token_strs is not None:
            lps[i].add_prompt(d)
        texts[i] += d.out.new_text
        tokens += len(d.out.new_token_ids)
        lps[i].add(d)
        if d.out.finished:
            reasons[i] = d.out.finish_reason
            if d.cost is not None:
                costs.append(d.cost)
    choices = [{"index": i, "text": texts[i], "finish_reason": reasons.get(i),
                "logprobs": lps[i].to_dict() if body.logprobs is not None else None}
               for i in range(len(sub.rids))]
    return {"id": sub.request_id, "object": "text_completion", "created": sub.created,
            "model": state.model_name, "choices": choices,
            "usage": _usage(sub, tokens, costs, n)}


async def _completion_events(state: Any, sub: Submitted, body: CompletionRequest,
                             request: Request) -> AsyncIterator[dict[str, Any]]:
    n = body.n
    costs, tokens = [], 0
    head = {"id": sub.request_id, "object": "text_completion", "created": sub.created,
            "model": state.model_name}
    started: set[int] = set()
    async for d in deltas(state, sub, request):
        i = d.index
        text, lp = d.out.new_text, _Logprobs()
        if i not in started:
            started.add(i)
            if body.echo:
                text = _echo(sub, i, n) + text
                if d.prompt_token_strs is not None:
                    lp.add_prompt(d)
        lp.add(d)
        tokens += len(d.out.new_token_ids)
        if d.cost is not None:
            costs.append(d.cost)
        yield {**head, "choices": [{"index": i, "text": text, "finish_reason":
                                    d.out.finish_reason if d.out.finished else None,
                                    "logprobs": lp.to_dict() if body.logprobs is not None
                                    else None}]}
    if body.include_usage:
        yield {**head, "choices": [], "usage": _usage(sub, tokens, costs, n)}


# -- chat ------------------------------------------------------------------------------
def _chat_logprobs(d: Delta) -> list[dict[str, Any]]:
    out = []
    for i, s in enumerate(d.token_strs):
        lp = d.out.logprobs[i] if d.out.logprobs and i < len(d.out.logprobs) else None
        tops = d.top_strs[i] if i < len(d.top_strs) else {}
        out.append({"token": s, "logprob": lp.logprob if lp else None,
                    "bytes": list(s.encode()),
                    "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                     for t, v in tops.items()]})
    return out


async def _chat_json(state: Any, sub: Submitted, body: ChatCompletionRequest,
                     request: Request) -> dict[str, Any]:
    k = len(sub.rids)
    texts = {i: "" for i in range(k)}
    lps: dict[int, list[dict[str, Any]]] = {i: [] for i in range(k)}
    reasons: dict[int, str | None] = {}
    costs, tokens = [], 0
    async for d in deltas(state, sub, request):
        texts[d.index] += d.out.new_text
        lps[d.index] += _chat_logprobs(d)
        tokens += len(d.out.new_token_ids)
        if d.out.finished:
            reasons[d.index] = d.out.finish_reason
            if d.cost is not None:
                costs.append(d.cost)
    choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]},
                "finish_reason": reasons.get(i),
                "logprobs": {"content": lps[i]} if body.logprobs else None} for i in range(k)]
    return {"id": "chat" + sub.request_id, "object": "chat.completion",
            "created": sub.created, "model": state.model_name, "choices": choices,
            "usage": _usage(sub, tokens, costs, body.n)}


async def _chat_events(state: Any, sub: Submitted, body: ChatCompletionRequest,
                       request: Request) -> AsyncIterator[dict[str, Any]]:
    head = {"id": "chat" + sub.request_id, "object": "chat.completion.chunk",
            "created": sub.created, "model": state.model_name}
    for i in range(len(sub.rids)):
        yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}]}
    costs, tokens = [], 0
    async for d in deltas(state, sub, request):
        tokens += len(d.out.new_token_ids)
        if d.cost is not None:
            costs.append(d.cost)
        yield {**head, "choices": [{
            "index": d.index, "delta": {"content": d.out.new_text},
            "logprobs": {"content": _chat_logprobs(d)} if body.logprobs else None,
            "finish_reason": d.out.finish_reason if d.out.finished else None}]}
    if body.include_usage:
        yield {**head, "choices": [], "usage": _usage(sub, tokens, costs, body.n)}


