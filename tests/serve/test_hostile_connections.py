"""Hostile connection behaviours, each on raw sockets against a real server on loopback.

Every case (``tests/serve/hostile_cases.py``) asserts what the server must answer; this
test adds what holds for all: no 5xx for what is the client's fault, an answer (or a
close) within a bounded time, no error or traceback in the server's log, nothing left in
the engine, and a good request served right after. The server runs with short limits
(1 s head and body timeouts) so the slow cases end quickly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

from moefleet.serve.connections import ConnectionLimits
from tests.serve.conftest import Server, running, tiny_engine
from tests.serve.hostile_cases import CASES, EXPECT_408
from tests.serve.hostile_helpers import Records, good_request_works, statuses

LIMITS = ConnectionLimits(head_timeout_s=1.0, max_head_bytes=8192, body_timeout_s=1.0,
                          keep_alive_s=2)
CASE_LIMIT_S = 15.0


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
