"""Local-backend specifics: external kills, throttling, pool facts, clean teardown."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from moefleet.runtime import FunctionSpec, HandlerRef, ThrottledError
from moefleet.runtime.local import LocalBackend
from moefleet.runtime.local_pool import default_workers
from moefleet.runtime.payload import pack, unpack

pytestmark = pytest.mark.timeout(120)
DEBUG = HandlerRef("moefleet.runtime.handlers:debug_handler")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); read its state.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_killing_the_worker_mid_call_retries_on_a_fresh_one() -> None:
    b = LocalBackend("aws-lambda", workers=1, retry_backoff_s=0.01)
    try:
        b.deploy(FunctionSpec("slow", "aux", DEBUG, memory_mb=256))
        (pid,) = b.worker_pids()
        out: list[bytes] = []
        t = threading.Thread(target=lambda: out.append(
            b.invoke("slow", pack(meta={"op": "sleep", "seconds": 0.5})).payload))
        t.start()
        deadline = time.monotonic() + 10
        while b.stats()["instances"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # the call is inside the handler now
        os.kill(pid, 9)
        t.join(timeout=30)
        assert out and unpack(out[0]).meta["op"] == "sleep"
        stats = b.stats()
        assert stats["retries"] == 1 and stats["respawns"] == 1
        assert b.worker_pids() != [pid]
        assert sum(r.cold for r in b.records()) == 1  # the lost attempt is not billed
    finally:
        b.teardown()


def test_admission_waits_are_bounded() -> None:
    b = LocalBackend("aws-lambda", workers=1, admission_timeout_s=0.2)
    try:
        b.deploy(FunctionSpec("busy", "aux", DEBUG, memory_mb=256))
        t = threading.Thread(target=lambda: b.invoke(
            "busy", pack(meta={"op": "sleep", "seconds": 1.0})))
        t.start()
        time.sleep(0.2)
        with pytest.raises(ThrottledError, match="busy: no instance slot free"):
            b.invoke("busy", pack(meta={"op": "pid"}))
        t.join(timeout=30)
    finally:
        b.teardown()


def test_pool_facts_and_teardown_stops_every_worker() -> None:
    assert default_workers() >= 1
    b = LocalBackend("aws-lambda", workers=2)
    pids = b.worker_pids()
    stats = b.stats()
    assert len(pids) == 2 and all(w.get("rss_mb", 1) > 0 for w in stats["workers"])
    b.teardown()
    assert not any(_alive(pid) for pid in pids)
