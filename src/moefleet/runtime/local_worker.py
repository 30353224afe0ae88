"""The worker process of the ``local`` backend (child side) and its wire protocol.

Protocol, over one duplex ``multiprocessing`` pipe per worker: every message is two frames,
a JSON header then a raw body (possibly empty), sent with ``send_bytes``. Nothing is
pickled. Parent → worker headers: ``config`` (environment, sys.path, store), ``invoke``
(call id, instance id, thread budget, ``load`` = the function to cold-start when the
instance is new, ``unload`` = instances to drop), ``unload``, ``stop``. Worker → parent:
``ready`` once, then per ``invoke`` a ``started`` note after a cold start (the handler's
timeout runs from there) and one reply (``ok``, timings on the ``time.time()`` clock,
storage request counts, or the error's type/message/hint/phase). During an invocation the
handler may also send ``nested`` requests (``ctx.functions``: another function of the
backend, :mod:`moefleet.runtime.nested`); the parent runs them and answers
``nested_reply``. A reader thread takes every message off the pipe, so nested replies reach
the handler while the main thread is inside it; all sends share one lock.

A worker runs one invocation at a time (it is one CPU slot of the emulated node) and may
host many function instances (their weights stay in its memory until unloaded). With
``limits`` in the config it charges each instance's memory and stretches sub-core vCPU
shares (:mod:`moefleet.runtime.local_limits`, emulated).
"""

from __future__ import annotations

import gc
import json
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from moefleet.platform import ObjectStore
from moefleet.runtime.local_limits import MB, CallGauge, OutOfMemoryError, rss_bytes, trim_heap


def send_msg(conn: Connection, header: dict[str, Any], body: bytes = b"") -> None:
    """Two frames; callers serialise concurrent senders themselves."""
    conn.send_bytes(json.dumps(header).encode())
    conn.send_bytes(body)


def recv_msg(conn: Connection) -> tuple[dict[str, Any], bytes]:
    header = json.loads(conn.recv_bytes())
    return header, conn.recv_bytes()


@dataclass
class _Instance:
    host: Any  # moefleet.runtime.host.Instance (imported lazily: torch)
    function: str
    threads: int
    memory_mb: int = 0
    vcpus: float = 1.0
    charged: int = 0  # bytes its cold start added to the worker's RSS (local_limits)


class _Worker:
    def __init__(self, conn: Connection, config: dict[str, Any]) -> None:
        self.conn = conn
        self.store_config: dict[str, Any] | None = config.get("store")
        self.retries = int(config.get("store_retries", 3))
        self.max_inline = int(config["max_inline_bytes"])
        self.instances: dict[str, _Instance] = {}
        self._store: ObjectStore | None = None
        self.limits = bool(config.get("limits", False))
        self.base_rss = rss_bytes()  # the runtime footprint: nothing loaded yet
        self._send_lock = threading.Lock()
        from moefleet.runtime.nested import ChannelFunctions

        self.functions = ChannelFunctions(self.send, self.max_inline)

    def send(self, header: dict[str, Any], body: bytes = b"") -> None:
        """Thread-safe send (replies, ``started`` notes and nested requests share it)."""
        with self._send_lock:
            send_msg(self.conn, header, body)

    def base_store(self) -> ObjectStore | None:
        # One client per process, like a boto3 client reused across a container's calls.
        if self._store is None and self.store_config is not None:
            from moefleet.runtime.stores import build_store

            self._store = build_store(self.store_config)
        return self._store

    def caller_store(self) -> tuple[ObjectStore | None, Any]:
        """A per-caller (counting, retrying) view of the store, and its counter."""
        from moefleet.runtime.stores import CountingStore, RetryingStore

        base = self.base_store()
        if base is None:
            return None, None
        counter = CountingStore(base)
        return RetryingStore(counter, attempts=self.retries), counter

    def unload(self, ids: list[str]) -> None:
        if any(self.instances.pop(i, None) is not None for i in ids):
            gc.collect()  # drop the weights now, not at some later allocation
            trim_heap()

    def invoke(self, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        from moefleet.runtime.base import HandlerRef
        from moefleet.runtime.host import HostError, Instance, error_reply

        reply: dict[str, Any] = {"call": header["call"], "cold": False, "init_s": 0.0,
                                 "puts": 0, "gets": 0}
        iid = header["instance"]
        phase = "init"
        try:
            if iid not in self.instances:
                load = header.get("load")
                if load is None:
                    raise RuntimeError(f"instance {iid} is not loaded on this worker")
                gauge = CallGauge() if self.limits else None
                host = Instance(load["function"], int(load["memory_mb"]),
                                int(header["threads"]), HandlerRef(**load["handler"]),
                                self.caller_store, self.max_inline,
                                float(load.get("emulated_host_mb", 0.0)))
                cold = host.start()
                inst = _Instance(host, load["function"], int(header["threads"]),
                                 int(load["memory_mb"]), float(header.get("vcpus") or 1.0))
                if gauge is not None:
                    inst.charged = gauge.growth() + host.emulated_bytes
                    self._check_memory(inst, inst.charged, "init")
                self.instances[iid] = inst
                reply.update(cold=True, init_s=cold.init_s, puts=cold.puts, gets=cold.gets)
                # The handler's timeout starts now, not when the cold start began.
                self.send({"op": "started", "call": header["call"]})
            phase = "run"
            inst = self.instances[iid]
            gauge = CallGauge() if self.limits else None
            res = inst.host.call(body, header.get("request_id"), self.functions)
            reply.update(start=res.start, end=res.end)
            if gauge is not None:
                reply["memory_bytes"] = self.base_rss + inst.charged + gauge.growth()
                self._check_memory(inst, gauge.growth() + inst.charged, "run")
                # the caller waits the share out (this worker's slot free meanwhile)
                extra = gauge.share_shortfall(inst.vcpus)
                reply["cpu_stretch_s"] = extra
                reply["end"] = time.time() + extra
            reply["puts"] += res.puts
            reply["gets"] += res.gets
            reply["ok"] = True
            return reply, res.out
        except Exception as err:  # reported to the caller, never kills the worker
            if isinstance(err, HostError):
                phase, err = err.phase, err.error  # type: ignore[assignment]
            if isinstance(err, OutOfMemoryError):
                self.unload([iid])  # the platform drops an instance that ran out of memory
            reply.update(ok=False, **error_reply(phase, err))
            return reply, b""

    def _check_memory(self, inst: _Instance, own: int, phase: str) -> None:
        used = self.base_rss + own
        if used > inst.memory_mb * MB:
            raise OutOfMemoryError(inst.function, used, inst.memory_mb, phase)


def worker_main(conn: Connection, slot: int) -> None:
    """Entry point of a worker process (started by ``LocalBackend``)."""
    # Ctrl-C goes to the parent, which stops workers by pid; a worker never dies of it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        header, _ = recv_msg(conn)
    except (EOFError, OSError):
        return
    os.environ.update(header.get("env", {}))
    for path in reversed(header.get("sys_path", [])):
        if path not in sys.path:
            sys.path.insert(0, path)
    worker = _Worker(conn, header)
    worker.send({"op": "ready", "pid": os.getpid(), "slot": slot})
    inbox: queue.SimpleQueue[tuple[dict[str, Any], bytes] | None] = queue.SimpleQueue()

    def read() -> None:
        while True:
            try:
                msg = recv_msg(conn)
            except (EOFError, OSError):
                inbox.put(None)  # the parent went away: nothing left to serve
                worker.functions.fail_all()
                return
            if msg[0].get("op") == "nested_reply":
                worker.functions.deliver(*msg)
            else:
                inbox.put(msg)

    threading.Thread(target=read, daemon=True, name="moefleet-worker-reader").start()
    while True:
        item = inbox.get()
        if item is None:
            return
        header, body = item
        worker.unload(header.get("unload", []))
        op = header.get("op")
        if op == "stop":
            return
        if op == "invoke":
            reply, out = worker.invoke(header, body)
            try:
                worker.send(reply, out)
            except (EOFError, OSError):
                return
