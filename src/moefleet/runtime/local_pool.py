"""Worker processes of the ``local`` backend (parent side): start, receive, respawn, stop.

Each worker has one duplex pipe and one receiver thread. In-flight calls live in the
worker's ``outstanding`` map until their reply arrives; when the process dies (crash, or
killed by pid for a timeout) every outstanding call is marked ``lost`` (the backend retries
it) or ``timed_out``, the backend forgets the instances the worker hosted, and a fresh
worker takes the slot (a forkserver child starts in ~40 ms once the server has imported
torch). All shared state is guarded by the backend's condition variable ``cond``.

Workers fork from a forkserver that preloads torch and transformers (never from the
caller, whose torch threads make ``fork`` unsafe); ``spawn`` is the fallback where
forkserver does not exist. Both re-import the caller's ``__main__``: scripts need the usual
``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moefleet.runtime.errors import BackendClosedError
from moefleet.runtime.local_worker import recv_msg, send_msg, worker_main

if TYPE_CHECKING:
    from moefleet.runtime.base import FunctionSpec

WORKER_BUDGET_MB = 512  # per-worker memory planned for when sizing the pool (PSS + weights)
# Imported once by the forkserver, shared by every worker (copy-on-write), so a cold start
# measures instance construction and weight loading, not Python imports.
PRELOAD = [
    "moefleet.runtime.local_worker",
    "moefleet.runtime.handlers",
    "moefleet.models.hf",
    *(f"transformers.models.{f}.modeling_{f}" for f in ("mixtral", "qwen2_moe", "olmoe",
                                                        "deepseek_v2")),
]


@dataclass(eq=False)
class Call:
    """One in-flight invocation; ``deadline`` is on the ``time.monotonic`` clock."""

    id: int
    deadline: float
    timeout_s: float
    done: threading.Event = field(default_factory=threading.Event)
    reply: dict[str, Any] | None = None
    body: bytes = b""
    lost: bool = False
    timed_out: bool = False


@dataclass(eq=False)
class Worker:
    slot: int
    process: Any
    conn: Any
    pid: int
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    outstanding: dict[int, Call] = field(default_factory=dict)
    hosted: set[str] = field(default_factory=set)
    pending_unload: list[str] = field(default_factory=list)
    alive: bool = True


def _memory_workers() -> int | None:
    """Workers that fit the available memory at ``WORKER_BUDGET_MB`` each (None: unknown)."""
    try:
        with open("/proc/meminfo") as fh:
            avail = next(int(line.split()[1]) // 1024 for line in fh
                         if line.startswith("MemAvailable"))
        return max(1, (avail - 1024) // WORKER_BUDGET_MB)
    except (OSError, StopIteration, ValueError):
        return None


def default_workers() -> int:
    """Cores, capped so every worker has ``WORKER_BUDGET_MB`` of available memory."""
    cores = os.cpu_count() or 1
    fit = _memory_workers()
    return cores if fit is None else min(cores, fit)


def checked_workers(workers: int | None) -> int:
    """``workers`` if that many worker processes fit the available memory (each one
    imports torch and holds its functions' weights, so 64 of them need gigabytes);
    None: :func:`default_workers`."""
    from moefleet.errors import LimitError

    if not workers:
        return default_workers()
    fit = _memory_workers()
    if fit is not None and workers > fit:
        raise LimitError(f"{workers} local workers need about {workers * WORKER_BUDGET_MB} "
                         f"MB; this machine has memory for {fit}",
                         f"use --workers {fit} or fewer (or leave it out)")
    return workers


def process_memory_mb(pid: int) -> dict[str, float]:
    """RSS and PSS (shared pages split between sharers) of a process in MB (Linux only)."""
    out: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Pss"):
                    out[key.lower() + "_mb"] = int(rest.split()[0]) / 1024
    except OSError:
        pass
    return out


def _kill_all(processes: dict[int, Any]) -> None:
    for proc in list(processes.values()):
        if proc.is_alive() and proc.pid:
            os.kill(proc.pid, signal.SIGKILL)


class WorkerPool:
    """``size`` worker slots. ``on_lost(slot)`` is called (under ``cond``) when a worker
    dies, before its replacement starts."""

    def __init__(self, size: int, *, config: dict[str, Any], cond: threading.Condition,
                 on_lost: Callable[[int], None], start_method: str = "forkserver",
                 startup_timeout_s: float = 180.0,
                 on_nested: Callable[[Worker, dict[str, Any], bytes], None] | None = None,
                 name: str = "worker") -> None:
        if size < 1:
            raise ValueError(f"workers must be >= 1, got {size}")
        if start_method not in mp.get_all_start_methods():
            start_method = "spawn"
        self._ctx: Any = mp.get_context(start_method)
        if start_method == "forkserver":
            self._ctx.set_forkserver_preload(PRELOAD)
        self._config, self._cond, self._on_lost = config, cond, on_lost
        self._on_nested, self._name = on_nested, name
        self._startup_timeout_s = startup_timeout_s
        self.closed = False
        self.respawns = 0
        self._procs: dict[int, Any] = {}
        self._finalizer = weakref.finalize(self, _kill_all, self._procs)
        self.workers: list[Worker | None] = [None] * size
        try:
            for w in self._start(list(range(size))):
                self._install(w)
        except BaseException:
            self.stop()
            raise

    def live(self) -> list[Worker]:
        return [w for w in self.workers if w is not None and w.alive]

    def _start(self, slots: list[int]) -> list[Worker]:
        started = []
        for slot in slots:
            parent, child = self._ctx.Pipe(duplex=True)
            proc = self._ctx.Process(target=worker_main, args=(child, slot), daemon=True,
                                     name=f"moefleet-{self._name}-{slot}")
            proc.start()
            child.close()
            self._procs[slot] = proc
            send_msg(parent, {**self._config, "env": dict(os.environ),
                              "sys_path": list(sys.path)})
            started.append((slot, proc, parent))
        workers = []
        for slot, proc, parent in started:
            try:
                if not parent.poll(self._startup_timeout_s):
                    raise TimeoutError(f"no answer within {self._startup_timeout_s:g} s")
                header, _ = recv_msg(parent)
            except (EOFError, OSError, TimeoutError, ValueError) as err:
                proc.join(timeout=1)
                raise BackendClosedError(
                    f"local worker {slot} (pid {proc.pid}) failed to start: {err!r} "
                    f"(exit code {proc.exitcode})",
                    "a script that starts the local backend must guard its top level with "
                    "`if __name__ == '__main__':` (workers re-import the main module)",
                ) from None
            workers.append(Worker(slot, proc, parent, int(header["pid"])))
        return workers

    def _install(self, w: Worker) -> None:
        self.workers[w.slot] = w
        threading.Thread(target=self._receive, args=(w,), daemon=True,
                         name=f"moefleet-recv-{w.slot}").start()

    def _receive(self, w: Worker) -> None:
        while True:
            try:
                header, body = recv_msg(w.conn)
            except (EOFError, OSError):
                break
            if header.get("op") == "nested":  # the handler calls another function
                if self._on_nested is not None:
                    self._on_nested(w, header, body)
                continue
            with self._cond:
                if header.get("op") == "started":  # cold start done: the timeout starts now
                    started = w.outstanding.get(int(header["call"]))
                    if started is not None:
                        started.deadline = time.monotonic() + started.timeout_s
                    continue
                call = w.outstanding.pop(int(header["call"]), None)
            if call is not None:
                call.reply, call.body = header, body
                call.done.set()
        self._on_exit(w)

    def _on_exit(self, w: Worker) -> None:
        with self._cond:
            w.alive = False
            for call in w.outstanding.values():
                call.lost = True
                call.done.set()
            w.outstanding.clear()
            self._on_lost(w.slot)
            self._cond.notify_all()
            closing = self.closed
        w.process.join(timeout=2)
        w.conn.close()
        if closing:
            return
        try:  # replace the dead worker so the pool keeps its size
            (fresh,) = self._start([w.slot])
        except Exception:
            return  # the slot stays empty; admission uses the remaining workers
        with self._cond:
            if self.closed:
                fresh.process.kill()
                return
            self.respawns += 1
            self._install(fresh)
            self._cond.notify_all()

    def enforce_deadlines(self, now: float) -> int:
        """Kill (by pid) every worker with a call past its deadline; call under ``cond``."""
        killed = 0
        for w in self.live():
            if any(c.deadline < now for c in w.outstanding.values()):
                for c in w.outstanding.values():
                    c.timed_out = c.deadline < now
                os.kill(w.pid, signal.SIGKILL)  # our own worker
                killed += 1
        return killed

    def flush_unloads(self) -> None:
        """Send pending unloads to idle workers; never blocks (a busy worker gets them
        with its next call), so a large payload being written cannot stall this."""
        with self._cond:
            idle = [w for w in self.live() if w.pending_unload and not w.outstanding]
        for w in idle:
            if not w.send_lock.acquire(blocking=False):
                continue
            try:
                with self._cond:
                    ids, w.pending_unload = w.pending_unload, []
                send_msg(w.conn, {"op": "unload", "unload": ids})
            except OSError:
                pass
            finally:
                w.send_lock.release()

    def stop(self) -> None:
        """Ask every worker to exit, then kill (by pid) any still alive after 5 s."""
        with self._cond:
            self.closed = True
            workers = self.live()
        for w in workers:
            if w.send_lock.acquire(timeout=0.5):
                try:
                    send_msg(w.conn, {"op": "stop"})
                except OSError:
                    pass
                finally:
                    w.send_lock.release()
        deadline = time.monotonic() + 5.0
        for proc in list(self._procs.values()):
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive() and proc.pid:
                os.kill(proc.pid, signal.SIGKILL)  # only our own workers, by pid
                proc.join(timeout=2)
        self._finalizer.detach()


def store_config(store: Any, latency: tuple[float, float] | None,
                 wrap: tuple[str, dict[str, Any]] | None) -> dict[str, Any] | None:
    """The workers' store settings: ``store`` (a path, URL or ObjectStore with a ``url``),
    with an emulated ``latency`` (seconds, bytes/s) and a ``wrap`` ("module:factory",
    options; fault injection); None: the workers have no store."""
    if store is None:
        return None
    cfg: dict[str, Any] = {"url": str(store if isinstance(store, str) else store.url)}
    if latency is not None:
        cfg.update(latency_s=latency[0], bandwidth_bytes_per_s=latency[1])
    if wrap is not None:
        cfg.update(wrap=wrap[0], wrap_options=wrap[1])
    return cfg


# -- the backend's bookkeeping of functions and their instances ----------------------
class LostWorker(Exception):
    """The worker died under an in-flight call (retryable)."""


@dataclass(eq=False)
class HostedInstance:
    """One instance of a function, hosted by worker ``slot`` of pool ``pool``."""

    id: str
    function: str
    slot: int
    pool: str = "fn"  # "fn" (every kind but main) or "main"
    in_flight: int = 0
    loaded: bool = False
    last_used: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class DeployedFunction:
    """A deployed function and its instances (the backend's bookkeeping)."""

    spec: FunctionSpec
    instances: list[HostedInstance] = field(default_factory=list)
