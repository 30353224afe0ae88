"""The ``local`` backend: function instances in a bounded pool of worker processes.

What is **real**: every invocation runs its handler in another process (a forkserver child:
torch is fork-fragile, so workers fork from a clean, pre-imported server, never from the
caller); payloads cross a pipe as bytes (safetensors, no pickle); a cold start really
builds the instance and loads its weights from the object store (measured → ``init_s``);
crashes, timeouts (the worker is killed) and retries are real; object-store requests are
counted per invocation; per-function replicas (instance cap) and per-instance concurrency
are enforced; idle instances are unloaded after ``keep_alive_s``.

What is **emulated** (one machine standing in for a FaaS fleet):
- a worker is one CPU slot of the node; it runs one invocation at a time and hosts many
  instances (their weights stay in its memory), so a warm instance whose worker is busy
  with another function waits, where a real platform would run it on its own vCPUs;
- memory_mb → vCPUs by the platform's rule → ``torch`` threads = round(vCPUs), at least
  1 and at most the machine's cores; a share below one vCPU runs on one thread and is
  stretched to cpu_s / vCPUs; memory_mb is enforced by charging each instance runtime
  footprint + its RSS growth + each call's peak (:mod:`moefleet.runtime.local_limits`;
  ``limits=False`` turns both off), plus, for a GPU share (run on the CPU, no speed-up),
  what CUDA adds to a process's host memory (``GPU_EMULATED_HOST_MB``, measured);
- process start and ``import torch`` are paid once per worker (forkserver preload), not
  per instance: ``init_s`` is instance construction + weight download + load only;
- main functions (kind ``main``, calling others through ``ctx.functions``) run on their
  own ``main_workers`` workers: a main waiting on its experts never holds their slots;
- the store is whatever ``store`` names (a local directory by default: far faster than S3;
  ``store_latency=(latency_s, bytes_per_s)`` emulates the platform's storage);
- ``wire="base64"``: the aws backend's inline budget (base64 in a JSON event), so tensors
  spill to the store where they would on Lambda. Memory: README, "Running a deployment".
``dispatch_hook(function, worker_pid)`` runs just before an attempt is sent (fault injection
kills exactly that worker); a lost attempt is billed until the loss, ``stats()["lost"]``.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from moefleet.platform import InvocationRecord, ObjectStore, PlatformSpec, load_platform
from moefleet.platform.inline import base64_inline_bytes
from moefleet.profiles.gpu import GPU_EMULATED_HOST_MB
from moefleet.runtime.base import (
    FunctionBackend,
    FunctionSpec,
    InvokeResult,
    check_payload,
    payload_limit,
    validate_spec,
)
from moefleet.runtime.errors import (
    BackendClosedError,
    InvalidFunctionSpecError,
)
from moefleet.runtime.local_admit import InstanceBook
from moefleet.runtime.local_limits import EMULATED_NOTE, limits_default
from moefleet.runtime.local_pool import (
    Call,
    DeployedFunction,
    LostWorker,
    Worker,
    WorkerPool,
    checked_workers,
    process_memory_mb,
    store_config,
)
from moefleet.runtime.local_startup import StartupEmulation
from moefleet.runtime.local_worker import send_msg
from moefleet.runtime.nested import serve_in_thread
from moefleet.runtime.replies import (
    crashed_error,
    failed_record,
    reply_handler_error,
    reply_record,
    timeout_error,
)
from moefleet.runtime.retry import call_with_retries


class LocalBackend(InstanceBook, FunctionBackend):
    """Worker-process backend. ``store`` is where handlers read weights and exchange tensors
    (path, URL or ObjectStore with a ``url``); ``workers`` the pool size (default:
    :func:`default_workers`, refused past the memory). A crashed call is retried
    ``max_retries`` times after ``retry_backoff_s`` x 1, 2, 4 ...; a call waits at most
    ``admission_timeout_s`` (default: its timeout + 60 s) for a free instance slot.
    ``store_latency`` = (seconds, bytes/s) emulates a remote store; ``store_wrap`` =
    ("module:factory", options) wraps the workers' store (fault injection); ``main_workers``
    sizes the main functions' pool; ``max_threads`` caps every instance's torch threads
    (on a shared machine a 2-thread instance measures the other jobs' contention);
    ``startup="platform"`` adds the platform's cold and warm start to every call
    (:mod:`moefleet.runtime.local_startup`; default ``"measured"``: what this machine took)."""

    name = "local"

    def __init__(
        self,
        platform: PlatformSpec | str = "aws-lambda",
        *,
        store: str | ObjectStore | None = None,
        workers: int | None = None,
        max_retries: int = 2,
        retry_backoff_s: float = 0.05,
        admission_timeout_s: float | None = None,
        init_timeout_s: float = 120.0,
        store_latency: tuple[float, float] | None = None,
        store_wrap: tuple[str, dict[str, Any]] | None = None,
        store_retries: int = 3,
        start_method: str = "forkserver",
        startup_timeout_s: float = 180.0,
        limits: bool | None = None,
        wire: str = "raw",
        main_workers: int = 1,
        max_threads: int | None = None,
        startup: str = "measured",
    ) -> None:
        self.platform = load_platform(platform) if isinstance(platform, str) else platform
        self._startup = StartupEmulation.of(self.platform, startup)
        if wire not in ("raw", "base64"):
            raise InvalidFunctionSpecError(f"wire must be 'raw' or 'base64', got {wire!r}",
                                           "base64 emulates the aws backend's envelope")
        raw = payload_limit(self.platform)
        self._limit = raw if wire == "raw" else base64_inline_bytes(raw)
        self.max_retries, self.retry_backoff_s = max_retries, retry_backoff_s
        self.admission_timeout_s, self.init_timeout_s = admission_timeout_s, init_timeout_s
        if max_threads is not None and max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.cores = min(os.cpu_count() or 1, max_threads or os.cpu_count() or 1)
        store_cfg = store_config(store, store_latency, store_wrap)
        self._cond = threading.Condition()
        self._closed = False
        self._functions: dict[str, DeployedFunction] = {}
        self._records: list[InvocationRecord] = []
        self._ids = itertools.count(1)
        self.limits = limits_default() if limits is None else limits
        self._counters: dict[str, Any] = {"retries": 0, "timeouts": 0, "lost": 0, "cold_starts": 0,
                                          "out_of_memory": 0, "cpu_stretch_s": 0.0}
        self.dispatch_hook: Callable[[str, int], None] | None = None
        if main_workers < 1:
            raise ValueError(f"main_workers must be >= 1, got {main_workers}")
        self._main_workers = main_workers
        self._pool_options: dict[str, Any] = dict(
            config={"op": "config", "store": store_cfg, "store_retries": store_retries,
                    "max_inline_bytes": self.max_inline_bytes, "limits": self.limits},
            cond=self._cond, start_method=start_method, startup_timeout_s=startup_timeout_s,
            on_nested=self._serve_nested)
        self._pools: dict[str, WorkerPool] = {}
        self._pools["fn"] = self._new_pool("fn", checked_workers(workers))
        self._housekeeper = threading.Thread(target=self._housekeep, daemon=True,
                                             name="moefleet-local-housekeeper")
        self._housekeeper.start()

    @property
    def startup_emulation(self) -> StartupEmulation | None:
        """The platform startup this backend adds to every call (None: as measured)."""
        return self._startup

    @property
    def max_inline_bytes(self) -> int:  # the raw payload limit, or the base64 one (wire)
        return self._limit

    def _new_pool(self, key: str, size: int) -> WorkerPool:
        def forget(slot: int) -> None:
            # Called under self._cond when a worker dies: its instances are gone.
            for fn in self._functions.values():
                fn.instances = [i for i in fn.instances
                                if not (i.pool == key and i.slot == slot)]

        return WorkerPool(size, on_lost=forget, name="main" if key == "main" else "worker",
                          **self._pool_options)

    def _serve_nested(self, w: Worker, header: dict[str, Any], body: bytes) -> None:
        """A handler's ``ctx.functions.invoke``: run here like any call, on a thread."""
        def answer(reply: dict[str, Any], out: bytes) -> None:
            with w.send_lock:
                send_msg(w.conn, reply, out)
        serve_in_thread(self, header, body, answer)

    # -- FunctionBackend -----------------------------------------------------------------
    def deploy(self, spec: FunctionSpec) -> FunctionSpec:
        self._check_open()
        spec = validate_spec(self.platform, spec)
        if spec.kind == "main":
            self._ensure_main_pool()
        with self._cond:
            old = self._functions.get(spec.name)
            if old is not None:  # a new version: old instances finish, then are unloaded
                for inst in list(old.instances):
                    self._retire(old, inst)
            self._functions[spec.name] = DeployedFunction(spec)
            self._cond.notify_all()
        return spec

    def _ensure_main_pool(self) -> None:
        with self._cond:
            if "main" in self._pools:
                return
        pool = self._new_pool("main", self._main_workers)  # outside the lock: slow
        with self._cond:
            keep = "main" not in self._pools and not self._closed
            self._pools.setdefault("main", pool)
        if not keep:
            pool.stop()

    def functions(self) -> dict[str, FunctionSpec]:
        with self._cond:
            return {name: fn.spec for name, fn in self._functions.items()}

    def scale(self, name: str, *, replicas: int | None = None,
              concurrency: int | None = None) -> FunctionSpec:
        self._check_open()
        with self._cond:
            fn = self._function(name)
            spec = validate_spec(self.platform, replace(
                fn.spec, replicas=fn.spec.replicas if replicas is None else replicas,
                concurrency=fn.spec.concurrency if concurrency is None else concurrency))
            fn.spec = spec
            surplus = [i for i in fn.instances if i.in_flight == 0]
            for inst in surplus[: max(0, len(fn.instances) - spec.replicas)]:
                self._retire(fn, inst)
            self._cond.notify_all()
            return spec

    def records(self) -> list[InvocationRecord]:
        with self._cond:
            return list(self._records)

    def stats(self) -> dict[str, Any]:
        """Counters (respawns, retries, timeouts, cold starts) and the pool's memory."""
        with self._cond:
            out: dict[str, Any] = {**self._counters,
                                   "respawns": sum(p.respawns for p in self._pools.values())}
            out["limits"] = EMULATED_NOTE if self.limits else "off"
            out["startup"] = self._startup.note if self._startup else "measured"
            workers = [w for p in self._pools.values() for w in p.live()]
            out["instances"] = sum(len(fn.instances) for fn in self._functions.values())
        out["workers"] = [{"slot": w.slot, "pid": w.pid, "instances": len(w.hosted),
                           **process_memory_mb(w.pid)} for w in workers]
        return out

    def worker_pids(self) -> list[int]:
        with self._cond:
            return [w.pid for p in self._pools.values() for w in p.live()]

    def invoke(self, name: str, payload: bytes, *, request_id: str | None = None) -> InvokeResult:
        self._check_open()
        check_payload(name, len(payload), self._limit, "request")
        return call_with_retries(
            lambda: self._attempt(name, payload, request_id), LostWorker,
            max_retries=self.max_retries, backoff_s=self.retry_backoff_s,
            on_retry=self._count_retry,
            exhausted=lambda _: crashed_error(name, self.max_retries + 1, "worker process"))

    def _count_retry(self) -> None:
        with self._cond:
            self._counters["retries"] += 1

    def _attempt(self, name: str, payload: bytes, request_id: str | None) -> InvokeResult:
        with self._cond:
            fn, inst, _ = self._admit(name)
            spec = fn.spec
            w = self._pools[inst.pool].workers[inst.slot]
            assert w is not None  # _admit only picks live workers
            queued = len(w.outstanding)
            deadline = time.monotonic() + spec.timeout_s * (queued + 1)
            if not inst.loaded:
                deadline += self.init_timeout_s
            call = Call(next(self._ids), deadline, spec.timeout_s)
            w.outstanding[call.id] = call
            inst.in_flight += 1
            header = {"op": "invoke", "call": call.id, "instance": inst.id,
                      "request_id": request_id,
                      "threads": max(1, min(self.cores, round(spec.vcpus or 1.0))),
                      "vcpus": spec.vcpus or 1.0,
                      "unload": w.pending_unload}
            w.pending_unload = []
            if not inst.loaded:
                header["load"] = {"function": name, "memory_mb": spec.memory_mb,
                                  "handler": {"factory": spec.handler.factory,
                                              "config": spec.handler.config},
                                  # an emulated GPU share still holds its CUDA runtime
                                  "emulated_host_mb": (GPU_EMULATED_HOST_MB
                                                       if spec.gpu_share else 0)}
        if self.dispatch_hook is not None:
            self.dispatch_hook(name, w.pid)
        sent_at = time.time()
        try:
            with w.send_lock:
                send_msg(w.conn, header, payload)
        except (OSError, ValueError):
            pass  # the worker died; its receiver thread marks the call lost
        finished = call.done.wait(max(0.0, deadline - time.monotonic()) + 10.0)
        # A call that succeeded holds its instance (not its worker) through the waits
        # below: the rest of its CPU share (the emulated limits) and the emulated startup.
        ok = (finished and not call.timed_out and call.reply is not None
              and bool(call.reply.get("ok")))
        stretch = float(call.reply.get("cpu_stretch_s", 0.0)) if ok and call.reply else 0.0
        held = ok and (self._startup is not None or stretch > 0)
        with self._cond:
            if not held:  # else released after the emulated wait
                inst.in_flight -= 1
            inst.last_used = time.monotonic()
            w.outstanding.pop(call.id, None)
            self._cond.notify_all()
            if call.timed_out or not finished:
                self._counters["timeouts"] += 1
                # Billed as the platform would: a timed-out attempt runs its full timeout.
                self._records.append(failed_record(spec, sent_at, sent_at + spec.timeout_s,
                                                   request_id, len(payload)))
                raise timeout_error(name, spec.timeout_s)
            if call.lost or call.reply is None:
                # The crashed attempt ran (and is billed) until the worker died.
                self._counters["lost"] += 1
                self._records.append(failed_record(spec, sent_at, time.time(), request_id,
                                                   len(payload)))
                raise LostWorker()
            reply = call.reply
            if not reply["ok"]:
                oom = reply.get("type") == "OutOfMemoryError"
                self._counters["out_of_memory"] += int(oom)
                if (reply["phase"] == "init" or oom) and inst in fn.instances:
                    self._retire(fn, inst)
                else:
                    inst.loaded = True
                raise reply_handler_error(name, reply)
            inst.loaded = True
        record = reply_record(spec, reply, request_id=request_id, bytes_in=len(payload),
                              bytes_out=len(call.body))
        if held:
            try:
                if stretch > 0:  # until the end the worker stamped (now + the shortfall)
                    time.sleep(max(0.0, float(reply["end"]) - time.time()))
                if self._startup is not None:
                    record = self._startup.wait(record)
            finally:
                with self._cond:
                    inst.in_flight -= 1
                    inst.last_used = time.monotonic()
                    self._cond.notify_all()
        check_payload(name, len(call.body), self._limit, "response")
        with self._cond:
            self._records.append(record)
            self._counters["cold_starts"] += int(record.cold)
            self._counters["cpu_stretch_s"] += float(reply.get("cpu_stretch_s", 0.0))
        return InvokeResult(call.body, record)

    def _check_open(self) -> None:
        if self._closed:
            raise BackendClosedError("the local backend was torn down", "create a new one")

    def teardown(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        for pool in list(self._pools.values()):
            pool.stop()
