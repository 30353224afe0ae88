"""Memory and CPU limits of the ``local`` backend's function instances (emulated).

A local worker process hosts many instances, so the kernel cannot enforce one function's
``memory_mb`` or vCPU share. What the worker does instead, and why it is conservative:

- **memory**: a function instance is charged ``base + instance + transient`` bytes, where
  ``base`` is the worker's RSS once it is ready (interpreter + torch + handlers: the
  runtime footprint a process of its own would have), ``instance`` the RSS growth its
  cold start caused (weights, buffers) and ``transient`` the RSS peak (``VmHWM``, reset
  through ``/proc/self/clear_refs`` before each call) over the RSS at the call's start.
  Freed heap is handed back to the OS first (``malloc_trim``) so earlier calls' pages do
  not hide a call's growth. An instance charged more than its ``memory_mb`` fails the
  way an out-of-memory function fails on the platform: its invocation errors (type
  ``OutOfMemoryError``), its measured duration is kept, and the instance is dropped.
- **CPU**: a function whose vCPU share ``v`` is below one core runs on a whole thread, so
  its handler is stretched afterwards to ``cpu_s / v`` seconds of wall time (``cpu_s``:
  the worker's CPU time during the handler), what a CPU quota of ``v`` would allow. The
  caller waits the stretch out with the instance held and the worker's slot free (a
  platform runs each instance on a quota of its own, in parallel; a stretch slept in the
  worker would queue the other calls behind it on a machine with few workers).

Both are labelled "emulated" in :meth:`LocalBackend.stats`. Off with
``LocalBackend(limits=False)`` or ``MOEFLEET_LOCAL_LIMITS=off`` (tests of other things).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time

MB = 1 << 20
LIMITS_ENV = "MOEFLEET_LOCAL_LIMITS"
EMULATED_NOTE = ("emulated: memory charged as worker base RSS + instance RSS growth + call "
                 "peak (VmHWM); CPU below one vCPU stretched to cpu_s / vcpus")


def limits_default() -> bool:
    """On unless ``MOEFLEET_LOCAL_LIMITS`` is ``off``/``0``/``false``."""
    return os.environ.get(LIMITS_ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def _status(key: str) -> int:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_bytes() -> int:
    return _status("VmRSS")


def peak_bytes() -> int:
    return _status("VmHWM")


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0); a no-op where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc), so RSS growth is a call's own."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


class OutOfMemoryError(Exception):
    """An instance's charged memory exceeded its ``memory_mb`` (module doc)."""

    def __init__(self, function: str, used: int, memory_mb: int, phase: str) -> None:
        super().__init__(
            f"{function} used {used / MB:.0f} MB during {phase}, over its {memory_mb} MB "
            f"(emulated limit: runtime footprint + instance + call peak)")
        self.hint = (f"give {function} more memory (>= {-(-used // MB)} MB) or fewer tokens "
                     "per replica")


class CallGauge:
    """Gauges one call (or cold start) of one instance: its memory growth and CPU time,
    for the emulated limits (not a bill: billing is ``platform.billing.Meter``)."""

    def __init__(self) -> None:
        trim_heap()
        reset_peak()
        self.rss0 = rss_bytes()
        self.t0, self.cpu0 = time.time(), time.process_time()

    def growth(self) -> int:
        return max(0, peak_bytes() - self.rss0, rss_bytes() - self.rss0)

    def share_shortfall(self, vcpus: float) -> float:
        """Seconds the call must still last to have lasted ``cpu_s / vcpus`` (0 at a whole
        core or more). The worker does not sleep them: its caller waits them out with the
        instance held and the worker's slot free, as a platform runs every instance on a
        quota of its own, in parallel (``LocalBackend._attempt``)."""
        return share_shortfall(time.process_time() - self.cpu0, time.time() - self.t0,
                               vcpus)


def share_shortfall(cpu_s: float, wall_s: float, vcpus: float) -> float:
    """What work that took ``cpu_s`` of CPU in ``wall_s`` lacks of the ``cpu_s / vcpus`` a
    CPU quota of ``vcpus`` (< 1) gives it; 0 for a share of a whole core or more."""
    if vcpus >= 1.0 or vcpus <= 0:
        return 0.0
    return max(0.0, cpu_s / vcpus - wall_s)


def hold_to_share(cpu_s: float, wall_s: float, vcpus: float) -> float:
    """Sleep the :func:`share_shortfall` now; returns the seconds added."""
    extra = share_shortfall(cpu_s, wall_s, vcpus)
    if extra > 0:
        time.sleep(extra)
    return extra
