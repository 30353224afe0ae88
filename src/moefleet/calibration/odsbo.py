"""Calibrate the analytical model (``costmodel``) to a measured backend, and read it for one.

What is measured, and why (the model's platform terms, READING-NOTES eqs. 6-11):

- ``T_acc`` and ``B_s`` (:func:`measure_store`): PUT and GET of packed token objects of
  two sizes in the backend's own store, timed from this process. The model charges one
  ``T_acc`` per store access and its accesses come in GET/PUT pairs (a replica's download
  and upload), so ``T_acc`` is the mean of a small PUT and a small GET; ``B_s`` is the
  slope between the small and the large object. Both are kept separately too
  (``put_s``/``get_s``): a local directory store's PUT is fsync'd and far slower than its
  GET, which one ``T_acc`` cannot express. fsync times on a shared disk are noisy (PUT
  0.2-8 ms seen); callers may prefer T_acc from measured storage calls (the integration
  test takes half the gap between storage and direct expert handler times).
- ``T_warm`` (:func:`warm_call_s`): the wall time per warm ``direct`` expert call on a
  one-worker backend (replicas run one after another): invoke round trip, payload
  (de)serialisation and the handler's own overhead. The model has no separate per-call
  overhead term; ``T_warm`` is its only per-call constant, so it carries all of that.
- ``U_j`` stays the compute profile's (``profiles.cache.profile_for``).

:func:`calibrated_platform` puts these into a ``PlatformSpec`` (through
``sim.config.apply_calibration`` for the store and network blocks).
:func:`one_worker_layer_latency` is the model's per-replica times (eqs. 6, 8, 10) composed
the way a one-worker backend with warm instances runs them; see its docstring for each
departure from eqs. 7, 9, 11.

Units: seconds, bytes, bytes/s.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moefleet.plan.costmodel import Rates, replica_time
from moefleet.plan.plan import METHOD_CODES, DeploymentPlan
from moefleet.plan.problem import PlanningProblem
from moefleet.platform import ObjectStore
from moefleet.platform.spec_blocks import Startup
from moefleet.platform.specs import PlatformSpec


@dataclass(frozen=True)
class StoreTiming:
    """Measured store: the model's ``access_s`` (T_acc) and ``bandwidth`` (B_s), plus the
    small-object PUT and GET times they were made from."""

    access_s: float
    bandwidth_bytes_per_s: float
    put_s: float
    get_s: float


def _median_s(fn: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_store(store: ObjectStore, *, hidden: int, small_tokens: int = 12,
                  large_tokens: int = 4096, repeats: int = 15,
                  prefix: str = "calibrate-store") -> StoreTiming:
    """Time PUT/GET of packed ``(tokens, hidden)`` fp32 objects (what a scatter writes)."""
    from moefleet.runtime.payload import pack

    out: dict[int, tuple[float, float, int]] = {}
    for n in (small_tokens, large_tokens):
        blob = pack({"x": torch.zeros(n, hidden)})
        key = f"{prefix}/{n}"
        put = _median_s(lambda b=blob, k=key: store.put(k, b), repeats)
        get = _median_s(lambda k=key: store.get(k), repeats)
        store.delete(key)
        out[n] = (put, get, len(blob))
    (ps, gs, bs), (pl, gl, bl) = out[small_tokens], out[large_tokens]
    per_access = ((pl + gl) - (ps + gs)) / 2
    bandwidth = (bl - bs) / per_access if per_access > 0 else math.inf
    return StoreTiming((ps + gs) / 2, min(bandwidth, 1e12), ps, gs)


def warm_call_s(experts_s: Sequence[float], invocations: Sequence[int]) -> float:
    """T_warm from one-worker ``direct`` layers: their experts' wall time per call."""
    calls = sum(invocations)
    if calls <= 0:
        raise ValueError("no expert invocations to calibrate from")
    return sum(experts_s) / calls


def calibrated_platform(spec: PlatformSpec, *, warm_s: float, store: StoreTiming,
                        function_bandwidth_bytes_per_s: float) -> PlatformSpec:
    """``spec`` with the measured T_warm, T_acc, B_s and B_f (prices unchanged)."""
    from moefleet.sim.config import Calibration, SimConfig, apply_calibration

    cal = Calibration(function_bandwidth_bytes_per_s=function_bandwidth_bytes_per_s,
                      storage_access_s=store.access_s,
                      storage_bandwidth_bytes_per_s=store.bandwidth_bytes_per_s)
    new, _ = apply_calibration(spec, SimConfig(), cal)
    cold = spec.startup.cold_start_s if spec.startup is not None else 0.0
    return new.model_copy(update={"startup": Startup(cold_start_s=cold, warm_start_s=warm_s)})


def one_worker_layer_latency(problem: PlanningProblem, plan: DeploymentPlan, li: int) -> float:
    """MoE-E2E of layer ``li`` as a one-worker backend with warm instances runs it.

    Same per-replica times as ``costmodel.replica_time`` (eqs. 6, 8, 10), three
    departures from eqs. 7, 9, 11, each a property of that backend, not a fit:
    1. replicas run one after another: Σ_i t_rep instead of max_i t_rep;
    2. warm instances hold their parameters: T_head = T_warm (no T_acc + P/B_s), and the
       gathering function is warm too: T_load = T_warm (no parameter download);
    3. for a = 1, 2 the gate's scatter upload, T_acc + Σ_i d·D_in/B_s, which eqs. 7/9
       leave out, is added (the executor's moe_s includes it).
    """
    rates = Rates.of(problem)
    lp = plan.layers[li]
    a, beta = METHOD_CODES[lp.method], lp.beta
    d = problem.counts(li)
    total, r_max = 0.0, 0
    for i, ec in enumerate(lp.experts):
        if d[i] == 0:
            continue
        r = math.ceil(int(d[i]) / ec.replicas)
        u = problem.per_token_s(li, ec.memory_mb)
        t = float(replica_time(a, r, u, rates.warm_s, beta, rates, problem.bytes_in,
                               problem.bytes_out))
        total += ec.replicas * t
        r_max = max(r_max, r)
    if a == 3:
        return total + r_max * problem.bytes_out / rates.bf + rates.warm_s
    moved = float(d.sum())
    scatter = rates.acc_s + moved * problem.bytes_in / rates.bs
    gather = rates.warm_s + rates.acc_s + moved * problem.bytes_out / rates.bs
    return scatter + total + gather


__all__ = ["StoreTiming", "calibrated_platform", "measure_store", "one_worker_layer_latency",
           "warm_call_s"]
