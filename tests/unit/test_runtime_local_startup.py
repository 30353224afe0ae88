"""The platform's startup emulated on the local backend (runtime/local_startup.py): every
call waits the platform's warm start, a cold one its cold start too, billed as INIT; the
instance stays held through the wait."""

from __future__ import annotations

import threading
import time

import pytest

from moefleet.platform import load_platform
from moefleet.platform.spec_blocks import Startup
from moefleet.runtime import FunctionSpec, HandlerRef
from moefleet.runtime.local import LocalBackend
from moefleet.runtime.local_startup import StartupEmulation
from moefleet.runtime.payload import pack

pytestmark = pytest.mark.timeout(180)
DEBUG = HandlerRef("moefleet.runtime.handlers:debug_handler")
COLD, WARM = 1.0, 0.1


@pytest.fixture(scope="module")
def backend() -> LocalBackend:
    spec = load_platform("aws-lambda").model_copy(
        update={"startup": Startup(cold_start_s=COLD, warm_start_s=WARM)})
    b = LocalBackend(spec, workers=1, limits=False, startup="platform")
    yield b
    b.teardown()


def _timed(backend: LocalBackend, name: str) -> tuple[float, object]:
    t0 = time.perf_counter()
    res = backend.invoke(name, pack(meta={"op": "pid"}))
    return time.perf_counter() - t0, res.record


def test_cold_and_warm_calls_wait_the_platforms_startup(backend: LocalBackend) -> None:
    backend.deploy(FunctionSpec("f", "aux", DEBUG, memory_mb=1024))
    cold_s, cold = _timed(backend, "f")
    warm_s, warm = _timed(backend, "f")
    assert cold.cold and cold.init_s >= COLD  # type: ignore[attr-defined]
    assert cold_s >= COLD + WARM
    assert not warm.cold and warm.init_s == 0.0  # type: ignore[attr-defined]
    assert WARM <= warm_s < COLD
    assert "emulated" in backend.stats()["startup"]


def test_an_instance_is_held_through_its_emulated_wait(backend: LocalBackend) -> None:
    """A second call while the first waits out its cold start gets an instance of its own
    (as on the platform, where the first environment is still starting)."""
    backend.deploy(FunctionSpec("g", "aux", DEBUG, memory_mb=1024, replicas=2))
    first = threading.Thread(target=_timed, args=(backend, "g"))
    first.start()
    time.sleep(COLD / 2)  # the worker answered long ago; the caller still waits
    _, second = _timed(backend, "g")
    first.join()
    assert second.cold  # type: ignore[attr-defined]


def test_startup_modes() -> None:
    spec = load_platform("aws-lambda")
    assert StartupEmulation.of(spec, "measured") is None
    emu = StartupEmulation.of(spec, "platform")
    assert emu is not None and emu.cold_s == spec.startup.cold_start_s  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="startup must be one of"):
        StartupEmulation.of(spec, "fast")
