"""The local backend's emulated function limits: memory charged and enforced, sub-core
vCPU shares stretched (runtime/local_limits.py)."""

from __future__ import annotations

import pytest

from moefleet.platform import load_platform
from moefleet.runtime import FunctionSpec, HandlerRef
from moefleet.runtime.errors import HandlerError
from moefleet.runtime.local import LocalBackend
from moefleet.runtime.payload import pack, unpack

pytestmark = pytest.mark.timeout(180)
DEBUG = HandlerRef("moefleet.runtime.handlers:debug_handler")
MB = 1 << 20


@pytest.fixture(scope="module")
def backend() -> LocalBackend:
    b = LocalBackend("aws-lambda", workers=1, limits=True)
    yield b
    b.teardown()


def test_a_function_below_the_runtime_footprint_cannot_start(backend: LocalBackend) -> None:
    backend.deploy(FunctionSpec("tiny", "aux", DEBUG, memory_mb=128))
    with pytest.raises(HandlerError) as err:
        backend.invoke("tiny", pack(meta={"op": "pid"}))
    assert err.value.remote_type == "OutOfMemoryError" and err.value.phase == "init"
    assert "128 MB" in err.value.message
    assert backend.stats()["out_of_memory"] >= 1


def test_an_emulated_device_runtime_is_charged_at_cold_start(backend: LocalBackend) -> None:
    """A handler whose device is emulated declares that device's host runtime (a GPU
    main's CUDA runtime): the limit charges it, so what would not start there fails here."""
    plain = HandlerRef(DEBUG.factory, {"emulated_host_mb": 0})
    gpu = HandlerRef(DEBUG.factory, {"emulated_host_mb": 1024})
    backend.deploy(FunctionSpec("plain", "aux", plain, memory_mb=1024))
    backend.deploy(FunctionSpec("gpu", "aux", gpu, memory_mb=1024))
    assert unpack(backend.invoke("plain", pack(meta={"op": "pid"})).payload).meta["pid"]
    with pytest.raises(HandlerError) as err:  # footprint + 1024 MB > 1024 MB
        backend.invoke("gpu", pack(meta={"op": "pid"}))
    assert err.value.remote_type == "OutOfMemoryError" and err.value.phase == "init"


def test_a_call_over_its_memory_fails_and_the_next_one_runs(backend: LocalBackend) -> None:
    backend.deploy(FunctionSpec("mem", "aux", DEBUG, memory_mb=1024))
    ok = backend.invoke("mem", pack(meta={"op": "alloc", "nbytes": 16 * MB}))
    assert unpack(ok.payload).meta["op"] == "alloc"
    before = backend.stats()["out_of_memory"]
    with pytest.raises(HandlerError) as err:  # ~290 MB footprint + 800 MB > 1024 MB
        backend.invoke("mem", pack(meta={"op": "alloc", "nbytes": 800 * MB}))
    assert err.value.remote_type == "OutOfMemoryError" and err.value.phase == "run"
    assert backend.stats()["out_of_memory"] == before + 1
    again = backend.invoke("mem", pack(meta={"op": "alloc", "nbytes": 16 * MB}))
    assert again.record.cold  # the instance that ran out of memory was dropped
    assert "emulated" in backend.stats()["limits"]


def test_a_sub_core_share_is_stretched_to_its_cpu_quota(backend: LocalBackend) -> None:
    vcpus = load_platform("aws-lambda").vcpus(512)
    assert vcpus < 0.5
    backend.deploy(FunctionSpec("cpu", "aux", DEBUG, memory_mb=512))
    backend.invoke("cpu", pack(meta={"op": "pid"}))  # cold start out of the way
    stretched = backend.stats()["cpu_stretch_s"]
    rec = backend.invoke("cpu", pack(meta={"op": "spin", "seconds": 0.1})).record
    # 0.1 CPU-seconds on a share of `vcpus` cores take at least 0.1 / vcpus seconds.
    assert rec.end_s - rec.start_s >= 0.1 / vcpus * 0.99
    # Stretched only by what the call lacked: on a machine so loaded that the spin alone
    # took 0.1 / vcpus seconds of wall time, nothing is added.
    assert backend.stats()["cpu_stretch_s"] >= stretched


def test_a_stretch_is_waited_by_the_caller_not_the_worker(backend: LocalBackend) -> None:
    """Two functions at a sub-core share on ONE worker, called at once: each call's
    stretch is waited by its caller with the worker free, so the second call's CPU work
    runs during the first one's stretch (a platform runs every instance on a quota of its
    own, in parallel). Slept in the worker, the two would take 2 x 0.08 / vcpus."""
    import threading
    import time

    vcpus = load_platform("aws-lambda").vcpus(512)
    for name in ("par-a", "par-b"):
        backend.deploy(FunctionSpec(name, "aux", DEBUG, memory_mb=512))
        backend.invoke(name, pack(meta={"op": "pid"}))  # cold starts out of the way
    one = 0.08 / vcpus
    records = {}

    def call(name: str) -> None:
        records[name] = backend.invoke(name, pack(meta={"op": "spin", "seconds": 0.08})).record

    t0 = time.perf_counter()
    threads = [threading.Thread(target=call, args=(n,)) for n in ("par-a", "par-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    assert all(r.end_s - r.start_s >= one * 0.99 for r in records.values())  # both billed
    assert wall < 1.6 * one, (wall, one)  # overlapped: about one stretch, not two


def test_limits_off_gives_a_whole_core() -> None:
    b = LocalBackend("aws-lambda", workers=1, limits=False)
    try:
        b.deploy(FunctionSpec("cpu", "aux", DEBUG, memory_mb=128))
        b.invoke("cpu", pack(meta={"op": "pid"}))
        assert b.stats()["limits"] == "off" and b.stats()["out_of_memory"] == 0
    finally:
        b.teardown()
