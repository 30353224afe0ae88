"""Closed-loop control of a real deployment with the simulator's controller interface.

Every ``interval_s`` (on an injectable clock) the loop turns the invocation records that
arrived since the last snapshot into a :class:`MetricsSnapshot` (per function: calls,
tokens, busy time, tail latency, cold starts, token and request shares within its MoE
layer; per request: the end-to-end latencies the caller reported), calls the controller
and schedules its decisions ``apply_delay_s`` later through
:meth:`FunctionBackend.reconfigure` (which clamps to the platform and makes a memory
change cold). Decisions are applied only by :meth:`ControlLoop.tick`, so a test drives
the loop with a fake clock and no sleeps.

Approximations (records carry no instance lifetimes): ``instances`` and ``instance_s``
are the function's replica cap held for the interval (pods); tokens are
``bytes_in / bytes_per_token`` when ``bytes_per_token`` is given, else calls. A caller
whose backend records carry no request id (the executor invokes without one) names the
request of each record in :meth:`ControlLoop.request_finished`, so request shares are
per request, not per call.

What the platform cannot apply is never applied raw: the backend clamps to its limits
(``reconfigure``) and :class:`~moefleet.control.MemoryFloor` raises a memory below what
a function needs to start; both are counted (``ControlLoop.clamped``,
``MemoryFloor.clamped``). The controller, its bounds and delays are
:mod:`moefleet.control`'s: the simulator drives the very same objects.
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from moefleet.control import (
    APPLY_DELAY_S,
    ControlError,
    FunctionConfig,
    FunctionMetrics,
    MetricsSnapshot,
    ScalingController,
)
from moefleet.platform import InvocationRecord
from moefleet.runtime.base import FunctionBackend


def _p95(values: list[float]) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, math.ceil(0.95 * len(s)) - 1)]


@dataclass(frozen=True)
class ControlConfig:
    interval_s: float = 10.0
    apply_delay_s: float = APPLY_DELAY_S
    slo_s: float | None = None
    bytes_per_token: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ControlError(f"control interval must be > 0 s, got {self.interval_s!r}",
                                 "pass e.g. interval_s=10")
        if not (math.isfinite(self.apply_delay_s) and self.apply_delay_s >= 0):
            raise ControlError(f"apply delay must be >= 0 s, got {self.apply_delay_s!r}")


class ControlLoop:
    """Drive ``controller`` against ``backend``; call :meth:`tick` often (or
    :meth:`run_for`). ``applied`` lists (time, function, config) actually applied;
    ``clamped`` the decisions the backend clamped to its limits, as (time, function,
    decided, applied). ``request_started``/``request_finished`` may be called from any
    thread."""

    def __init__(self, backend: FunctionBackend, controller: ScalingController,
                 config: ControlConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend, self.controller = backend, controller
        self.cfg = config or ControlConfig()
        self.clock = clock
        self.state = controller.initial_state()
        self._last = clock()
        self._seen = len(backend.records())
        self._pending: list[tuple[float, str, FunctionConfig]] = []
        self._latencies: list[float] = []
        self._arrivals = 0
        self.in_flight = 0
        self.applied: list[tuple[float, str, FunctionConfig]] = []
        self.clamped: list[tuple[float, str, FunctionConfig, FunctionConfig]] = []
        self.snapshots: list[MetricsSnapshot] = []
        self._lock = threading.Lock()
        self._owner: dict[int, str] = {}  # id(record) -> request, for records without one

    # ---- what the caller reports about requests ----------------------------------------
    def request_started(self) -> None:
        with self._lock:
            self._arrivals += 1
            self.in_flight += 1

    def request_finished(self, latency_s: float, records: Sequence[InvocationRecord] = (),
                         request_id: str | None = None) -> None:
        """A request ended after ``latency_s``; ``records`` (its calls) are attributed
        to ``request_id`` where they carry no request id of their own."""
        with self._lock:
            self.in_flight = max(0, self.in_flight - 1)
            self._latencies.append(latency_s)
            if request_id is not None:
                self._owner.update((id(r), request_id) for r in records
                                   if r.request_id is None)

    def _request_of(self, r: InvocationRecord) -> str | None:
        return r.request_id if r.request_id is not None else self._owner.get(id(r))

    # ---- the loop ----------------------------------------------------------------------
    def tick(self) -> MetricsSnapshot | None:
        """Apply due decisions; at an interval boundary take a snapshot and decide."""
        now = self.clock()
        due = [p for p in self._pending if p[0] <= now]
        self._pending = [p for p in self._pending if p[0] > now]
        for _, name, cfg in due:
            spec = self.backend.reconfigure(name, cfg)
            got = FunctionConfig(spec.memory_mb, spec.replicas, spec.concurrency,
                                 spec.gpu_share)
            if got != cfg:
                self.clamped.append((now, name, cfg, got))
            self.applied.append((now, name, got))
        if now - self._last < self.cfg.interval_s:
            return None
        snap = self.snapshot(self._last, now)
        self._last = now
        decisions, self.state = self.controller.decide(snap, self.state)
        for name, cfg in sorted(decisions.items()):
            self._pending.append((now + self.cfg.apply_delay_s, name, cfg))
        self.snapshots.append(snap)
        return snap

    def run_for(self, duration_s: float, poll_s: float = 0.1,
                sleep: Callable[[float], None] = time.sleep) -> None:
        end = self.clock() + duration_s
        while self.clock() < end:
            self.tick()
            sleep(poll_s)

    def snapshot(self, t0: float, t1: float) -> MetricsSnapshot:
        records = self.backend.records()
        new: list[InvocationRecord] = records[self._seen:]
        self._seen = len(records)
        interval = max(t1 - t0, 1e-9)
        by_fn: dict[str, list[InvocationRecord]] = defaultdict(list)
        for r in new:
            by_fn[r.function].append(r)
        bpt = self.cfg.bytes_per_token

        def tokens(rs: list[InvocationRecord]) -> int:
            return sum(r.bytes_in // bpt for r in rs) if bpt else len(rs)

        layer_tokens: dict[int, int] = defaultdict(int)
        layer_reqs: dict[int, set[str | None]] = defaultdict(set)
        for name, spec in self.backend.functions().items():
            if spec.kind == "expert" and spec.layer is not None:
                layer_tokens[spec.layer] += tokens(by_fn[name])
                layer_reqs[spec.layer] |= {self._request_of(r) for r in by_fn[name]}
        functions: dict[str, FunctionMetrics] = {}
        for name, spec in self.backend.functions().items():
            rs = by_fn[name]
            lat = [r.end_s - r.start_s + r.init_s for r in rs]
            expert = spec.kind == "expert" and spec.layer is not None
            lt = layer_tokens[spec.layer] if expert and spec.layer is not None else 0
            lr = len(layer_reqs[spec.layer]) if expert and spec.layer is not None else 0
            tok = tokens(rs)
            functions[name] = FunctionMetrics(
                name=name, kind="expert" if spec.kind == "expert" else "segment",
                layer=spec.layer if spec.layer is not None else 0,
                expert=spec.experts[0] if spec.experts else None,
                config=FunctionConfig(spec.memory_mb, spec.replicas, spec.concurrency,
                                 spec.gpu_share),
                instances=spec.replicas, calls=len(rs), tokens=tok,
                cold_starts=sum(r.cold for r in rs), busy_s=sum(lat),
                instance_s=spec.replicas * interval, p95_latency_s=_p95(lat),
                token_share=tok / lt if lt else 0.0,
                request_share=len({self._request_of(r) for r in rs}) / lr if lr else 0.0,
                interval_s=interval)
        with self._lock:
            lats, self._latencies = self._latencies, []
            arrivals, self._arrivals = self._arrivals, 0
            in_flight = self.in_flight
        slo = self.cfg.slo_s
        viol = sum(x > slo for x in lats) / len(lats) if lats and slo is not None else 0.0
        return MetricsSnapshot(t_s=t1, interval_s=interval, functions=functions,
                               arrivals=arrivals, completions=len(lats),
                               in_flight_requests=in_flight, p95_latency_s=_p95(lats),
                               slo_s=slo, slo_violation_rate=viol)
