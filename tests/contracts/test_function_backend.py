"""Contract suite for ``FunctionBackend``: every backend must pass it unchanged.

To add a backend, add a factory to ``FACTORIES``: ``factory(platform, store_dir, **options)
-> FunctionBackend`` (options: ``max_retries``). Handlers used here are the package's own
``debug_handler``, so a remote backend (ray, aws) can import them too. Every test bounds
its waits; backends are torn down by the fixtures.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from moefleet.errors import MoefleetError
from moefleet.platform import Meter, PlatformSpec, load_platform
from moefleet.runtime import (
    BackendClosedError,
    FunctionBackend,
    FunctionCrashedError,
    FunctionSpec,
    HandlerError,
    HandlerRef,
    InvalidFunctionSpecError,
    InvocationTimeoutError,
    PayloadTooLargeError,
    UnknownFunctionError,
)
from moefleet.runtime.payload import pack, unpack

pytestmark = pytest.mark.timeout(120)

Factory = Callable[..., FunctionBackend]


def _local(platform: PlatformSpec, store_dir: Path, **options: Any) -> FunctionBackend:
    from moefleet.runtime.local import LocalBackend

    return LocalBackend(platform, store=str(store_dir), workers=2, retry_backoff_s=0.01,
                        **options)


def _aws(platform: PlatformSpec, store_dir: Path, **options: Any) -> FunctionBackend:
    # Lambda + S3 on a moto server (127.0.0.1) that the helper starts and the last
    # backend's teardown stops; invokes run the uploaded zip in emulated environments.
    from tests.aws_helpers import moto_aws_backend

    return moto_aws_backend(platform, retry_backoff_s=0.01, **options)


def _ray(platform: PlatformSpec, store_dir: Path, **options: Any) -> FunctionBackend:
    # One local Ray node (loopback) per module, started by the first backend and reused
    # by later ones; one Serve application per function. Not importorskip: ray must not
    # be imported before the backend starts its node (the binding is fixed at import).
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (pip install 'moefleet[ray]')")
    from moefleet.runtime.ray_backend import RayBackend

    return RayBackend(platform, store=str(store_dir), retry_backoff_s=0.01, **options)


FACTORIES: dict[str, Factory] = {"local": _local, "aws": _aws, "ray": _ray}
DEBUG = HandlerRef("moefleet.runtime.handlers:debug_handler")


@pytest.fixture(scope="module", params=sorted(FACTORIES))
def factory(request: pytest.FixtureRequest) -> Factory:
    return FACTORIES[request.param]


@pytest.fixture(scope="module")
def platform() -> PlatformSpec:
    return load_platform("aws-lambda")


@pytest.fixture(scope="module")
def backend(factory: Factory, platform: PlatformSpec,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[FunctionBackend]:
    b = factory(platform, tmp_path_factory.mktemp("store"))
    try:
        yield b
    finally:
        b.teardown()


def fn(backend: FunctionBackend, **kw: Any) -> str:
    """Deploy a debug function with a fresh name; returns the name."""
    name = f"dbg-{uuid.uuid4().hex[:8]}"
    backend.deploy(FunctionSpec(name=name, kind=kw.pop("kind", "aux"),
                                handler=kw.pop("handler", DEBUG),
                                memory_mb=kw.pop("memory_mb", 256), **kw))
    return name


def call(backend: FunctionBackend, name: str, **meta: Any):
    return backend.invoke(name, pack(meta=meta))


def test_deploy_validates_and_fills_vcpus(backend: FunctionBackend, platform: PlatformSpec):
    name = fn(backend, memory_mb=1769)
    spec = backend.spec(name)
    assert spec.vcpus == pytest.approx(platform.vcpus(1769))
    assert name in backend.functions()


@pytest.mark.parametrize("field,value,needle", [
    ("memory_mb", 100, "100 MB"),
    ("replicas", 5000, "replicas=5000"),
    ("concurrency", 2, "concurrency=2"),
    ("timeout_s", 1000.0, "timeout_s=1000"),
])
def test_deploy_rejects_what_the_platform_cannot_run(
        backend: FunctionBackend, field: str, value: Any, needle: str) -> None:
    kw: dict[str, Any] = {"memory_mb": 256, field: value}
    with pytest.raises(InvalidFunctionSpecError, match=needle) as info:
        backend.deploy(FunctionSpec("bad-fn", "aux", DEBUG, **kw))
    assert "bad-fn" in info.value.message and info.value.hint


def test_cold_then_warm_records(backend: FunctionBackend, platform: PlatformSpec) -> None:
    name = fn(backend, memory_mb=512, layer=3, experts=(5,), kind="expert")
    payload = pack(meta={"op": "echo"})
    first = backend.invoke(name, payload, request_id="r1")
    second = backend.invoke(name, payload)
    assert first.payload == payload and second.payload == payload
    a, b = first.record, second.record
    assert a.cold and a.init_s >= 0 and not b.cold and b.init_s == 0
    assert (a.function, a.kind, a.memory_mb, a.layer, a.expert) == (name, "expert", 512, 3, 5)
    assert a.request_id == "r1" and b.request_id is None
    assert a.bytes_in == len(payload) and a.bytes_out == len(payload)
    assert a.end_s >= a.start_s and b.start_s >= a.end_s
    mine = [r for r in backend.records() if r.function == name]
    assert mine == [a, b]
    bill = Meter(platform, mine).bill()
    assert bill.invocations == 2 and bill.cold_starts == 1 and bill.total.total > 0


def test_unknown_function(backend: FunctionBackend) -> None:
    with pytest.raises(UnknownFunctionError, match="nope"):
        backend.invoke("nope", pack())
    with pytest.raises(MoefleetError):
        backend.scale("nope", replicas=2)


def test_payload_limit_both_ways(backend: FunctionBackend, platform: PlatformSpec) -> None:
    assert platform.limits is not None
    limit = platform.limits.sync_payload_bytes
    name = fn(backend)
    before = len(backend.records())
    with pytest.raises(PayloadTooLargeError, match="request payload"):
        backend.invoke(name, b"x" * (limit + 1))
    with pytest.raises(PayloadTooLargeError, match="response payload"):
        call(backend, name, op="big", nbytes=limit + 1)
    assert len(backend.records()) == before  # nothing billed as a success


def _overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    live = peak = 0
    for _, step in events:
        live += step
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("replicas", [1, 2])
def test_concurrency_limit_respected(backend: FunctionBackend, replicas: int) -> None:
    name = fn(backend, replicas=replicas)
    errors: list[BaseException] = []

    def one() -> None:
        try:
            call(backend, name, op="sleep", seconds=0.15)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    recs = [r for r in backend.records() if r.function == name]
    assert len(recs) == 4
    assert _overlap([(r.start_s, r.end_s) for r in recs]) <= replicas
    assert sum(r.cold for r in recs) <= replicas


def test_scale(backend: FunctionBackend) -> None:
    name = fn(backend)
    assert backend.scale(name, replicas=3).replicas == 3
    assert backend.spec(name).replicas == 3
    with pytest.raises(InvalidFunctionSpecError):
        backend.scale(name, replicas=0)
    assert backend.spec(name).replicas == 3


def test_storage_requests_are_counted(backend: FunctionBackend) -> None:
    name = fn(backend)
    rec = call(backend, name, op="store", puts=2).record
    assert (rec.storage_puts, rec.storage_gets) == (2, 2)


def test_crash_is_retried_once_then_succeeds(backend: FunctionBackend, tmp_path: Path) -> None:
    name = fn(backend)
    res = call(backend, name, op="crash_once", flag=str(tmp_path / "flag"))
    assert unpack(res.payload).meta["op"] == "crash_once"
    assert (tmp_path / "flag").exists()
    mine = [r for r in backend.records() if r.function == name]
    assert [r.failed for r in mine].count(False) == 1  # one successful invocation
    assert [r.failed for r in mine].count(True) == 1  # the crashed attempt is billed too


def test_a_process_killed_mid_invocation_is_retried_and_billed(
        backend: FunctionBackend) -> None:
    """The fault harness's crash: SIGKILL the process running a call (found through
    ``worker_pids``); the call is retried and the crashed attempt billed."""
    if backend.name == "ray":  # it names its own live replicas, as seen in replies
        pid = unpack(call(backend, fn(backend), op="pid").payload).meta["pid"]
        assert pid in backend.worker_pids()  # type: ignore[attr-defined]
    if backend.name != "aws":  # local/ray: worker_pids are every live worker/replica,
        pytest.skip("only aws names the processes running a call (crash_once covers it)")
    name = fn(backend, timeout_s=30)
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(res=call(backend, name, op="sleep",
                                                                 seconds=2.0)))
    thread.start()
    deadline = time.monotonic() + 120
    while not (busy := backend.worker_pids()):  # type: ignore[attr-defined]
        assert time.monotonic() < deadline and thread.is_alive(), "the call never started"
        time.sleep(0.02)
    os.kill(busy[0], signal.SIGKILL)  # the environment serving our call (ours, by pid)
    thread.join(120)
    assert unpack(out["res"].payload).meta["op"] == "sleep"  # retried, answered
    failed = [r for r in backend.records() if r.function == name and r.failed]
    assert len(failed) == 1 and failed[0].end_s > failed[0].start_s


def test_crash_every_time_gives_a_clear_error(backend: FunctionBackend) -> None:
    name = fn(backend)
    with pytest.raises(FunctionCrashedError, match=name):
        call(backend, name, op="crash")
    assert call(backend, fn(backend), op="pid").record  # the backend still works


def test_timeout(backend: FunctionBackend) -> None:
    name = fn(backend, timeout_s=0.3)
    with pytest.raises(InvocationTimeoutError, match=f"{name}.*timeout_s=0.3"):
        call(backend, name, op="sleep", seconds=20)
    # billed for the whole timeout, as Lambda bills it; aws: Lambda's Timeout is whole
    # seconds, so 0.3 s runs (and bills) 1 s
    [rec] = [r for r in backend.records() if r.function == name and r.failed]
    assert rec.end_s - rec.start_s == pytest.approx(1.0 if backend.name == "aws" else 0.3)
    assert call(backend, name, op="pid").record.cold  # its instance was stopped


def test_handler_errors_are_not_retried(backend: FunctionBackend) -> None:
    name = fn(backend)
    with pytest.raises(HandlerError, match="asked to fail") as info:
        call(backend, name, op="fail")
    assert info.value.remote_type == "ValueError" and info.value.phase == "run"
    broken = fn(backend, handler=HandlerRef(DEBUG.factory, {"init_fail": True}))
    with pytest.raises(HandlerError, match="init_fail") as info:
        call(backend, broken, op="pid")
    assert info.value.phase == "init"
    missing = fn(backend, handler=HandlerRef("moefleet.nowhere:handler"))
    with pytest.raises(HandlerError, match=r"cannot import 'moefleet\.nowhere:handler'"):
        call(backend, missing, op="pid")


def test_keep_alive_expiry_means_cold_again(backend: FunctionBackend) -> None:
    import time

    name = fn(backend, keep_alive_s=0.2)
    assert call(backend, name, op="pid").record.cold
    time.sleep(0.6)
    assert call(backend, name, op="pid").record.cold


def test_redeploy_is_a_new_version(backend: FunctionBackend) -> None:
    name = fn(backend)
    call(backend, name, op="pid")
    backend.deploy(FunctionSpec(name, "aux", DEBUG, memory_mb=512))
    rec = call(backend, name, op="pid").record
    assert rec.cold and rec.memory_mb == 512


# Nested calls come before test_reconfigure: its last step scales a function to the
# platform's replica limit, which on ray holds every logical CPU of the local node for the
# rest of the module, so functions deployed after it may never get a replica.
def test_functions_invoke_functions_metered(backend: FunctionBackend) -> None:
    """A main function calls an expert function through ``ctx.functions``; every nested
    call is a record of the backend like a top-level one. Minimum slots everywhere (one
    instance, concurrency 1, four concurrent nested calls): the main waiting on its expert
    must not hold the slot the expert needs."""
    inner = fn(backend, kind="expert", layer=0, experts=(1,))
    outer = fn(backend, kind="main")
    result = call(backend, outer, op="nested", target=inner, calls=4, inner={"op": "pid"})
    meta = unpack(result.payload).meta
    recs = [r for r in backend.records() if r.function == inner]
    seen = f"nested: {meta}; records: {recs}"
    assert meta["functions"] == [inner] * 4 and sum(meta["cold"]) == 1, seen
    assert len(set(meta["pids"])) == 1, seen  # one instance served all four, in turn
    assert len(recs) == 4 and all(r.kind == "expert" for r in recs), seen
    main = result.record
    assert main.kind == "main"
    # every nested call ran inside the main's handler time (50 ms: clocks of processes)
    assert all(main.start_s - 0.05 <= r.start_s and r.end_s <= main.end_s + 0.05
               for r in recs), f"main {main}; {seen}"
    assert _overlap([(r.start_s, r.end_s) for r in recs]) == 1, seen


def test_nested_errors_reach_the_caller_typed(backend: FunctionBackend) -> None:
    outer = fn(backend, kind="main")
    with pytest.raises(HandlerError, match=r"UnknownFunctionError.*no-such-fn"):
        call(backend, outer, op="nested", target="no-such-fn", calls=1)
    failing = fn(backend)
    with pytest.raises(HandlerError, match="asked to fail") as info:
        call(backend, outer, op="nested", target=failing, inner={"op": "fail"})
    assert info.value.remote_type == "HandlerError"


def test_teardown_is_idempotent_and_final(factory: Factory, platform: PlatformSpec,
                                          tmp_path: Path) -> None:
    b = factory(platform, tmp_path)
    try:
        name = fn(b)
        call(b, name, op="pid")
    finally:
        b.teardown()
    b.teardown()
    with pytest.raises(BackendClosedError):
        call(b, name, op="pid")
    with pytest.raises(BackendClosedError):
        b.deploy(FunctionSpec("late", "aux", DEBUG, memory_mb=256))


def test_reconfigure_scales_warm_and_resizes_cold(backend: FunctionBackend,
                                                  platform: PlatformSpec,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    from moefleet.control import FunctionConfig

    name = fn(backend)
    assert call(backend, name, op="pid").record.cold
    spec = backend.reconfigure(name, FunctionConfig(256, replicas=2, concurrency=1))
    assert (spec.replicas, spec.memory_mb) == (2, 256)
    assert not call(backend, name, op="pid").record.cold  # scaling keeps warm instances
    spec = backend.reconfigure(name, FunctionConfig(512, replicas=2, concurrency=1))
    rec = call(backend, name, op="pid").record
    assert rec.cold and rec.memory_mb == 512 and spec.memory_mb == 512
    # A GPU share this CPU-only platform does not offer: clamped to 0 and logged.
    with caplog.at_level("WARNING", logger="moefleet.runtime.base"):
        spec = backend.reconfigure(name, FunctionConfig(512, 2, 1, gpu_share=0.5))
    assert spec.gpu_share == 0.0 and "GPU share 0" in caplog.text
    rec = call(backend, name, op="pid").record
    assert not rec.cold and rec.gpu_share == 0.0  # nothing was redeployed
    caplog.clear()
    # Outside the platform's limits: clamped and logged, never applied raw.
    limits = platform.limits
    assert limits is not None
    with caplog.at_level("WARNING", logger="moefleet.runtime.base"):
        spec = backend.reconfigure(name, FunctionConfig(
            512, replicas=limits.max_replicas + 5,
            concurrency=limits.max_concurrency_per_instance + 3))
    assert spec.replicas == limits.max_replicas
    assert spec.concurrency == limits.max_concurrency_per_instance
    assert "clamped" in caplog.text
