"""Raw-socket tools for the hostile connection tests: connect, read until close, send in
slow pieces, reset, build requests, and a log handler that collects what the server logs."""

from __future__ import annotations

import json
import logging
import re
import socket
import struct
import threading
import time
from typing import Any

from tests.serve.conftest import MODEL, Server


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._mu = threading.Lock()  # not self.lock: Handler holds that one in emit

    def emit(self, record: logging.LogRecord) -> None:
        with self._mu:
            self.records.append(record)

    def bad_since(self, n: int) -> list[str]:
        with self._mu:
            new = self.records[n:]
        return [f"{r.name}: {r.getMessage()}" for r in new
                if r.exc_info or r.levelno >= logging.ERROR or "Traceback" in r.getMessage()]



def _port(s: Server) -> int:
    return int(s.url.rsplit(":", 1)[1])


def connect(s: Server, timeout: float = 10.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", _port(s)), timeout=timeout)


def read_all(c: socket.socket, limit_s: float = 10.0) -> bytes:
    """Everything until the server closes (or ``limit_s``)."""
    out = b""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        c.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            chunk = c.recv(65536)
        except TimeoutError:
            break
        except (ConnectionResetError, BrokenPipeError):
            break
        if not chunk:
            break
        out += chunk
    return out


def trickle(c: socket.socket, pieces: list[bytes], gap_s: float = 0.3) -> bytes:
    """Send ``pieces`` ``gap_s`` apart, reading what comes back in between (a reset that
    follows a server's close would otherwise discard its reply unread)."""
    out = b""
    for piece in pieces:
        try:
            c.sendall(piece)
        except OSError:
            break
        c.settimeout(gap_s)
        try:
            chunk = c.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            break
        if not chunk:
            return out
        out += chunk
    return out + read_all(c, 5)


def statuses(data: bytes) -> list[int]:
    """Final status codes in a byte stream of responses (interim 1xx left out)."""
    return [int(m) for m in re.findall(rb"HTTP/1\.[01] (\d{3})", data) if not m.startswith(b"1")]


def reset(c: socket.socket) -> None:
    """Close with RST instead of FIN (SO_LINGER 0): an abrupt client."""
    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    c.close()


def completion_body(**kw: Any) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2, **kw}).encode()


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


GOOD = post("/v1/completions", completion_body())
HEALTH = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"


def good_request_works(s: Server) -> None:
    with connect(s) as c:
        c.sendall(post("/v1/completions", completion_body(), "Connection: close\r\n"))
        data = read_all(c, 60)
    assert statuses(data) == [200], data[:300]




def send_and_read(s: Server, payload: bytes, limit_s: float = 10.0) -> bytes:
    """Send ``payload`` on a new connection; everything the server sends until it closes."""
    with connect(s) as c:
        c.sendall(payload)
        return read_all(c, limit_s)


def raw_post(head_extra: bytes, body: bytes) -> bytes:
    """A completion POST with hand-written framing headers (``head_extra``)."""
    return (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
            b"Content-Type: application/json\r\n" + head_extra + b"\r\n" + body)
