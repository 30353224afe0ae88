"""Run requests through a deployment under one :class:`~moefleet.runtime.faults.FaultPlan`
and account for every one: accepted, completed, lost, output equal to the monolithic
model, latency and billed cost (failed attempts included). Used by the fault tests,
``benchmarks/faults.py`` (prompts at once) and ``benchmarks/faults_soak.py`` (prompts at
timed arrivals, replayed in real time). Requests go through the composition root
(``compose.open_engine``).

A request is *lost* when it was accepted but neither completed nor failed with a clear
error; the harness catches every exception a request raises, so a request that fails is
counted as ``failed`` (with its error), never silently dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moefleet.models.base import MoEModelAdapter
from moefleet.platform import Meter, ObjectStore, PlatformSpec
from moefleet.runtime.base import FunctionBackend
from moefleet.runtime.deploy import Deployment
from moefleet.runtime.faults import (
    EMULATED,
    FaultPlan,
    FaultyBackend,
    store_faults,
)
from moefleet.runtime.retry import POLICIES
from moefleet.runtime.stores import RetryingStore


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
    store_retries: int = 0
    finished_s: list[float] = field(default_factory=list)  # completions, after the start
    wall_s: float = 0.0

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


def run_under_faults(adapter: MoEModelAdapter, dep: Deployment, backend: FunctionBackend,
                     store: ObjectStore, platform: PlatformSpec, plan: FaultPlan,
                     prompts: Sequence[list[int]], atol: float = 1e-4, *,
                     arrivals_s: Sequence[float] | None = None, batch: int = 1,
                     on_finish: Callable[[Any], None] | None = None) -> FaultRun:
    """Score each prompt as its own request (one step each) through the segment runner
    over ``dep``'s functions on ``backend``, under ``plan``: backend faults at the backend,
    store faults on the caller's store (retried by
    :class:`~moefleet.runtime.stores.RetryingStore`). ``adapter`` gives the monolithic
    output to compare with. With ``arrivals_s`` (seconds after the start, sorted) each
    prompt is added at its time and the engine steps batches of up to ``batch`` prompts
    in real time (``engine.replay``; ``on_finish`` sees each request as it ends);
    without, every prompt is added at once, one per step."""
    from moefleet.compose import StackOptions, open_engine
    from moefleet.compose.run import run_billed
    from moefleet.compose.score import SCORE, score_options
    from moefleet.engine.replay import replay

    fstore = store_faults(store, plan)
    retrying = RetryingStore(fstore, seed=plan.seed)
    before = len(backend.records())
    run = FaultRun(backend.name, plan.kind, plan.rate)
    stack = StackOptions(faults=plan if plan.hits_backend else None)
    longest = max(len(p) for p in prompts)
    with open_engine(adapter, plan=dep, stack=stack, backend=backend, store=retrying,
                     platform=platform, options=score_options(
                         1 if arrivals_s is None else batch, max(2, longest))) as opened:
        clock0, t0 = opened.engine.clock(), time.perf_counter()
        if arrivals_s is None:
            outputs = run_billed(opened, [list(p) for p in prompts], SCORE).outputs
        else:
            outputs = replay(opened.engine, [(t, list(p), SCORE) for t, p in
                                             zip(arrivals_s, prompts, strict=True)],
                             max_wall_s=arrivals_s[-1] + 1800.0, on_finish=on_finish)
        run.wall_s = time.perf_counter() - t0
        faulty = opened.backend if isinstance(opened.backend, FaultyBackend) else None
    for ids, out in zip(prompts, outputs, strict=True):
        run.accepted += 1
        if out.finish_reason == "error":  # counted, never dropped: a clear error is no loss
            run.failed += 1
            run.errors.append(out.error or "")
            continue
        run.completed += 1
        if out.times is not None and out.times.e2e_s is not None:
            run.latencies_s.append(out.times.e2e_s)
        if out.times is not None and out.times.finished is not None:
            run.finished_s.append(out.times.finished - clock0)
        want = adapter.reference_forward(torch.tensor([list(ids)]))[0]
        assert out.prompt_outputs is not None  # a scored request carries its outputs
        run.outputs_equal += int((out.prompt_outputs - want).abs().max().item() <= atol)
    records = backend.records()[before:] + (faulty.failed_records() if faulty else [])
    bill = Meter(platform, records).bill()
    run.cost_usd = bill.total.total
    run.failed_attempts = bill.failed_attempts
    run.failed_attempt_cost_usd = bill.failed.total
    run.injected = (faulty.injected if faulty else 0) + fstore.injected
    run.retries = faulty.retries if faulty else 0
    run.store_retries = retrying.retries
    return run
