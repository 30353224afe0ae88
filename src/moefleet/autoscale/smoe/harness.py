"""One harness for sMoE, its ablations and the baselines: the same model, platform,
plan, workload windows and cost accounting for every controller.

Scenario: a ``synthetic:`` model (or any profile) on ``openfaas-k8s`` (pods: a
function has at most ``replicas`` instances, each running up to ``concurrency`` calls),
encoder-style requests (one pass of ``prompt_tokens``), the ODS plan at the SLO as the
starting deployment (ServerlessMoE's static configuration). Cost of an interval =
sum over functions of alive-instance seconds x the platform's price per second of the
function's memory (and the vCPUs it implies): a pod holds its request while alive. This
is the cost every controller is compared on (``IntervalLog``); the simulator's own
per-call bill is reported beside it.

Routing: ``uniform`` (every expert of a layer equally likely: the first scenario) or
``skewed`` — a real routing trace of a zoo model (:class:`moefleet.sim.TraceRowRouter`:
each pass draws recorded tokens' top-k rows, so the trace's expert popularity and its
joint top-k structure carry over). The trace must have the scenario model's MoE layers,
experts per layer and top-k; anything else is an error naming both shapes.

Workloads: Azure Functions 2019 windows of one pattern (slow / normal / bursty by
inter-arrival CV, :func:`moefleet.workloads.windows.find_windows`), rescaled to
``mean_rps`` so that every pattern loads the pipeline alike.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moefleet.autoscale.errors import AutoscaleError
from moefleet.control import (
    Decisions,
    FunctionConfig,
    MetricsSnapshot,
    PolicyState,
    ScalingController,
)
from moefleet.plan.plan import DeploymentPlan
from moefleet.platform.catalog import load_platform
from moefleet.platform.specs import PlatformSpec
from moefleet.profiles.model import ComputeProfile
from moefleet.sim.routing import DistributionRouter, Router, router_from_trace
from moefleet.sim.synthetic import parse_synthetic
from moefleet.workloads.base import Arrival
from moefleet.workloads.windows import FunctionWindow, find_windows

DEFAULT_MODEL = "synthetic:blocks=4,experts=8,top_k=2,hidden=512,decoder=0"


@dataclass
class Scenario:
    model: str
    profile: ComputeProfile
    spec: PlatformSpec
    plan: DeploymentPlan
    slo_s: float
    interval_s: float = 10.0
    prompt_tokens: int = 64
    top_k: int = 2
    segment_replicas: int = 2  # the static plan's segment pods (the plan has no field)
    router: Router | None = None  # None = uniform routing
    routing_trace: str = ""  # the Parquet trace behind ``router`` ("" = uniform)

    def routing(self) -> Router:
        """The scenario's expert routing (uniform when it has no trace)."""
        if self.router is not None:
            return self.router
        return DistributionRouter.uniform([len(lp.experts) for lp in self.plan.layers],
                                          self.top_k)

    def price_per_s(self, memory_mb: int, gpu_share: float = 0.0) -> float:
        """USD per second of one pod of this size (GPU share x the GPU price included)."""
        return self.spec.compute_cost(memory_mb, 1.0, None, gpu_share)


def build_scenario(model: str = DEFAULT_MODEL, *, slo_s: float = 0.3,
                   platform: str = "openfaas-k8s", interval_s: float = 10.0,
                   prompt_tokens: int = 64, segment_memory_mb: int = 4096,
                   expert_memory_mb: int = 1024, replicas: int = 2,
                   segment_replicas: int = 2, routing_trace: str = "") -> Scenario:
    """The scenario. The starting plan is uniform (``segment_memory_mb`` per segment,
    ``expert_memory_mb`` x ``replicas`` per expert; ``segment_replicas`` segment pods),
    and it is the ``static`` baseline; the popularity-aware ``static-pop`` baseline is
    searched offline by :func:`moefleet.autoscale.smoe.popularity.search_static_pop`.
    (The ODS plan, solved for on-demand invocations, is reported
    separately by the benchmark: its small experts are not a pod deployment.)
    ``routing_trace`` (a Parquet routing trace) replaces uniform routing (module doc)."""
    if not (math.isfinite(interval_s) and interval_s > 0):
        raise AutoscaleError(f"control interval must be > 0 s, got {interval_s!r}",
                             "pass e.g. --interval 10")
    if not (math.isfinite(slo_s) and slo_s > 0):
        raise AutoscaleError(f"SLO must be > 0 s, got {slo_s!r}", "pass e.g. --slo 0.3")
    synth = parse_synthetic(model)
    profile = synth.profile()
    spec = load_platform(platform)
    experts = [synth.experts] * len(profile.moe_layers)
    plan = DeploymentPlan.uniform(synth.name, spec.name, list(profile.moe_layers), experts,
                                  len(profile.segments), expert_memory_mb, "direct",
                                  replicas=replicas, segment_memory_mb=segment_memory_mb,
                                  policy="static")
    router = load_routing(routing_trace, experts, synth.top_k) if routing_trace else None
    return Scenario(synth.name, profile, spec, plan, slo_s, interval_s, prompt_tokens,
                    synth.top_k, segment_replicas, router, routing_trace)


def load_routing(path: str, experts: list[int], top_k: int) -> Router:
    """A per-token router replaying the trace at ``path``; its shape must be the
    scenario model's (MoE layers x experts, top-k)."""
    from pathlib import Path

    from moefleet.traces.schema import read_trace

    if not Path(path).is_file():
        raise AutoscaleError(f"no routing trace at {path}",
                             "record one with the zoo model of the scenario's shape (e.g. "
                             "tiny-moe-lm for 4 x 8 top-2): moefleet profile --model MODEL "
                             "--dataset sharegpt:train --max-tokens 16384 --no-attention-ids "
                             f"--out {path}")
    router = router_from_trace(read_trace(path), "rows")
    if router.num_experts != experts or router.top_k != top_k:
        raise AutoscaleError(
            f"routing trace {path} has experts per layer {router.num_experts} top-{router.top_k};"
            f" the scenario model has {experts} top-{top_k}",
            "record the trace with a model of the scenario's shape or pass a matching --model")
    return router


def unloaded_latency_s(sc: Scenario, requests: int = 20, gap_s: float = 30.0,
                       seed: int = 0) -> float:
    """Median end-to-end latency of the starting plan when requests never overlap
    (one every ``gap_s``, instances pre-warmed): the pipeline's own latency under the
    scenario's routing, with no queueing."""
    arrivals = [Arrival(gap_s * (i + 1), f"unloaded-{i}", prompt_tokens=sc.prompt_tokens)
                for i in range(requests)]
    res = run_episode(sc, None, arrivals, gap_s * (requests + 1), seed=seed)
    return float(res["p50_s"])


def pattern_windows(pattern: str, *, minutes: int, limit: int | None = None,
                    path: str | None = None) -> list[FunctionWindow]:
    """Windows of a pattern, at least one arrival per minute on average; a pattern with
    none is an error naming it."""
    found = find_windows(pattern, window_minutes=minutes, min_arrivals=max(60, minutes),  # type: ignore[arg-type]
                         path=path)
    if not found:
        raise AutoscaleError(f"no {minutes}-minute Azure Functions windows with pattern "
                             f"{pattern!r}", "use slow, normal or bursty")
    return found if limit is None else found[:limit]


def window_arrivals(w: FunctionWindow, mean_rps: float, seed: int,
                    path: str | None = None) -> tuple[list[Arrival], float]:
    """The window's arrivals rescaled to ``mean_rps`` on average, and its duration."""
    duration = w.minutes * 60.0
    scale = mean_rps * duration / max(w.arrivals, 1)
    return w.workload(path, scale=scale).arrivals(duration, seed), duration


@dataclass
class IntervalLog:
    """What the harness records at every control interval (one row per snapshot)."""

    t_s: list[float] = field(default_factory=list)
    cost_usd: list[float] = field(default_factory=list)
    p95_s: list[float] = field(default_factory=list)
    completions: list[int] = field(default_factory=list)
    decide_s: list[float] = field(default_factory=list)
    # alive-instance seconds by function kind and GPU share ("0" = CPU only)
    pod_s: dict[str, dict[str, float]] = field(default_factory=dict)


class Recorder(ScalingController):
    """Wraps a controller: logs the interval's provisioned cost and P95, times the
    decision, and (``initial``) applies the static plan's segment pods once first."""

    def __init__(self, inner: ScalingController | None,
                 price_per_s: Callable[[int, float], float],
                 initial: Decisions | None = None) -> None:
        self.inner = inner
        self.price_per_s = price_per_s
        self.initial = dict(initial or {})
        self.log = IntervalLog()
        self.name = inner.name if inner is not None else "static"

    def initial_state(self) -> PolicyState:
        return (False, self.inner.initial_state() if self.inner is not None else None)

    def decide(self, snapshot: MetricsSnapshot, state: PolicyState) -> tuple[Decisions,
                                                                             PolicyState]:
        started, inner_state = state
        log = self.log
        log.t_s.append(snapshot.t_s)
        log.cost_usd.append(sum(m.instance_s * self.price_per_s(m.config.memory_mb,
                                                                m.config.gpu_share)
                                for m in snapshot.functions.values()))
        log.p95_s.append(snapshot.p95_latency_s)
        for m in snapshot.functions.values():
            by_share = log.pod_s.setdefault(m.kind, {})
            key = f"{m.config.gpu_share:g}"
            by_share[key] = by_share.get(key, 0.0) + m.instance_s
        log.completions.append(snapshot.completions)
        out: Decisions = {}
        if not started and self.initial:
            out.update({k: v for k, v in self.initial.items()
                        if k in snapshot.functions and snapshot.functions[k].config != v})
        if self.inner is not None:
            t0 = time.perf_counter()
            dec, inner_state = self.inner.decide(snapshot, inner_state)
            log.decide_s.append(time.perf_counter() - t0)
            out.update(dec)
        # An empty snapshot (no functions yet) has nothing to start: try again next time.
        return out, (started or bool(snapshot.functions), inner_state)


def segment_start(sc: Scenario) -> Decisions:
    """The static plan's segment configs with its segment pods (the plan stores only
    their memory)."""
    return {f.name: FunctionConfig(f.memory_mb, sc.segment_replicas, 1)
            for f in sc.plan.placement().segments}


def deployed_at_start(sc: Scenario, controller: ScalingController | None) -> Decisions:
    """A fixed plan (``controller.deployed_configs()``, e.g. static-pop) is *deployed*,
    not reconfigured: the configs whose memory or GPU share differ from the starting
    plan's run from t = 0 (a change of either would restart those functions cold at the
    first interval, which a planner's deployment never pays). Replica and concurrency
    changes still go through the first decision, as before."""
    configs = controller.deployed_configs() if controller is not None else {}
    start = {f.name: f.memory_mb for f in sc.plan.placement().functions}
    return {n: c for n, c in configs.items()
            if n in start and (c.memory_mb != start[n] or c.gpu_share > 0)}


def run_episode(sc: Scenario, controller: ScalingController | None, arrivals: list[Arrival],
                duration_s: float, seed: int = 0) -> dict[str, Any]:
    """Simulate one window under ``controller`` (None = the static plan); returns cost,
    P95 over the whole window, per-interval P95s and decision latencies."""
    from moefleet.sim import SimConfig, Simulator

    initial = deployed_at_start(sc, controller)
    rec = Recorder(controller, sc.price_per_s,
                   {k: v for k, v in segment_start(sc).items() if k not in initial})
    cfg = SimConfig(scaling="replicas", keep_alive_s=1e9, prompt_tokens=sc.prompt_tokens,
                    slo_s=sc.slo_s, interval_s=sc.interval_s, apply_delay_s=1.0,
                    prewarm=True)
    sim = Simulator(sc.plan, sc.profile, sc.spec, router=sc.routing(), config=cfg, controller=rec,
                    seed=seed, decoder=False, initial=initial)
    res = sim.run(arrivals, duration_s)
    log = rec.log
    served = [(t, p) for t, p, c in zip(log.t_s, log.p95_s, log.completions, strict=True)
              if c > 0]
    return {
        "cost_usd": float(sum(log.cost_usd)),
        "sim_billed_usd": float(res.cost_usd),
        "p95_s": float(res.latency["p95"] or 0.0),
        "p50_s": float(res.latency["p50"] or 0.0),
        "window_p95_s": [p for _, p in served],  # per control interval that served
        "window_t_s": [t for t, _ in served],  # ... and the end of each such interval
        "completed": int(res.requests["completed"]),
        "arrived": len(arrivals),
        "decide_s": log.decide_s,
        "intervals": len(log.t_s),
        "pod_s_by_gpu_share": log.pod_s,
    }
