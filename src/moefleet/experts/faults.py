"""Fault injection at the expert seam (emulated): :class:`FaultyExperts` wraps an
in-process ``ExpertFn`` and, for a seeded fraction of calls, raises or delays as a remote
expert function would (kinds and plans: :mod:`moefleet.runtime.faults`). Faults against a
real backend go through :class:`~moefleet.runtime.faults.FaultyBackend` instead.
"""

from __future__ import annotations

import time
from typing import Any

from moefleet.errors import MoefleetError
from moefleet.experts.stack import ExpertStack, as_stack
from moefleet.models.base import ExpertFn
from moefleet.runtime.errors import FunctionCrashedError, InvocationTimeoutError
from moefleet.runtime.faults import EXPERT_FAULTS, FaultPlan, InjectedThrottle
from moefleet.runtime.stores import Dice


class FaultyExperts(ExpertStack):
    """An ``ExpertFn`` that injects ``plan``'s fault into a seeded fraction of calls to
    ``inner`` (see the module docstring); thread-safe, counts what it injected."""

    def __init__(self, inner: ExpertStack | ExpertFn, plan: FaultPlan) -> None:
        if plan.kind not in EXPERT_FAULTS and plan.kind != "none":
            raise MoefleetError(f"fault kind {plan.kind!r} cannot be injected at the expert "
                                "seam", f"use one of: {', '.join(EXPERT_FAULTS)}")
        self.inner, self.plan = as_stack(inner), plan
        self.inners = (self.inner,)
        self._dice = Dice(plan.rate if plan.kind != "none" else 0.0, plan.seed + 13)
        self.calls = 0

    @property
    def injected(self) -> int:
        return self._dice.injected

    def __call__(self, layer: int, x_ND: Any, ids_NK: Any, w_NK: Any) -> Any:
        self.calls += 1
        if self._dice.roll():
            kind, p = self.plan.kind, self.plan
            where = f"experts of layer {layer}"
            if kind == "crash":
                raise FunctionCrashedError(f"{where}: function crashed (injected)")
            if kind == "timeout":
                time.sleep(p.timeout_s)
                raise InvocationTimeoutError(f"{where}: timed out (injected)")
            if kind == "throttle":
                raise InjectedThrottle(where, p.retry_after_s)
            if kind == "error":
                raise RuntimeError(f"{where}: handler error (injected)")
            time.sleep(p.straggle_s if kind == "straggler" else p.stall_s)
        return self.inner(layer, x_ND, ids_NK, w_NK)
