"""Errors in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can cause maps to a 4xx here; 503 is reserved for load shedding, a
dead engine and a stalled one; 500 means the request's model step failed for good (an
expert call failed past its retries) while the server keeps serving.
The ``type`` strings are the ones OpenAI's clients map to their exception classes.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moefleet.errors import MoefleetError
from moefleet.serve.protocol import ErrorResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
          503: "service_unavailable"}

#: Declared on every endpoint so the OpenAPI schema documents each status we can return.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": desc} for code, desc in [
        (400, "Invalid request (bad field, malformed JSON, wrong content type)"),
        (401, "Missing or wrong API key"), (404, "Unknown model"),
        (413, "Request body too large"),
        (500, "The request's model step failed (an expert call failed past its retries)"),
        (503, "Overloaded (see Retry-After), engine not running, or a step stalled")]}

_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code, self.headers = code, headers


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param, err.code),
                        status_code=err.status, headers=err.headers)


def from_moefleet(err: MoefleetError) -> APIError:
    """A validation failure inside the engine (SamplingParams, context, vocabulary)."""
    word = err.message.split(" ", 1)[0]
    param = word if (word.replace("_", "").isalpha() and "_" in word) or word in (
        "temperature", "seed", "stop") else None
    msg = f"{err.message} ({err.hint})" if err.hint else err.message
    return APIError(400, msg, param=param, code="invalid_value")


async def _api_error(_: Request, err: Exception) -> JSONResponse:
    assert isinstance(err, APIError)
    return error_response(err)


async def _validation(_: Request, err: Exception) -> JSONResponse:
    assert isinstance(err, RequestValidationError)
    errs = err.errors()
    first = errs[0] if errs else {}
    # Drop "body" and pydantic's union-member tags ("constrained-str", "list[int]", ...).
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and str(p) not in _TAGS
           and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*|\d+", str(p))]
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid request"))
    if first.get("type") == "json_invalid":
        msg, param = "request body is not valid JSON", None
    elif first.get("type") == "missing" and not loc:
        msg = "request body is missing; send a JSON object with Content-Type: application/json"
    elif param:
        value = first.get("input")
        shown = repr(value)[:80] if not isinstance(value, dict) else "an object"
        msg = f"{param}: {msg} (got {shown})"
    return JSONResponse(error_body(400, msg, param, "invalid_value"), status_code=400)


async def _http(_: Request, err: Exception) -> JSONResponse:
    assert isinstance(err, StarletteHTTPException)
    status = err.status_code if err.status_code < 500 else 400
    return JSONResponse(error_body(status, str(err.detail)), status_code=status,
                        headers=getattr(err, "headers", None))


async def _moefleet(_: Request, err: Exception) -> JSONResponse:
    assert isinstance(err, MoefleetError)
    return error_response(from_moefleet(err))


HANDLERS = {APIError: _api_error, RequestValidationError: _validation,
            StarletteHTTPException: _http, MoefleetError: _moefleet}
