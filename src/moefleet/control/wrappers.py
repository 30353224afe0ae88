"""The one wrapper family around any scaling controller: bounds, delays, a memory floor.

Each wrapper is itself a :class:`~moefleet.control.scaling.ScalingController`, so they
nest (``MemoryFloor(Bounded(HPAPolicy(), bounds), floor)``) and every driver (the
simulator, the runtime control loop) takes the result like any controller:

- :class:`Bounded` — bounds (replicas, concurrency, memory options), hysteresis (ignore
  small relative changes) and up/down-scale delays (a change must be wanted continuously
  for that long before it is emitted). Time is the snapshot's ``t_s``: never a clock.
- :class:`Deferred` — the inner controller from ``start_s`` on; before it, no snapshot
  reaches it and nothing is decided (a warm-up that is not the controller's to see).
- :class:`MemoryFloor` — every decided memory raised to the least a function's instance
  starts in on this platform.

Invariants: a wrapper's name, initial state (except where it adds its own, as
:class:`Bounded` does) and deployed configs are the inner controller's; a wrapper never
mutates the snapshot or the state it is given.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from moefleet.control.base import ControlError
from moefleet.control.scaling import (
    Decisions,
    FunctionConfig,
    MetricsSnapshot,
    PolicyState,
    ScalingBounds,
    ScalingController,
)

_log = logging.getLogger(__name__)


class Wrapped(ScalingController):
    """A controller around ``inner``: its name, initial state and deployed configs are
    the inner one's; subclasses change ``decide`` (and the state, if they keep one)."""

    def __init__(self, inner: ScalingController) -> None:
        self.inner, self.name = inner, inner.name

    def initial_state(self) -> PolicyState:
        return self.inner.initial_state()

    def deployed_configs(self) -> Decisions:
        return self.inner.deployed_configs()


@dataclass(frozen=True)
class _Pending:
    direction: Literal["up", "down"]
    since_s: float
    config: FunctionConfig


@dataclass(frozen=True)
class BoundedState:
    """:class:`Bounded`'s state: the inner controller's, and the changes waiting out
    their delay (function -> direction, since when, latest wanted config)."""

    inner: PolicyState
    pending: Mapping[str, _Pending] = field(default_factory=dict)


def _relative_change(new: float, old: float) -> float:
    return abs(new - old) / old if old > 0 else math.inf


class Bounded(Wrapped):
    """Bounds, hysteresis and delays around any controller (one shared implementation).

    For every function the inner controller wants changed: clamp to ``bounds``; drop the
    change when replicas and memory move by at most ``tolerance`` (relative) and
    concurrency does not move; otherwise it is an up-scale (more replicas or memory) or
    a down-scale, and is emitted only once the inner controller has asked for a change in
    the same direction continuously for ``upscale_delay_s`` / ``downscale_delay_s`` of
    snapshot time (the latest wanted config is the one emitted). A function the inner
    controller leaves alone, or a change of direction, resets its timer.
    """

    def __init__(self, inner: ScalingController, bounds: ScalingBounds | None = None, *,
                 upscale_delay_s: float = 0.0, downscale_delay_s: float = 0.0,
                 tolerance: float = 0.0) -> None:
        for name, value in (("upscale_delay_s", upscale_delay_s),
                            ("downscale_delay_s", downscale_delay_s), ("tolerance", tolerance)):
            if not (math.isfinite(value) and value >= 0):
                raise ControlError(f"{name} must be a finite number >= 0, got {value!r}")
        super().__init__(inner)
        self.bounds = bounds or ScalingBounds()
        self.upscale_delay_s = upscale_delay_s
        self.downscale_delay_s = downscale_delay_s
        self.tolerance = tolerance

    def initial_state(self) -> PolicyState:
        return BoundedState(self.inner.initial_state())

    def decide(self, snapshot: MetricsSnapshot, state: PolicyState) -> tuple[Decisions,
                                                                             PolicyState]:
        if not isinstance(state, BoundedState):
            raise ControlError("Bounded got a foreign state",
                               "start from controller.initial_state()")
        now = snapshot.t_s
        wanted, inner_state = self.inner.decide(snapshot, state.inner)
        out: Decisions = {}
        pending: dict[str, _Pending] = {}
        for name, raw in sorted(wanted.items()):
            if name not in snapshot.functions:
                raise ControlError(f"controller {self.inner.name!r} decided for unknown "
                                   f"function {name!r}")
            cur = snapshot.functions[name].config
            cfg = self.bounds.clamp(raw)
            if self._negligible(cfg, cur):
                continue
            grows = cfg.replicas > cur.replicas or cfg.memory_mb > cur.memory_mb
            direction: Literal["up", "down"] = "up" if grows else "down"
            delay = self.upscale_delay_s if grows else self.downscale_delay_s
            prev = state.pending.get(name)
            since = prev.since_s if prev is not None and prev.direction == direction else now
            if now - since >= delay:
                out[name] = cfg
            else:
                pending[name] = _Pending(direction, since, cfg)
        return out, replace(state, inner=inner_state, pending=pending)

    def _negligible(self, new: FunctionConfig, cur: FunctionConfig) -> bool:
        if new == cur:
            return True
        if new.concurrency != cur.concurrency:
            return False
        return (_relative_change(new.replicas, cur.replicas) <= self.tolerance
                and _relative_change(new.memory_mb, cur.memory_mb) <= self.tolerance)


class MemoryFloor(Wrapped):
    """``inner`` with every decided memory raised to the function's floor
    (``floor_mb[name]``: the least memory its instance starts in on this platform).

    A decision below it would fail every call (out of memory), so it is clamped, logged
    and listed in ``clamped`` as (snapshot time, function, decided, applied) — a record
    for the caller that ``decide`` never reads, so decisions stay a function of (snapshot,
    state). A decision the clamp turns into the current config is dropped.
    """

    def __init__(self, inner: ScalingController, floor_mb: Mapping[str, int]) -> None:
        super().__init__(inner)
        self.floor_mb = dict(floor_mb)
        self.clamped: list[tuple[float, str, FunctionConfig, FunctionConfig]] = []

    def decide(self, snapshot: MetricsSnapshot, state: PolicyState) -> tuple[Decisions,
                                                                             PolicyState]:
        decisions, state = self.inner.decide(snapshot, state)
        out: dict[str, FunctionConfig] = {}
        for name, cfg in decisions.items():
            floor = self.floor_mb.get(name, 0)
            if cfg.memory_mb < floor:
                new = replace(cfg, memory_mb=floor)
                _log.warning("%s: decision %s raised to the memory floor %d MB", name, cfg,
                             floor)
                self.clamped.append((snapshot.t_s, name, cfg, new))
                cfg = new
            if name not in snapshot.functions or snapshot.functions[name].config != cfg:
                out[name] = cfg
        return out, state


class Deferred(Wrapped):
    """``inner`` from time ``start_s`` on; before it, no decisions and no snapshots reach
    it (the warm-up before a replay is not the controller's to see)."""

    def __init__(self, inner: ScalingController, start_s: float) -> None:
        if not math.isfinite(start_s):
            raise ControlError(f"Deferred start must be a finite time, got {start_s!r}")
        super().__init__(inner)
        self.start_s = start_s

    def decide(self, snapshot: MetricsSnapshot, state: PolicyState) -> tuple[Decisions,
                                                                             PolicyState]:
        if snapshot.t_s <= self.start_s + 1e-9:
            return {}, state
        return self.inner.decide(snapshot, state)
