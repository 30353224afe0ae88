"""The hostile connection behaviours: fixed byte strings in :data:`RAW` (sent on a new
connection, read until the server closes), behaviours that need timing, many sockets,
half-closes with checks of their own or resets as functions. Every case names what the
server must answer; the test adds what holds for all (no 5xx, bounded time, clean log)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from tests.serve.conftest import MODEL, Server
from tests.serve.hostile_helpers import (
    GOOD,
    HEALTH,
    completion_body,
    connect,
    good_request_works,
    post,
    raw_post,
    read_all,
    reset,
    statuses,
    trickle,
)


@dataclass(frozen=True)
class Raw:
    """Send ``payload`` (then half-close when ``half_close``), read for up to ``limit_s``;
    the final statuses must be one of ``expect`` (any, when empty) and the bytes must
    contain each of ``contains``."""

    payload: bytes
    expect: tuple[list[int], ...] = ()
    limit_s: float = 10.0
    half_close: bool = False
    contains: tuple[bytes, ...] = ()

    def __call__(self, s: Server) -> bytes:
        with connect(s) as c:
            c.sendall(self.payload)
            if self.half_close:
                c.shutdown(socket.SHUT_WR)
            data = read_all(c, self.limit_s)
        assert not self.expect or statuses(data) in self.expect, (statuses(data), data[:300])
        assert all(part in data for part in self.contains), data[:300]
        return data


_BODY = completion_body()
_CLOSE = b"\r\nConnection: close\r\n\r\n"
_CHAT = json.dumps({"model": MODEL, "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}]}).encode()
_CHUNKED = b"".join(b"%x\r\n%s\r\n" % (len(_BODY[i:i + 7]), _BODY[i:i + 7])
                    for i in range(0, len(_BODY), 7)) + b"0\r\n\r\n"
_NESTED = b"[" * 20000 + b"]" * 20000
_CHUNKED_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"

RAW: dict[str, Raw] = {
    "body_never_sent": Raw(post("/v1/completions", b"").replace(
        b"Content-Length: 0", b"Content-Length: 50"), ([408],)),
    "partial_body_then_silence": Raw(post("/v1/completions", _BODY)[:-10], ([408],)),
    "partial_request_line": Raw(b"GET /hea", ([408],)),
    "half_close_after_post": Raw(GOOD, ([200],), 60, True, (b'"completion_tokens":2',)),
    "half_close_after_get": Raw(HEALTH, ([200],), half_close=True),
    "half_close_chat": Raw(post("/v1/chat/completions", _CHAT), ([200],), 60, True,
                           (b"chat.completion",)),
    "half_close_mid_body": Raw(GOOD[:-10], half_close=True),
    "pipelined_gets": Raw(HEALTH * 2 + HEALTH.replace(b"\r\n\r\n", _CLOSE), ([200] * 3,)),
    "pipelined_ten": Raw(GOOD * 9 + post("/v1/completions", _BODY, "Connection: close\r\n"),
                         ([200] * 10,), 120),
    # a bad request pipelined behind a good one: the good one is answered first, whole
    "garbage_after_good": Raw(GOOD + b"\x00\x01 not http\r\n\r\n", ([200, 400],), 60,
                              contains=(b'"completion_tokens":2',)),
    "oversized_header_after_good": Raw(GOOD + b"GET /health HTTP/1.1\r\nX-Big: "
                                       + b"a" * 40000 + b"\r\n\r\n", ([200, 431],), 60),
    "oversized_header": Raw(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 20000
                            + b"\r\n\r\n", ([431],)),
    "too_many_headers": Raw(b"GET /health HTTP/1.1\r\nHost: t\r\n" + b"".join(
        f"X-H{i}: v\r\n".encode() for i in range(2000)) + b"\r\n", ([431],)),
    "oversized_url": Raw(b"GET /health?" + b"q" * 20000 + b" HTTP/1.1\r\nHost: t\r\n\r\n",
                         ([431],)),
    "bad_content_length": Raw(raw_post(b"Content-Length: abc\r\n", _BODY)),
    "negative_content_length": Raw(raw_post(b"Content-Length: -1\r\n", _BODY)),
    "plus_content_length": Raw(raw_post(b"Content-Length: +5\r\n", b"{}   ")),
    "conflicting_content_lengths": Raw(raw_post(b"Content-Length: 5\r\nContent-Length: 7\r\n",
                                                b"{}     ")),
    "huge_content_length": Raw(raw_post(b"Content-Length: " + b"9" * 30 + b"\r\n", b"{}"),
                               ([413], [400])),
    "content_length_and_chunked": Raw(raw_post(
        b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n", b"2\r\n{}\r\n0\r\n\r\n")),
    "chunked_garbage": Raw(raw_post(b"Transfer-Encoding: chunked\r\n",
                                    b"zz\r\nnot hex\r\n\r\n")),
    "chunked_valid": Raw(raw_post(b"Transfer-Encoding: chunked\r\nConnection: close\r\n",
                                  _CHUNKED), ([200],)),
    "chunked_never_ends": Raw(_CHUNKED_HEAD + b"2\r\n{}\r\n", ([408],)),
    # the body is cut 5 bytes short (400: not JSON); those 5 bytes are no request (400, after)
    "short_content_length": Raw(raw_post(f"Content-Length: {len(_BODY) - 5}\r\n".encode(),
                                         _BODY), ([400, 400],)),
    "garbage_bytes": Raw(bytes(range(256)) * 4),
    "tls_client_hello": Raw(bytes.fromhex("16030100a5010000a10303") + b"\x00" * 40),
    "http2_preface": Raw(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04" + b"\x00" * 5),
    "http09_request": Raw(b"GET /health\r\n\r\n"),
    "http10_without_host": Raw(b"GET /health HTTP/1.0\r\n\r\n", ([200],)),
    "unknown_method": Raw(b"FROB /health HTTP/1.1\r\nHost: t" + _CLOSE),
    "header_without_colon": Raw(b"GET /health HTTP/1.1\r\nHost: t\r\nno colon here\r\n\r\n"),
    "nul_in_header": Raw(b"GET /health HTTP/1.1\r\nHost: t\r\nX-A: a\x00b\r\n\r\n"),
    "obs_fold_header": Raw(b"GET /health HTTP/1.1\r\nHost: t\r\nX-A: a\r\n folded" + _CLOSE),
    "non_ascii_path": Raw(b"GET /h\xe9alth HTTP/1.1\r\nHost: t" + _CLOSE),
    "long_method": Raw(b"A" * 5000 + b" /health HTTP/1.1\r\nHost: t\r\n\r\n"),
    "expect_continue_no_body": Raw(post("/v1/completions", b"", "Expect: 100-continue\r\n")
                                   .replace(b"Content-Length: 0", b"Content-Length: 40"),
                                   ([408],)),
    "body_on_get": Raw(b"GET /health HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n"
                       b"Connection: close\r\n\r\nhello", ([200],)),
    "websocket_upgrade": Raw(b"GET /health HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\n"
                             b"Connection: Upgrade\r\nSec-WebSocket-Key: "
                             b"dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
                             limit_s=4),
    "json_content_type_lies": Raw(raw_post(b"Content-Length: 9\r\nConnection: close\r\n",
                                           b"\xff\xfe{}\x00\x01abc"), ([400],)),
    "deeply_nested_json": Raw(raw_post(f"Content-Length: {len(_NESTED)}\r\nConnection: "
                                       "close\r\n".encode(), _NESTED), ([400],)),
    "request_line_only_newlines": Raw(b"\r\n" * 1000),
}


# -- behaviours with timing, many sockets or checks of their own ------------------------
def slow_body(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(post("/v1/completions", b"")[:-2].replace(b"Content-Length: 0",
                  f"Content-Length: {len(_BODY)}".encode()) + b"\r\n")
        return trickle(c, [_BODY[i:i + 1] for i in range(8)])  # 2.4 s, past the 1 s limit


def slowloris_headers(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")
        return trickle(c, [f"X-Slow-{i}: a\r\n".encode() for i in range(10)])


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
            c.sendall(post("/v1/completions", _BODY)[:-5])
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


def half_close_streaming(s: Server) -> bytes:
    data = Raw(post("/v1/completions", completion_body(stream=True, max_tokens=3)), ([200],),
               60, True, (b"[DONE]",))(s)
    assert data.count(b"data: {") == 3
    return data


def pipelined_post_then_get(s: Server) -> bytes:
    data = Raw(GOOD + HEALTH.replace(b"\r\n\r\n", _CLOSE), ([200, 200],), 60)(s)
    assert data.index(b"usage") < data.rindex(b"HTTP/1.1")
    return data


def pipelined_then_half_close(s: Server) -> bytes:
    data = Raw(GOOD + GOOD, limit_s=60, half_close=True)(s)
    assert statuses(data) and statuses(data)[0] == 200
    return data


def _reset_after(payload: bytes, wait_s: float) -> Callable[[Server], bytes]:
    def case(s: Server) -> bytes:
        c = connect(s)
        c.sendall(payload)
        time.sleep(wait_s)
        reset(c)
        return b""
    return case


def _stream_then_leave(abrupt: bool) -> Callable[[Server], bytes]:
    def case(s: Server) -> bytes:
        c = connect(s)
        c.sendall(post("/v1/completions", completion_body(stream=True, max_tokens=60,
                                                          ignore_eos=True)))
        first = c.recv(4096)
        if abrupt:
            reset(c)
            assert statuses(first) == [200]
        else:
            c.close()
        return first
    return case


def close_right_after_request(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(post("/v1/completions", completion_body(max_tokens=60, ignore_eos=True)))
    time.sleep(0.5)
    return b""


def chunked_over_limit(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(_CHUNKED_HEAD)
        piece = b"x" * 16384
        try:
            for _ in range(6):  # 96 KiB, over the 64 KiB limit
                c.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        except OSError:
            pass
        data = read_all(c, 3)
    assert statuses(data) == [413]
    return data


def long_content_length_then_close(s: Server) -> bytes:
    return Raw(GOOD.replace(f"Content-Length: {len(_BODY)}".encode(),
                            f"Content-Length: {len(_BODY) + 50}".encode()),
               half_close=True)(s)


def expect_continue(s: Server) -> bytes:
    with connect(s) as c:
        c.sendall(post("/v1/completions", b"", "Expect: 100-continue\r\nConnection: close\r\n")
                  .replace(b"Content-Length: 0", f"Content-Length: {len(_BODY)}".encode()))
        first = c.recv(1024)
        assert first.startswith(b"HTTP/1.1 100")
        c.sendall(_BODY)
        data = first + read_all(c, 60)
    assert statuses(data) == [200]
    return data


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
        _reset_after(GOOD, 0.0)(s)
    return b""


def partial_read_of_stream(s: Server) -> bytes:
    with connect(s) as c:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        c.sendall(post("/v1/completions", completion_body(stream=True, max_tokens=30,
                                                          ignore_eos=True)))
        time.sleep(1.0)  # read nothing for a while, then a little, then leave
        return c.recv(100)


_FUNCS: dict[str, Callable[[Server], bytes]] = {
    **{f.__name__: f for f in [
        slow_body, slowloris_headers, idle_connection, many_idle_connections,
        many_partial_bodies, flood_of_partial_bodies, half_close_streaming,
        pipelined_post_then_get, pipelined_then_half_close, close_right_after_request,
        chunked_over_limit, long_content_length_then_close, expect_continue,
        keep_alive_idle, rapid_open_close, rapid_reset_requests, partial_read_of_stream]},
    "reset_mid_body": _reset_after(GOOD[:-10], 0.1),
    "reset_after_request": _reset_after(post("/v1/completions", completion_body(
        max_tokens=40, ignore_eos=True)), 0.3),
    "reset_during_headers": _reset_after(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
                                         b"Content-Le", 0.0),
    "reset_mid_stream": _stream_then_leave(abrupt=True),
    "close_mid_stream": _stream_then_leave(abrupt=False),
}
# The order the module's one server meets them in (the original sequence of the suite).
ORDER = [
    "slow_body", "body_never_sent", "partial_body_then_silence", "slowloris_headers",
    "partial_request_line", "idle_connection", "many_idle_connections",
    "many_partial_bodies", "flood_of_partial_bodies", "half_close_after_post",
    "half_close_after_get", "half_close_streaming", "half_close_chat", "half_close_mid_body",
    "pipelined_gets", "pipelined_post_then_get", "pipelined_ten", "pipelined_then_half_close",
    "reset_mid_body", "reset_after_request", "reset_mid_stream", "close_mid_stream",
    "close_right_after_request", "reset_during_headers", "oversized_header",
    "too_many_headers", "oversized_url", "bad_content_length", "negative_content_length",
    "plus_content_length", "conflicting_content_lengths", "huge_content_length",
    "content_length_and_chunked", "chunked_garbage", "chunked_valid", "chunked_over_limit",
    "chunked_never_ends", "short_content_length", "garbage_after_good",
    "oversized_header_after_good", "long_content_length_then_close",
    "garbage_bytes", "tls_client_hello", "http2_preface", "http09_request",
    "http10_without_host", "unknown_method", "header_without_colon", "nul_in_header",
    "obs_fold_header", "non_ascii_path", "long_method", "expect_continue",
    "expect_continue_no_body", "body_on_get", "websocket_upgrade", "keep_alive_idle",
    "rapid_open_close", "rapid_reset_requests", "json_content_type_lies",
    "deeply_nested_json", "partial_read_of_stream", "request_line_only_newlines"]
CASES: dict[str, Callable[[Server], bytes]] = {n: RAW.get(n) or _FUNCS[n] for n in ORDER}
assert set(CASES) == set(RAW) | set(_FUNCS), "every case is run, in ORDER"
# Slow or partial requests the head/body timeouts must answer with 408.
EXPECT_408 = {"slow_body", "body_never_sent", "partial_body_then_silence",
              "slowloris_headers", "partial_request_line"}
