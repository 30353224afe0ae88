"""Hostile connection behaviours, each on raw sockets against a real server on loopback.

Every case asserts: no 5xx for what is the client's fault, an answer (or a close) within a
bounded time, no error or traceback in the server's log, and a good request served right
after. The server runs with short limits (1 s head and body timeouts) so the slow cases
end quickly.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from moefleet.serve.connections import ConnectionLimits
from tests.serve.conftest import MODEL, Server, running, tiny_engine

LIMITS = ConnectionLimits(head_timeout_s=1.0, max_head_bytes=8192, body_timeout_s=1.0,
                          keep_alive_s=2)
CASE_LIMIT_S = 15.0


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


@pytest.fixture(scope="module")
def hostile() -> Iterator[tuple[Server, Records]]:
    with running(tiny_engine(max_num_seqs=4), limits=LIMITS, default_max_tokens=4,
                 max_body_bytes=64 * 1024, admission_wait_s=1.0) as s:
        rec = Records()
        loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "asyncio", "")]
        for lg in loggers:
            lg.addHandler(rec)
        try:
            yield s, rec
        finally:
            for lg in loggers:
                lg.removeHandler(rec)


# -- raw socket helpers ---------------------------------------------------------------
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


def read_for(c: socket.socket, seconds: float) -> bytes:
    return read_all(c, seconds)


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


# -- the cases: each returns the bytes the server sent, and says what it expects --------
def slow_body(s: Server) -> bytes:
    with connect(s) as c:
        body = completion_body()
        c.sendall(post("/v1/completions", b"")[:-2].replace(b"Content-Length: 0",
                  f"Content-Length: {len(body)}".encode()) + b"\r\n")
        return trickle(c, [body[i:i + 1] for i in range(8)])  # 2.4 s, past the 1 s limit


def body_never_sent(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(post("/v1/completions", b"").replace(b"Content-Length: 0",
                                                       b"Content-Length: 50"))
        return read_all(c)


def partial_body_then_silence(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(post("/v1/completions", completion_body())[:-10])
        return read_all(c)


def slowloris_headers(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")
        return trickle(c, [f"X-Slow-{i}: a\r\n".encode() for i in range(10)])


def partial_request_line(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(b"GET /hea")
        return read_all(c)


def idle_connection(s: Server) -> bytes:
    with connect(s) as c:
        t0 = time.monotonic()
        data = read_all(c)
        assert time.monotonic() - t0 < 5  # closed by the head timeout, not left open
        return data


def many_idle_connections(s: Server) -> bytes:
    conns = [connect(s) for _ in range(100)]
    try:
        good_request_works(s)  # served while 100 idle sockets are open
        return b"".join(read_all(c, 5) for c in conns)
    finally:
        for c in conns:
            c.close()


def _partial_bodies(s: Server, n: int) -> list[bytes]:
    conns = [connect(s) for _ in range(n)]
    try:
        for c in conns:
            c.sendall(post("/v1/completions", completion_body())[:-5])
        return [read_all(c, 8) for c in conns]
    finally:
        for c in conns:
            c.close()


def many_partial_bodies(s: Server) -> bytes:
    """8 partial bodies, within the gate's capacity (4 running + 4 waiting): all 408."""
    out = _partial_bodies(s, 8)
    assert all(statuses(d) == [408] for d in out), [d[:60] for d in out]
    return b"".join(out)


def flood_of_partial_bodies(s: Server) -> bytes:
    """60 partial bodies, past capacity: the first 8 get 408 once their bodies time out,
    the rest 503 (overloaded) after the gate's wait; nothing hangs."""
    out = _partial_bodies(s, 60)
    codes = [statuses(d) for d in out]
    assert all(c in ([408], [503]) for c in codes), codes
    assert codes.count([408]) >= 8
    return b""


def half_close_after_post(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(GOOD)
        c.shutdown(socket.SHUT_WR)
        data = read_all(c, 60)
    assert statuses(data) == [200] and b'"completion_tokens":2' in data
    return data


def half_close_after_get(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(HEALTH)
        c.shutdown(socket.SHUT_WR)
        data = read_all(c)
    assert statuses(data) == [200]
    return data


def half_close_streaming(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(post("/v1/completions", completion_body(stream=True, max_tokens=3)))
        c.shutdown(socket.SHUT_WR)
        data = read_all(c, 60)
    assert statuses(data) == [200] and data.count(b"data: {") == 3 and b"[DONE]" in data
    return data


def half_close_chat(s: Server) -> bytes:
    body = json.dumps({"model": MODEL, "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    with connect(s) as c:
        c.sendall(post("/v1/chat/completions", body))
        c.shutdown(socket.SHUT_WR)
        data = read_all(c, 60)
    assert statuses(data) == [200] and b"chat.completion" in data
    return data


def half_close_mid_body(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(GOOD[:-10])
        c.shutdown(socket.SHUT_WR)
        return read_all(c)


def pipelined_gets(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(HEALTH * 2 + HEALTH.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
        data = read_all(c)
    assert statuses(data) == [200, 200, 200]
    return data


def pipelined_post_then_get(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(GOOD + HEALTH.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
        data = read_all(c, 60)
    assert statuses(data) == [200, 200] and data.index(b"usage") < data.rindex(b"HTTP/1.1")
    return data


def pipelined_ten(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(GOOD * 9 + post("/v1/completions", completion_body(),
                                  "Connection: close\r\n"))
        data = read_all(c, 120)
    assert statuses(data) == [200] * 10
    return data


def pipelined_then_half_close(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(GOOD + GOOD)
        c.shutdown(socket.SHUT_WR)
        data = read_all(c, 60)
    assert statuses(data) and statuses(data)[0] == 200
    return data


def reset_mid_body(s: Server) -> bytes:
    c = connect(s)
    c.sendall(GOOD[:-10])
    time.sleep(0.1)
    reset(c)
    return b""


def reset_after_request(s: Server) -> bytes:
    c = connect(s)
    c.sendall(post("/v1/completions", completion_body(max_tokens=40, ignore_eos=True)))
    time.sleep(0.3)
    reset(c)
    return b""


def reset_mid_stream(s: Server) -> bytes:
    c = connect(s)
    c.sendall(post("/v1/completions", completion_body(stream=True, max_tokens=60,
                                                      ignore_eos=True)))
    first = c.recv(4096)
    reset(c)
    assert statuses(first) == [200]
    return first


def close_mid_stream(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(post("/v1/completions", completion_body(stream=True, max_tokens=60,
                                                          ignore_eos=True)))
        first = c.recv(4096)
    return first


def close_right_after_request(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(post("/v1/completions", completion_body(max_tokens=60, ignore_eos=True)))
    time.sleep(0.5)
    return b""


def reset_during_headers(s: Server) -> bytes:
    c = connect(s)
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Le")
    reset(c)
    return b""


def oversized_header(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n")
        data = read_all(c)
    assert statuses(data) == [431]
    return data


def too_many_headers(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n" +
                  b"".join(f"X-H{i}: v\r\n".encode() for i in range(2000)) + b"\r\n")
        data = read_all(c)
    assert statuses(data) == [431]
    return data


def oversized_url(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(b"GET /health?" + b"q" * 20000 + b" HTTP/1.1\r\nHost: t\r\n\r\n")
        data = read_all(c)
    assert statuses(data) == [431]
    return data


def _raw_post(s: Server, head_extra: bytes, body: bytes) -> bytes:
    with connect(s) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
                  b"Content-Type: application/json\r\n" + head_extra + b"\r\n" + body)
        return read_all(c)


def bad_content_length(s: Server) -> bytes:
    return _raw_post(s, b"Content-Length: abc\r\n", completion_body())


def negative_content_length(s: Server) -> bytes:
    return _raw_post(s, b"Content-Length: -1\r\n", completion_body())


def plus_content_length(s: Server) -> bytes:
    return _raw_post(s, b"Content-Length: +5\r\n", b"{}   ")


def conflicting_content_lengths(s: Server) -> bytes:
    return _raw_post(s, b"Content-Length: 5\r\nContent-Length: 7\r\n", b"{}     ")


def huge_content_length(s: Server) -> bytes:
    data = _raw_post(s, b"Content-Length: " + b"9" * 30 + b"\r\n", b"{}")
    assert statuses(data) in ([413], [400])
    return data


def content_length_and_chunked(s: Server) -> bytes:
    return _raw_post(s, b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n",
                     b"2\r\n{}\r\n0\r\n\r\n")


def chunked_garbage(s: Server) -> bytes:
    return _raw_post(s, b"Transfer-Encoding: chunked\r\n", b"zz\r\nnot hex\r\n\r\n")


def chunked_valid(s: Server) -> bytes:
    body = completion_body()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7])
                      for i in range(0, len(body), 7))
    data = _raw_post(s, b"Transfer-Encoding: chunked\r\nConnection: close\r\n",
                     chunks + b"0\r\n\r\n")
    assert statuses(data) == [200]
    return data


def chunked_over_limit(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked"
                  b"\r\n\r\n")
        piece = b"x" * 16384
        try:
            for _ in range(6):  # 96 KiB, over the 64 KiB limit
                c.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        except OSError:
            pass
        data = read_for(c, 3)
    assert statuses(data) == [413]
    return data


def chunked_never_ends(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked"
                  b"\r\n\r\n2\r\n{}\r\n")
        data = read_all(c)
    assert statuses(data) == [408]
    return data


def short_content_length(s: Server) -> bytes:
    body = completion_body()
    return _raw_post(s, f"Content-Length: {len(body) - 5}\r\n".encode(), body)


def long_content_length_then_close(s: Server) -> bytes:
    with connect(s) as c:
        body = completion_body()
        c.sendall(post("/v1/completions", body).replace(
            f"Content-Length: {len(body)}".encode(), f"Content-Length: {len(body) + 50}".encode()))
        c.shutdown(socket.SHUT_WR)
        return read_all(c)


def garbage_bytes(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(bytes(range(256)) * 4)
        return read_all(c)


def tls_client_hello(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(bytes.fromhex("16030100a5010000a10303") + b"\x00" * 40)
        return read_all(c)


def http2_preface(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        return read_all(c)


def http09_request(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(b"GET /health\r\n\r\n")
        return read_all(c)


def http10_without_host(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        data = read_all(c)
    assert statuses(data) == [200]
    return data


def unknown_method(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(b"FROB /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        return read_all(c)


def header_without_colon(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nno colon here\r\n\r\n")
        return read_all(c)


def nul_in_header(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nX-A: a\x00b\r\n\r\n")
        return read_all(c)


def obs_fold_header(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nX-A: a\r\n folded\r\n"
                  b"Connection: close\r\n\r\n")
        return read_all(c)


def non_ascii_path(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(b"GET /h\xe9alth HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        return read_all(c)


def long_method(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(b"A" * 5000 + b" /health HTTP/1.1\r\nHost: t\r\n\r\n")
        return read_all(c)


def expect_continue(s: Server) -> bytes:
    with connect(s) as c:
        body = completion_body()
        c.sendall(post("/v1/completions", b"", "Expect: 100-continue\r\nConnection: close\r\n")
                  .replace(b"Content-Length: 0", f"Content-Length: {len(body)}".encode()))
        first = c.recv(1024)
        assert first.startswith(b"HTTP/1.1 100")
        c.sendall(body)
        data = first + read_all(c, 60)
    assert statuses(data) == [200]
    return data


def expect_continue_no_body(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(post("/v1/completions", b"", "Expect: 100-continue\r\n")
                  .replace(b"Content-Length: 0", b"Content-Length: 40"))
        data = read_all(c)
    assert statuses(data) == [408]
    return data


def body_on_get(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n"
                  b"Connection: close\r\n\r\nhello")
        data = read_all(c)
    assert statuses(data) == [200]
    return data


def websocket_upgrade(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\n"
                  b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                  b"Sec-WebSocket-Version: 13\r\n\r\n")
        return read_all(c, 4)


def keep_alive_idle(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(HEALTH)
        t0 = time.monotonic()
        data = read_all(c)
        assert time.monotonic() - t0 < 6  # closed after the 2 s keep-alive
    assert statuses(data) == [200]
    return data


def rapid_open_close(s: Server) -> bytes:
    for _ in range(200):
        connect(s).close()
    return b""


def rapid_reset_requests(s: Server) -> bytes:
    for _ in range(50):
        c = connect(s)
        c.sendall(GOOD)
        reset(c)
    return b""


def json_content_type_lies(s: Server) -> bytes:
    data = _raw_post(s, b"Content-Length: 9\r\nConnection: close\r\n", b"\xff\xfe{}\x00\x01abc")
    assert statuses(data) == [400]
    return data


def deeply_nested_json(s: Server) -> bytes:
    body = b"[" * 20000 + b"]" * 20000
    data = _raw_post(s, f"Content-Length: {len(body)}\r\nConnection: close\r\n".encode(), body)
    assert statuses(data) == [400]
    return data


def partial_read_of_stream(s: Server) -> bytes:
    with connect(s) as c:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        c.sendall(post("/v1/completions", completion_body(stream=True, max_tokens=30,
                                                          ignore_eos=True)))
        time.sleep(1.0)  # read nothing for a while, then a little, then leave
        return c.recv(100)


def request_line_only_newlines(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(b"\r\n" * 1000)
        return read_all(c)


CASES: dict[str, Callable[[Server], bytes]] = {f.__name__: f for f in [
    slow_body, body_never_sent, partial_body_then_silence, slowloris_headers,
    partial_request_line, idle_connection, many_idle_connections, many_partial_bodies,
    flood_of_partial_bodies,
    half_close_after_post, half_close_after_get, half_close_streaming, half_close_chat,
    half_close_mid_body, pipelined_gets, pipelined_post_then_get, pipelined_ten,
    pipelined_then_half_close, reset_mid_body, reset_after_request, reset_mid_stream,
    close_mid_stream, close_right_after_request, reset_during_headers, oversized_header,
    too_many_headers, oversized_url, bad_content_length, negative_content_length,
    plus_content_length, conflicting_content_lengths, huge_content_length,
    content_length_and_chunked, chunked_garbage, chunked_valid, chunked_over_limit,
    chunked_never_ends, short_content_length, long_content_length_then_close,
    garbage_bytes, tls_client_hello, http2_preface, http09_request, http10_without_host,
    unknown_method, header_without_colon, nul_in_header, obs_fold_header, non_ascii_path,
    long_method, expect_continue, expect_continue_no_body, body_on_get, websocket_upgrade,
    keep_alive_idle, rapid_open_close, rapid_reset_requests, json_content_type_lies,
    deeply_nested_json, partial_read_of_stream, request_line_only_newlines]}
EXPECT_408 = {"slow_body", "body_never_sent", "partial_body_then_silence",
              "slowloris_headers", "partial_request_line"}


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_connection(hostile: tuple[Server, Records], name: str) -> None:
    s, rec = hostile
    mark = len(rec.records)
    t0 = time.monotonic()
    data = CASES[name](s)
    took = time.monotonic() - t0
    assert took < CASE_LIMIT_S, f"{name} took {took:.1f} s"
    codes = statuses(data)
    assert all(c < 500 for c in codes), (name, codes, data[:300])
    if name in EXPECT_408:
        assert codes == [408], (name, data[:300])
    good_request_works(s)  # the server still serves
    time.sleep(0.2)  # let the server finish logging what this case caused
    assert rec.bad_since(mark) == [], name
    assert not s.engine.has_unfinished or _drains(s), f"{name} left work in the engine"


def _drains(s: Server, limit_s: float = 30.0) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if not s.engine.has_unfinished:
            return True
        time.sleep(0.1)
    return False


def test_at_least_forty_behaviours() -> None:
    assert len(CASES) >= 40
