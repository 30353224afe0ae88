"""The admission gate: its bookkeeping on a fake clock, and on a real server a rejection
that never reads the body, the per-client cap, and the derived default queue."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.parse

import pytest

from moefleet.serve.admission import Admission, default_max_waiting
from tests.serve.conftest import MODEL, running, tiny_engine
from tests.serve.test_http_limits import _open_stream, metrics, request, wait_for


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_capacity_is_running_plus_waiting_and_slots_pass_fifo() -> None:
    async def go() -> None:
        gate = Admission(1, 1, wait_s=5.0)
        assert gate.capacity == 2
        assert await gate.enter("a") is None and await gate.enter("b") is None
        third = asyncio.create_task(gate.enter("c"))
        fourth = asyncio.create_task(gate.enter("d"))
        await asyncio.sleep(0.01)
        assert gate.parked == 2 and not third.done()
        gate.leave("a")  # a's slot goes to the longest parked, c
        assert await asyncio.wait_for(third, 1) is None
        assert gate.inflight == 2 and not fourth.done()
        gate.leave("b")
        assert await asyncio.wait_for(fourth, 1) is None
        gate.leave("c")
        gate.leave("d")
        assert gate.inflight == 0 and gate.parked == 0

    asyncio.run(go())


def test_a_parked_request_gets_503_after_the_wait_and_leaks_nothing() -> None:
    async def go() -> None:
        gate = Admission(1, 0, wait_s=0.05)
        assert await gate.enter("a") is None
        t0 = time.monotonic()
        rej = await gate.enter("b")
        assert rej is not None and rej.status == 503 and rej.code == "overloaded"
        assert time.monotonic() - t0 >= 0.04 and rej.retry_after_s >= 1
        waiter = asyncio.create_task(gate.enter("c"))
        await asyncio.sleep(0.01)
        waiter.cancel()  # e.g. the server shutting down
        with pytest.raises(asyncio.CancelledError):
            await waiter
        gate.leave("a")
        assert gate.inflight == 0 and gate.parked == 0
        assert await gate.enter("e") is None  # the slot is free again

    asyncio.run(go())


def test_per_client_cap_is_429_for_that_client_only() -> None:
    async def go() -> None:
        gate = Admission(4, 4, per_client=2, wait_s=0.01)
        assert await gate.enter("x") is None and await gate.enter("x") is None
        rej = await gate.enter("x")
        assert rej is not None and rej.status == 429 and "x" in rej.message
        assert await gate.enter("y") is None
        gate.leave("x")
        assert await gate.enter("x") is None

    asyncio.run(go())


def test_retry_after_is_the_queue_drain_time_at_the_measured_rate() -> None:
    async def go() -> None:
        clock = Clock()
        gate = Admission(2, 10, wait_s=30.0, clock=clock)
        assert gate.retry_after() == 1  # nothing measured yet
        for _ in range(12):
            assert await gate.enter("a") is None
        for i in range(11):  # 11 completions over 5 s: 2.2 per second
            clock.t = i * 0.5
            gate.leave("a")
            assert await gate.enter("a") is None
        # 12 in flight, 2 running: 10 ahead + the newcomer, at 11 / 5 s -> 5 s
        assert gate.inflight == 12 and gate.retry_after() == 5
        assert gate.park_s() == pytest.approx(5.0)  # parked for the drain time (< wait_s)
        clock.t = 100.0  # the measurements age out of the 10 s window
        assert gate.retry_after() == 1

    asyncio.run(go())


def test_default_waiting_queue_follows_the_engine() -> None:
    assert default_max_waiting(64, 4096) == 64
    assert default_max_waiting(64, 10) == 10  # KV blocks bound what runs at once
    with running(tiny_engine(max_num_seqs=3)) as s:
        gate = s.app.state.admission
        assert (gate.running, gate.max_waiting, gate.capacity) == (3, 3, 6)
        m = metrics(s.url)
        assert m[("moefleet:controller_setting", (("setting", "admission_capacity"),))] == 6


def test_a_rejection_never_reads_the_body() -> None:
    """Over capacity, a request whose 1 MB body never comes is answered 503 after the
    wait, not after the body timeout: the gate decided on the head alone."""
    with running(tiny_engine(max_num_seqs=1), max_waiting=1, admission_wait_s=0.3,
                 body_timeout_s=20) as s:
        a_conn, a = _open_stream(s.url, 400)
        assert a.readline().startswith(b"data: ")
        b_conn, _ = _open_stream(s.url, 400)
        u = urllib.parse.urlsplit(s.url)
        with socket.create_connection((u.hostname, u.port), timeout=10) as c:
            t0 = time.monotonic()
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n")
            reply = c.recv(65536)
            took = time.monotonic() - t0
        head = reply.split(b"\r\n\r\n")[0].decode().lower()
        assert head.startswith("http/1.1 503") and "retry-after:" in head, head
        assert 0.25 <= took < 5, took
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "overloaded"
        a_conn.close()
        b_conn.close()
        wait_for(lambda: not s.engine.has_unfinished, "both streams aborted")
        status, _, _ = request(s.url, "POST", "/v1/completions",
                               {"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert status == 200


def test_per_client_cap_over_http() -> None:
    with running(tiny_engine(max_num_seqs=4), max_per_client=1, admission_wait_s=0.1) as s:
        conn, resp = _open_stream(s.url, 400)
        assert resp.readline().startswith(b"data: ")
        status, headers, body = request(s.url, "POST", "/v1/completions",
                                        {"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert status == 429 and headers["retry-after"].isdigit()
        assert json.loads(body)["error"]["code"] == "too_many_requests"
        conn.close()
        wait_for(lambda: not s.engine.has_unfinished, "the stream aborted")
        assert request(s.url, "POST", "/v1/completions",
                       {"model": MODEL, "prompt": "x", "max_tokens": 1})[0] == 200
