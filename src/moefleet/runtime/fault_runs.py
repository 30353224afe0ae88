"""Run requests through a deployment under one :class:`~moefleet.runtime.faults.FaultPlan`
and account for every one: accepted, completed, lost, output equal to the monolithic
model, latency and billed cost (failed attempts included). Used by the fault tests and
``benchmarks/faults.py``.

A request is *lost* when it was accepted but neither completed nor failed with a clear
error; the harness catches every exception a request raises, so a request that fails is
counted as ``failed`` (with its error), never silently dropped.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moefleet.platform import Meter, ObjectStore, PlatformSpec
from moefleet.runtime.base import FunctionBackend
from moefleet.runtime.deploy import Deployment
from moefleet.runtime.executor import Executor
from moefleet.runtime.faults import EMULATED, FaultPlan, FaultyBackend, FaultyStore, ResilientStore
from moefleet.runtime.retry import POLICIES

Batch = tuple[torch.Tensor, torch.Tensor, list[str]]


@dataclass
class FaultRun:
    """What happened to ``accepted`` requests under one fault plan."""

    backend: str
    kind: str
    rate: float
    accepted: int = 0
    completed: int = 0
    failed: int = 0
    outputs_equal: int = 0
    injected: int = 0
    retries: int = 0
    latencies_s: list[float] = field(default_factory=list)
    cost_usd: float = 0.0
    failed_attempts: int = 0
    failed_attempt_cost_usd: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def lost(self) -> int:
        return self.accepted - self.completed - self.failed

    def to_dict(self) -> dict[str, Any]:
        lat = np.array(self.latencies_s) if self.latencies_s else np.zeros(1)
        return {"backend": self.backend, "kind": self.kind, "rate": self.rate,
                "emulated": self.kind in EMULATED, "accepted": self.accepted,
                "completed": self.completed, "failed": self.failed, "lost": self.lost,
                "outputs_equal_monolithic": self.outputs_equal, "faults_injected": self.injected,
                "retries": self.retries, "latency_p50_s": float(np.percentile(lat, 50)),
                "latency_p95_s": float(np.percentile(lat, 95)), "cost_usd": self.cost_usd,
                "failed_attempts_billed": self.failed_attempts,
                "failed_attempt_cost_usd": self.failed_attempt_cost_usd,
                "retry_policy": POLICIES.get(self.backend, POLICIES["local"]).to_dict(),
                "errors": self.errors[:5]}


def run_under_faults(dep: Deployment, backend: FunctionBackend, store: ObjectStore,
                     platform: PlatformSpec, plan: FaultPlan, batches: Sequence[Batch],
                     reference: Any, atol: float = 1e-4) -> FaultRun:
    """Each batch is one request (its ids/mask/request ids); ``reference`` is the adapter
    whose ``reference_forward`` gives the monolithic output."""
    faulty = FaultyBackend(backend, plan)
    fstore = FaultyStore(store, plan)
    before = len(backend.records())
    run = FaultRun(backend.name, plan.kind, plan.rate)
    with Executor(dep, faulty, ResilientStore(fstore, seed=plan.seed), platform) as ex:
        for ids, mask, rids in batches:
            run.accepted += 1
            t0 = time.perf_counter()
            try:
                res = ex.run_batch(ids, mask, rids)
            except Exception as err:  # counted, never dropped: a clear error is not a loss
                run.failed += 1
                run.errors.append(f"{type(err).__name__}: {err}")
                continue
            run.latencies_s.append(time.perf_counter() - t0)
            run.completed += 1
            want = reference.reference_forward(ids, mask)
            real_BT = mask.bool() if mask is not None else slice(None)  # padding: no experts
            run.outputs_equal += int((res.output - want)[real_BT].abs().max().item() <= atol)
    records = faulty.records()[before:]
    bill = Meter(platform, records).bill()
    run.cost_usd = bill.total.total
    run.failed_attempts = bill.failed_attempts
    run.failed_attempt_cost_usd = bill.failed.total
    run.injected = faulty.injected + fstore.injected
    run.retries = faulty.retries
    return run
