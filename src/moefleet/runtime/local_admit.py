"""Which instance of the ``local`` backend takes a call, and when idle ones go: the
bookkeeping half of :class:`moefleet.runtime.local.LocalBackend`, kept apart so that the
backend's file holds the calls themselves. Every method runs under the backend's
condition ``_cond`` unless it says otherwise."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from moefleet.runtime.errors import (
    BackendClosedError,
    ThrottledError,
    UnknownFunctionError,
)
from moefleet.runtime.local_pool import DeployedFunction, HostedInstance, Worker, WorkerPool

_TICK_S = 0.05  # housekeeping period (deadlines, keep-alive)


class InstanceBook:
    """Instances of the deployed functions on the backend's worker pools (a mixin)."""

    _cond: threading.Condition
    _closed: bool
    _functions: dict[str, DeployedFunction]
    _pools: dict[str, WorkerPool]
    admission_timeout_s: float | None
    _ids: Iterator[int]

    def _function(self, name: str) -> DeployedFunction:
        if name not in self._functions:
            raise UnknownFunctionError(
                f"no function named {name!r} is deployed on the local backend",
                f"deployed: {', '.join(sorted(self._functions)) or 'none'}")
        return self._functions[name]

    def _housekeep(self) -> None:
        while not self._closed:
            time.sleep(_TICK_S)
            now = time.monotonic()
            with self._cond:
                pools = list(self._pools.values())
                for pool in pools:
                    pool.enforce_deadlines(now)
                for fn in self._functions.values():
                    for inst in [i for i in fn.instances if i.in_flight == 0
                                 and now - i.last_used > fn.spec.keep_alive_s]:
                        self._retire(fn, inst)
            for pool in pools:
                pool.flush_unloads()

    def _worker(self, inst: HostedInstance) -> Worker | None:
        w = self._pools[inst.pool].workers[inst.slot]
        return w if w is not None and w.alive else None

    def _retire(self, fn: DeployedFunction, inst: HostedInstance) -> None:
        fn.instances.remove(inst)
        w = self._worker(inst)
        if w is not None:
            w.hosted.discard(inst.id)
            w.pending_unload.append(inst.id)

    def _admit(self, name: str) -> tuple[DeployedFunction, HostedInstance, bool]:
        """Pick a warm instance, or cold-start one on an idle worker; wait otherwise."""
        spec = self._function(name).spec
        limit = self.admission_timeout_s or spec.timeout_s + 60.0
        deadline = time.monotonic() + limit
        while True:
            if self._closed:
                raise BackendClosedError("the local backend was torn down", "create a new one")
            fn = self._function(name)
            warm = [i for i in fn.instances if i.in_flight < fn.spec.concurrency
                    and (w := self._worker(i)) is not None
                    and len(w.outstanding) == i.in_flight]
            if warm:
                return fn, min(warm, key=lambda i: (i.in_flight, -i.last_used)), False
            if len(fn.instances) < fn.spec.replicas:
                key = "main" if fn.spec.kind == "main" else "fn"
                idle = [w for w in self._pools[key].live() if not w.outstanding]
                if idle:
                    w = min(idle, key=lambda w: (len(w.hosted), w.slot))
                    inst = HostedInstance(f"{name}#{next(self._ids)}", name, w.slot, key)
                    fn.instances.append(inst)
                    w.hosted.add(inst.id)
                    return fn, inst, True
            left = deadline - time.monotonic()
            if left <= 0:
                raise ThrottledError(
                    f"{name}: no instance slot free within {limit:g} s (replicas="
                    f"{fn.spec.replicas}, concurrency={fn.spec.concurrency})",
                    "scale the function up or send fewer concurrent requests")
            self._cond.wait(min(left, 0.5))
