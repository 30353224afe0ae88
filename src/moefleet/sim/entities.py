"""The small things the simulator moves around: calls, instances, barriers, the node.

A :class:`Call` is itself the SimPy event of its end (one event per invocation); a
:class:`Barrier` fires when its last call's output is visible; a :class:`Node` bounds the
calls running at once across all functions. Units: seconds, MB, USD.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import simpy
from simpy.events import Timeout

if TYPE_CHECKING:
    from moefleet.sim.functions import FunctionPool


class Barrier(simpy.Event):
    """Fires once ``n`` calls have arrived, at the latest time their outputs are visible
    (a call's handler end plus its response transfer)."""

    def __init__(self, env: simpy.Environment, n: int) -> None:
        super().__init__(env)
        self.pending = n
        self.until = env.now
        if n == 0:
            self.succeed()

    def arrive(self, visible_s: float) -> None:
        if visible_s > self.until:
            self.until = visible_s
        self.pending -= 1
        if not self.pending:
            self.release()

    def release(self) -> None:
        """All calls are in: fire when the last output is visible."""
        delay = self.until - self.env.now
        if delay > 0:
            Timeout(self.env, delay).callbacks.append(self._fire)
        else:
            self.succeed()

    def _fire(self, _ev: simpy.Event) -> None:
        self.succeed()


class Node:
    """A finite machine under every function (a self-hosted cluster, the local runtime's
    worker pool): at most ``slots`` calls run at once; the others wait FIFO, holding the
    instance slot they were given."""

    def __init__(self, slots: int) -> None:
        self.free = slots
        self.waiting: deque[tuple[FunctionPool, Instance, Call]] = deque()

    def release(self, now: float) -> None:
        if self.waiting:
            pool, inst, call = self.waiting.popleft()
            pool.start_call(inst, call, now)  # the slot passes straight on
        else:
            self.free += 1


class Instance:
    """One warm (or starting) copy of a function, with the size it was started with."""

    __slots__ = ("active", "dead", "death_s", "fresh", "gpu_share", "in_avail", "last_end",
                 "memory_mb", "rate", "ready_s", "spawn_s", "vcpus", "version")

    def __init__(self, version: int, memory_mb: int, vcpus: float, rate: float, now: float,
                 ready_s: float, gpu_share: float = 0.0) -> None:
        self.version = version
        self.memory_mb = memory_mb
        self.vcpus = vcpus
        self.gpu_share = gpu_share  # fraction of one GPU (0 = CPU only)
        self.rate = rate  # USD per billed second at this size
        self.spawn_s = now
        self.ready_s = ready_s
        self.last_end = ready_s
        self.active = 0
        self.fresh = True
        self.in_avail = False
        self.dead = False
        self.death_s = 0.0


class Call(simpy.Event):
    """One invocation: ``tokens`` to process, ``fixed_s`` of transfers in its handler,
    ``resp_s`` of response transfer after it, storage ops, and who waits for it.

    The call is itself the SimPy event that fires when its handler ends (one event per
    invocation: start delay and handler are one timeout)."""

    __slots__ = ("barrier", "begin_s", "cold", "compute", "fixed_s", "gets", "handler_s",
                 "init_s", "inst", "puts", "request_id", "resp_s", "submit_s", "tokens")
    inst: Instance
    begin_s: float
    submit_s: float
    handler_s: float

    def __init__(self, tokens: int, fixed_s: float, resp_s: float, gets: int, puts: int,
                 barrier: Barrier, request_id: str | None, compute: bool = True) -> None:
        # Event.__init__ is skipped on purpose: the call is scheduled (already triggered)
        # by FunctionPool.start_call, which sets env, callbacks, _ok and _value.
        self.tokens = tokens
        self.fixed_s = fixed_s
        self.resp_s = resp_s
        self.gets = gets
        self.puts = puts
        self.barrier = barrier
        self.request_id = request_id
        self.compute = compute  # False: no profiled compute (a segment's ``post`` call)
        self.init_s = 0.0
        self.cold = False
