"""Connections the server does not trust: time and size limits on what a client sends.

Two layers, each bounded:

- :func:`protocol_class` makes uvicorn's httptools protocol stricter: a request head
  (request line + headers) must arrive within ``head_timeout_s`` of its first byte (or of
  the connection opening; slowloris) and stay under ``max_head_bytes`` (431 otherwise);
  a refusal of bytes pipelined behind a request still being answered waits for that
  reply (it is never cut off by ours);
  a client that half-closes its side after sending a complete request (``shutdown(SHUT_WR)``,
  ``nc -N``) still gets its reply (after interim ``100 Continue`` probes that tell it from
  a client that left, whose request is aborted), and then the connection closes; a
  response the client is no longer there to read is dropped quietly instead of raising
  into the log.
- :class:`BodyLimit` (ASGI middleware) reads the body before any handler runs: over
  ``limit`` bytes (declared or streamed) is 413 (the connection stays open and uvicorn
  discards the rest of the body: closing while the client still sends would reset the
  connection and lose the 413), not complete within ``timeout_s`` is 408 and closes the
  connection (a slow client is not worth waiting on twice).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moefleet.serve.errors import error_body

DEFAULT_HEAD_TIMEOUT_S = 10.0
DEFAULT_MAX_HEAD_KB = 32
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_KEEP_ALIVE_S = 5
LINGER_S = 2.0  # after refusing a connection, how long its client may still send
PROBE_AGAIN_S = 0.5  # after a FIN mid-request: the second probe, once a reset can be back


@dataclass(frozen=True)
class ConnectionLimits:
    """What one connection may take of the server's time and memory."""

    head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S
    max_head_bytes: int = DEFAULT_MAX_HEAD_KB * 1024
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    keep_alive_s: int = DEFAULT_KEEP_ALIVE_S

    def __post_init__(self) -> None:
        for name in ("head_timeout_s", "body_timeout_s"):
            v = getattr(self, name)
            if not 0 < v <= 3600:  # also refuses nan
                raise ValueError(f"{name} must be in (0, 3600] seconds, got {v}")
        if not 1024 <= self.max_head_bytes <= 1 << 20:
            raise ValueError(f"max_head_bytes must be in [1 KiB, 1 MiB], got "
                             f"{self.max_head_bytes}")
        if not 1 <= self.keep_alive_s <= 3600:
            raise ValueError(f"keep_alive_s must be in [1, 3600], got {self.keep_alive_s}")


def _raw_reply(status: bytes, message: str) -> bytes:
    body = (b'{"error":{"message":"' + message.encode() +
            b'","type":"invalid_request_error","param":null,"code":null}}')
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
            + body)


def protocol_class(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with ``limits`` applied (see the module docstring)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

    class QuietCycle(RequestResponseCycle):
        async def send(self, message: Any) -> None:
            # The transport can close before uvicorn learns of it (connection_lost runs
            # later); writing then raises. The client is gone: drop the reply, as uvicorn
            # does once it knows.
            if self.transport.is_closing():
                self.disconnected = True
            try:
                await super().send(message)
            except (RuntimeError, ConnectionError) as err:
                if not self.transport.is_closing() and "closed" not in str(err):
                    raise
                self.disconnected = True
                self.message_event.set()

    class LimitedHttpTools(HttpToolsProtocol):
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            self._head_timer: asyncio.TimerHandle | None = None
            self._head_bytes = 0
            self._refused = False
            self._pending: tuple[bytes, str] | None = None  # a refusal waiting its turn
            self._eof = False
            self._begun = False  # a request head has started and is not complete

        # -- the request head: time and size ---------------------------------------------
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_bytes = 0
            self._begun = True
            self._arm_head_timer()

        def on_url(self, url: bytes) -> None:
            self._count_head(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count_head(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._cancel_head_timer()
            self._begun = False
            super().on_headers_complete()
            if self.cycle is not None and type(self.cycle) is RequestResponseCycle:
                self.cycle.__class__ = QuietCycle

        def _count_head(self, n: int) -> None:
            self._head_bytes += n
            if self._head_bytes > limits.max_head_bytes:
                self._refuse(b"431 Request Header Fields Too Large",
                             f"request head over {limits.max_head_bytes} bytes")
                raise ValueError("request head too large")  # stops the parser

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(limits.head_timeout_s, self._head_late)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if self.cycle is not None and not self.cycle.response_complete:
                self._arm_head_timer()  # a reply is still being made: look again later
                return
            if self._begun:  # a request had begun: say why it ends
                self._refuse(b"408 Request Timeout", f"request head not complete within "
                             f"{limits.head_timeout_s:g} s")
            elif not self.transport.is_closing():
                self.transport.close()  # an idle connection that never sent a byte

        def _refuse(self, status: bytes, message: str) -> None:
            """Reply and close gracefully: our side first, then theirs after a linger.
            Closing outright while the client still sends would answer its next bytes
            with a reset, which can destroy the reply before the client reads it."""
            if self._refused or self.transport.is_closing():
                return
            self._refused = True
            self._cancel_head_timer()
            c = self.cycle
            if c is not None and not c.response_complete and not c.disconnected:
                # Garbage pipelined behind a request still being answered: that reply
                # goes first (ending our side now would cut it off mid-write).
                self._pending = (status, message)
                return
            self._write_refusal(status, message)

        def _write_refusal(self, status: bytes, message: str) -> None:
            self.transport.write(_raw_reply(status, message))
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(LINGER_S, self._close)

        def _close(self) -> None:
            if not self.transport.is_closing():
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            # uvicorn's own 400 (a request it cannot parse), in OpenAI's shape; after our
            # 431 the parser error it caused needs no second reply
            self._refuse(b"400 Bad Request", "invalid HTTP request")

        def data_received(self, data: bytes) -> None:
            if not self._refused:
                super().data_received(data)

        # -- half-close: answer, then close ----------------------------------------------
        def eof_received(self) -> bool | None:  # type: ignore[override]
            if self._refused and self._pending is None:
                return None  # the client has read our refusal and closed: so do we
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete and not cycle.more_body:
                # A FIN looks the same whether the client half-closed (and waits for the
                # reply) or left. Keep our side open, and probe: an interim 100 Continue
                # (every HTTP/1.1 client skips unexpected 1xx) draws a reset from a peer
                # that has left, and the next write then fails, so uvicorn sees the
                # disconnect and the request is aborted; a half-closed peer just reads on.
                self._eof = True
                self._probe()
                self.loop.call_later(PROBE_AGAIN_S, self._probe)
                return True
            return None  # nothing in flight: let the transport close

        def _probe(self) -> None:
            c = self.cycle
            if c is None or c.response_started or c.response_complete \
                    or self.transport.is_closing() or c.scope.get("http_version") != "1.1":
                return
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._pending is not None and not self.pipeline \
                    and not self.transport.is_closing():
                status, message = self._pending
                self._pending = None
                self._write_refusal(status, message)
                return
            if self._eof and not self.pipeline and not self.transport.is_closing():
                self.transport.close()

    return LimitedHttpTools


def uvicorn_config(app: Any, *, host: str = "127.0.0.1", port: int = 0,
                   limits: ConnectionLimits | None = None, **kw: Any) -> Any:
    """A ``uvicorn.Config`` serving ``app`` under ``limits`` (httptools, strict)."""
    import uvicorn

    limits = limits or ConnectionLimits()
    return uvicorn.Config(app, host=host, port=port, http=protocol_class(limits),
                          timeout_keep_alive=limits.keep_alive_s,
                          **{"log_level": "warning", "lifespan": "on", **kw})


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


class BodyLimit:
    """Reads the whole body before the app runs: 413 past ``limit`` bytes (declared or
    streamed), 408 when it is not complete within ``timeout_s`` of the first read."""

    def __init__(self, app: ASGIApp, limit: int, timeout_s: float = DEFAULT_BODY_TIMEOUT_S
                 ) -> None:
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await self._reject(send, 413, f"request body over {self.limit} bytes",
                               "body_too_large", close=False)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        chunks, size, more = [], 0, True
        while more:
            try:
                msg = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except TimeoutError:
                await self._reject(send, 408, f"request body not complete within "
                                   f"{self.timeout_s:g} s", "body_timeout")
                return
            if msg["type"] != "http.request":
                break
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._reject(send, 413, f"request body over {self.limit} bytes",
                                   "body_too_large", close=False)
                return
            chunks.append(chunk)
            more = msg.get("more_body", False)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, send: Send, status: int, message: str, code: str,
                      close: bool = True) -> None:
        resp = JSONResponse(error_body(status, message, code=code), status_code=status,
                            headers={"Connection": "close"} if close else None)
        await resp({"type": "http"}, _no_receive, send)
