"""The FastAPI app: one engine thread per app, OpenAI-compatible routes, /metrics.

``create_app(engine, ...)`` starts the engine's thread when the app starts (lifespan) and
stops it when the app stops. ``/v1/*`` needs the API key when one is set; ``/health``,
``/metrics`` and the tokenizer routes stay open.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from moefleet.compose.billing import Biller, InProcessBiller, InProcessPricer
from moefleet.compose.root import OpenedEngine
from moefleet.engine import Engine
from moefleet.experts.brownout_hook import ThresholdReport
from moefleet.platform import load_platform
from moefleet.serve.admission import (
    DEFAULT_WAIT_S,
    Admission,
    AdmissionGate,
    default_max_waiting,
)
from moefleet.serve.connections import DEFAULT_BODY_TIMEOUT_S, BodyLimit
from moefleet.serve.errors import ERROR_RESPONSES, HANDLERS, APIError, error_body
from moefleet.serve.metrics import ServeMetrics
from moefleet.serve.openai_api import router as openai_router
from moefleet.serve.protocol import DetokenizeRequest, TokenizeRequest
from moefleet.serve.state import DEFAULT_MAX_BODY_BYTES, ServeState
from moefleet.serve.submit import chat_prompt
from moefleet.serve.worker import EngineWorker

DEFAULT_MEMORY_MB = 2048


def create_app(engine: Engine | OpenedEngine, *, model_name: str, api_key: str | None = None,
               max_waiting: int | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, platform: str = "aws-lambda",
               memory_mb: int = DEFAULT_MEMORY_MB, slo_ttft_s: float | None = None,
               slo_tpot_s: float | None = None, default_max_tokens: int | None = None,
               biller: Biller | None = None, step_timeout_s: float | None = None,
               admission: bool = True, max_per_client: int | None = None,
               admission_wait_s: float = DEFAULT_WAIT_S,
               body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> FastAPI:
    """Serve ``engine``: an :class:`OpenedEngine` from the composition root (its biller
    bills each request; its brownout threshold is reported on ``/metrics``), or a bare
    engine billed by ``biller`` (default: the in-process estimate on ``platform`` at
    ``memory_mb``). ``step_timeout_s``: the watchdog's limit on one engine step (None: no
    watchdog); past it ``/health`` and the requests waiting on the step answer 503.

    ``admission`` puts :class:`~moefleet.serve.admission.AdmissionGate` in front (False:
    the old behaviour, shedding only after the body is parsed, kept to compare):
    ``max_waiting`` (default derived from the engine's slots and KV blocks) waiting on
    top of the engine's running slots, ``max_per_client`` slots per peer address,
    at most ``admission_wait_s`` for a slot before 503. ``body_timeout_s``: a request body not
    complete by then is 408."""
    metrics = ServeMetrics(model_name)
    opened = engine if isinstance(engine, OpenedEngine) else None
    eng = engine if isinstance(engine, Engine) else engine.engine
    sched = eng.scheduler.config
    if max_waiting is None:
        max_waiting = default_max_waiting(sched.max_num_seqs, sched.num_cache_blocks)
    if opened is not None:
        biller = biller or opened.biller
        router = opened.brownout
        if router is not None:
            gauge = metrics.controller
            eng.hooks.append(ThresholdReport(router, lambda kind, th: gauge.labels(
                model_name, f"brownout_threshold_{kind}").set(th)))
    if biller is None:
        biller = InProcessBiller(InProcessPricer(load_platform(platform), memory_mb))
    worker = EngineWorker(eng, metrics, biller, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s,
                          step_timeout_s=step_timeout_s,
                          retries=(lambda: opened.retries) if opened is not None else None)
    state = ServeState(worker, metrics, model_name, eng.runner.max_model_len,
                       eng.runner.vocab_size,
                       api_key=api_key, max_waiting=max_waiting, max_body_bytes=max_body_bytes,
                       default_max_tokens=default_max_tokens, gated=admission)
    if slo_ttft_s is not None:
        metrics.controller.labels(model_name, "slo_ttft_s").set(slo_ttft_s)
    if slo_tpot_s is not None:
        metrics.controller.labels(model_name, "slo_tpot_s").set(slo_tpot_s)
    metrics.controller.labels(model_name, "max_waiting").set(max_waiting)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not worker.is_alive():
            worker.start()
        yield
        worker.stop()

    app = FastAPI(title="moefleet", version="1", lifespan=lifespan,
                  exception_handlers=HANDLERS)  # type: ignore[arg-type]
    app.state.serve = state
    app.add_middleware(BodyLimit, limit=max_body_bytes, timeout_s=body_timeout_s)
    if admission:  # added last: outermost, so a rejection never reads the body
        gate = Admission(sched.max_num_seqs, max_waiting, per_client=max_per_client,
                         wait_s=admission_wait_s)
        app.state.admission = gate
        metrics.controller.labels(model_name, "admission_capacity").set(gate.capacity)
        app.add_middleware(AdmissionGate, admission=gate,
                           on_reject=lambda _r: metrics.rejected.labels(model_name).inc())

    async def check_key(request: Request) -> None:
        if state.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), state.api_key.encode()):
            raise APIError(401, "missing or wrong API key; send Authorization: Bearer <key>",
                           code="invalid_api_key")

    v1 = APIRouter(dependencies=[Depends(check_key)])
    v1.include_router(openai_router())

    created = int(time.time())
    card = {"id": model_name, "object": "model", "created": created, "owned_by": "moefleet",
            "max_model_len": state.max_model_len}

    @v1.get("/v1/models", responses=ERROR_RESPONSES)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @v1.get("/v1/models/{model_id:path}", responses=ERROR_RESPONSES)
    async def model(model_id: str) -> dict[str, Any]:
        state.check_model(model_id)  # 404 in OpenAI's shape for any other name
        return card

    app.include_router(v1)
    _open_routes(app, state)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _open_routes(app: FastAPI, state: ServeState) -> None:
    @app.get("/health", responses={503: ERROR_RESPONSES[503]})
    async def health() -> Response:
        if not state.worker.alive:
            return JSONResponse(error_body(503, state.worker.error or "engine not running",
                                           code="engine_dead"), status_code=503)
        try:
            state.check_stalled()
        except APIError as err:
            return JSONResponse(error_body(503, err.message, code=err.code), status_code=503)
        return JSONResponse({"status": "ok"})

    # HEAD: what load balancers' health checks send (uvicorn drops the body)
    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        state.check_model(body.model)
        state.check_alive()
        msgs = [(m.role, m.text()) for m in body.messages or []]

        def run(e: Engine) -> list[int]:
            text = body.prompt if body.prompt is not None else chat_prompt(e, msgs)
            return e.tokenize(text)

        ids = await state.call(run)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize", responses=ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        state.check_model(body.model)
        state.check_alive()
        bad = [t for t in body.tokens if not 0 <= t < state.vocab_size]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary "
                           f"[0, {state.vocab_size})", param="tokens", code="invalid_value")
        text = await state.call(lambda e: e.tokenizer.decode(body.tokens) if e.tokenizer
                                else "")
        return {"prompt": text}

    @app.get("/tokenizer_info", responses={503: ERROR_RESPONSES[503]})
    async def tokenizer_info() -> dict[str, Any]:
        state.check_alive()

        def info(e: Engine) -> dict[str, Any]:
            t = e.tokenizer
            return {"tokenizer_class": type(t).__name__ if t is not None else None,
                    "vocab_size": state.vocab_size, "max_model_len": state.max_model_len,
                    "eos_token_id": getattr(t, "eos_token_id", None),
                    "bos_token_id": getattr(t, "bos_token_id", None),
                    "chat_template": getattr(t, "chat_template", None)}

        return await state.call(info)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with its 422 replaced by the 400 we actually return."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for ops in schema.get("paths", {}).values():
        for op in ops.values():
            op.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
    app.openapi_schema = schema
    return schema
