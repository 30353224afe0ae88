"""Popularity-aware plans: the ``static-pop`` baseline and the warm start's demonstrator.

One rule (:class:`PopRule`) turns an expert function's *load factor* (its token share
within its MoE layer x the layer's number of expert functions; 1.0 = a uniform share)
into replicas: ``clamp(round(rho x load), 1, max_replicas)`` (half up). Memory stays
the starting plan's, expert concurrency is 1, and every segment function gets ``segment``. So
``rho`` is the replicas a function of mean popularity gets; a hot expert gets more than
a cold one, and only where the rule says so.

- ``static-pop`` (a baseline: what ServerlessMoE's ODS would deploy from *predicted*
  popularity): the rule applied once to the shares of the *training part* of the
  routing trace (:func:`predicted_shares`: the first half of its recorded requests),
  never to what the evaluation windows route. ``rho`` and the segment config are
  chosen like a planner would, offline: :func:`search_static_pop` takes the cheapest
  candidate whose P95 stays within 1.02 x SLO on every *training* window (the uniform
  starting plan when none does). ODS itself solves for on-demand invocations (no pod
  replicas), so this search stands in for it on the pod platform (an emulation of its
  idea, not its solver).
- :class:`PopularityDemonstrator`: the same rule on the shares the *snapshot observed*
  (an exponential average over intervals; a layer that routed nothing in an interval
  keeps its average, so idle gaps between bursts do not scale the hot experts down).
  It is a teacher for the warm start (``train.py``): its decisions label every state
  the learner sees; the learned actor acts, never this rule.

GPU shares: in a space with a GPU axis the rule may also put every expert on a slice
(``expert_gpu``) and the segment config may carry one; :func:`candidate_rules` then adds
those candidates (a bounded set, listed there), so ``static-pop`` and the teacher can
use the knob, chosen by the same search on training windows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moefleet.autoscale.errors import AutoscaleError
from moefleet.autoscale.smoe.harness import Scenario, run_episode
from moefleet.control import (
    Decisions,
    FunctionConfig,
    MetricsSnapshot,
    PolicyState,
    ScalingController,
)
from moefleet.sim.routing import DistributionRouter, TraceRowRouter

TRAIN_FRACTION = 0.5  # share of the trace's requests the prediction may read
SLACK = 1.02  # the bar's P95 slack, also the planner's constraint
RHOS = (1.0, 1.25, 1.5, 2.0)


@dataclass(frozen=True)
class PopRule:
    """Replicas from load factors (module doc); ``segment`` = every segment's config."""

    rho: float
    segment: FunctionConfig
    max_replicas: int = 8
    expert_gpu: float = 0.0  # every expert's GPU share (0 = CPU only)
    expert_memory_mb: int = 0  # every expert's memory (0 = keep the deployment's)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rho) and self.rho > 0) or self.max_replicas < 1:
            raise AutoscaleError(f"popularity rule rho {self.rho!r} must be > 0 and "
                                 f"max_replicas {self.max_replicas} >= 1")
        if not 0.0 <= self.expert_gpu <= 1.0:
            raise AutoscaleError(f"popularity rule expert_gpu {self.expert_gpu!r} must be "
                                 "in [0, 1]")

    def replicas(self, load: float) -> int:
        # Half up (not Python's half-to-even): 2.5 x mean load is 3 replicas.
        return min(self.max_replicas, max(1, math.floor(self.rho * load + 0.5)))

    def config(self, current: FunctionConfig, kind: str, load: float) -> FunctionConfig:
        if kind == "segment":
            return self.segment
        return FunctionConfig(self.expert_memory_mb or current.memory_mb, self.replicas(load),
                              1, self.expert_gpu)

    def label(self) -> str:
        s = self.segment
        gpu = (f" seg-gpu={s.gpu_share:g}" if s.gpu_share else "") + (
            f" exp-gpu={self.expert_gpu:g}" if self.expert_gpu else "") + (
            f" exp-mem={self.expert_memory_mb}" if self.expert_memory_mb else "")
        return f"rho={self.rho:g} seg={s.memory_mb}x{s.replicas}c{s.concurrency}{gpu}"


def predicted_shares(sc: Scenario, train_fraction: float = TRAIN_FRACTION
                     ) -> dict[str, float]:
    """Expert function name -> predicted token share within its layer. A trace router:
    slots of the first ``train_fraction`` of the trace's requests (by request id, so
    the split is fixed); a distribution router: its probabilities."""
    if not 0 < train_fraction <= 1:
        raise AutoscaleError(f"train_fraction must be in (0, 1], got {train_fraction!r}")
    router = sc.routing()
    per_layer: list[np.ndarray] = []
    if isinstance(router, TraceRowRouter):
        n = max(1, int(len(router.request_index) * train_fraction))
        per_layer = [t[:n].sum(axis=0).astype(np.float64) for t in router.replay_RE]
    elif isinstance(router, DistributionRouter):
        per_layer = [p.copy() for p in router.p_LE]
    else:
        raise AutoscaleError(f"cannot predict popularity from a {type(router).__name__}",
                             "use a routing trace or a distribution router")
    placement = sc.plan.placement()
    out: dict[str, float] = {}
    for li, layer in enumerate(sc.profile.moe_layers):
        slots = per_layer[li]
        total = float(slots.sum()) or 1.0
        for f in placement.expert_functions(layer):
            out[f.name] = float(sum(slots[e] for e in f.experts)) / total
    return out


def load_factors(shares: Mapping[str, float], layer_of: Mapping[str, int]
                 ) -> dict[str, float]:
    """Share x number of functions in the share's layer (1.0 = uniform)."""
    count: dict[int, int] = {}
    for name in shares:
        count[layer_of[name]] = count.get(layer_of[name], 0) + 1
    return {n: s * count[layer_of[n]] for n, s in shares.items()}


def pop_plan(sc: Scenario, rule: PopRule, shares: Mapping[str, float]) -> Decisions:
    """Every function's config under ``rule`` for the given expert shares."""
    placement = sc.plan.placement()
    layer_of = {f.name: f.layer for f in placement.functions if f.role == "expert"
                and f.layer is not None}
    loads = load_factors(shares, layer_of)
    out: Decisions = {}
    for f in placement.functions:
        if f.role == "main":  # not part of the pod pipeline sMoE scales
            continue
        cur = FunctionConfig(f.memory_mb, f.replicas, 1)
        out[f.name] = rule.config(cur, "segment" if f.role == "segment" else "expert",
                                  loads.get(f.name, 1.0))
    return out


class PlanPolicy(ScalingController):
    """Deploys fixed per-function configs at the first decision and never changes them
    again (a static plan other than the starting one)."""

    def __init__(self, name: str, configs: Decisions) -> None:
        self.name, self.configs = name, dict(configs)

    def decide(self, snapshot: MetricsSnapshot, state: PolicyState) -> tuple[Decisions,
                                                                             PolicyState]:
        if state:  # applied already: a static plan stays put
            return {}, state
        return ({n: c for n, c in self.configs.items()
                 if n in snapshot.functions and snapshot.functions[n].config != c}, True)

    def initial_state(self) -> PolicyState:
        return False

    def deployed_configs(self) -> Decisions:
        return dict(self.configs)


class PopularityDemonstrator(ScalingController):
    """The rule on observed shares, averaged over intervals (module doc). State: a
    tuple of (function, averaged share) pairs (immutable)."""

    name = "pop-demo"

    def __init__(self, rule: PopRule, smoothing: float = 0.5) -> None:
        if not 0 < smoothing <= 1:
            raise AutoscaleError(f"smoothing must be in (0, 1], got {smoothing!r}")
        self.rule, self.smoothing = rule, smoothing

    def initial_state(self) -> PolicyState:
        return ()

    def decide(self, snapshot: MetricsSnapshot, state: PolicyState) -> tuple[Decisions,
                                                                             PolicyState]:
        avg = dict(state or ())
        fm = snapshot.functions
        routed: dict[int, int] = {}
        for m in fm.values():
            if m.kind == "expert":
                routed[m.layer] = routed.get(m.layer, 0) + m.tokens
        for name, m in fm.items():
            if m.kind == "expert" and routed[m.layer] > 0:
                old = avg.get(name)
                avg[name] = (m.token_share if old is None
                             else old + self.smoothing * (m.token_share - old))
        loads = load_factors({n: s for n, s in avg.items() if n in fm},
                             {n: fm[n].layer for n in avg if n in fm})
        out: Decisions = {}
        for name, m in fm.items():
            if m.kind == "expert" and name not in loads:
                continue  # nothing observed yet: keep the deployment
            want = self.rule.config(m.config, m.kind, loads.get(name, 1.0))
            if want != m.config:
                out[name] = want
        return out, tuple(sorted(avg.items()))


def candidate_rules(sc: Scenario, rhos: Sequence[float] = RHOS,
                    max_replicas: int = 8,
                    gpu_shares: Sequence[float] = (0.0,)) -> list[PopRule]:
    """The planner's candidates: each rho with one segment pod at concurrency 2 or the
    starting plan's segment pods at concurrency 1 (segment memory unchanged). With GPU
    shares s > 0 in ``gpu_shares`` (bounded, rho 1 and one segment pod at concurrency 2
    each, so the search stays minutes): the CPU answer to a tight SLO, experts at 2x and
    4x their memory; and per share, segments on s with experts as deployed or at 2x
    memory, and every expert on s at 2x memory (a GPU function's host also holds the
    CUDA runtime, see ``ConfigSpace``)."""
    mem = sc.plan.placement().segments[0].memory_mb
    exp_mem = sc.plan.placement().expert_functions(sc.profile.moe_layers[0])[0].memory_mb
    segs = (FunctionConfig(mem, 1, 2), FunctionConfig(mem, sc.segment_replicas, 1))
    out = [PopRule(r, s, max_replicas) for s in segs for r in rhos]
    shares = [x for x in gpu_shares if x > 0]
    if shares:
        out += [PopRule(1.0, segs[0], max_replicas, expert_memory_mb=k * exp_mem)
                for k in (2, 4)]
    for g in shares:
        seg_gpu = FunctionConfig(mem, 1, 2, g)
        out += [PopRule(1.0, seg_gpu, max_replicas),
                PopRule(1.0, seg_gpu, max_replicas, expert_memory_mb=2 * exp_mem),
                PopRule(1.0, segs[0], max_replicas, g, expert_memory_mb=2 * exp_mem)]
    return out


Episode = tuple[list[Any], float]


def search_static_pop(sc: Scenario, episodes: Sequence[Episode],
                      rules: Sequence[PopRule], seed0: int = 10_000,
                      progress: Callable[[str], None] | None = None
                      ) -> tuple[PopRule | None, list[dict[str, Any]]]:
    """The cheapest rule whose static plan (on :func:`predicted_shares`) keeps P95 within
    ``SLACK`` x SLO on every episode (training windows only), or None when no rule does;
    the table of every candidate (cost relative to the starting plan, worst P95/SLO)."""
    if not episodes or not rules:
        raise AutoscaleError("the static-pop search needs training episodes and rules")
    shares = predicted_shares(sc)
    ref = [run_episode(sc, None, a, d, seed=seed0 + i)["cost_usd"]
           for i, (a, d) in enumerate(episodes)]
    table: list[dict[str, Any]] = []
    for rule in rules:
        plan = pop_plan(sc, rule, shares)
        res = [run_episode(sc, PlanPolicy("static-pop", plan), a, d, seed=seed0 + i)
               for i, (a, d) in enumerate(episodes)]
        worst = max(r["p95_s"] for r in res) / sc.slo_s
        table.append({"rule": rule.label(), "rho": rule.rho,
                      "cost_vs_static": sum(r["cost_usd"] for r in res) / sum(ref),
                      "worst_p95_over_slo": worst, "meets": worst <= SLACK})
        if progress is not None:
            progress(f"static-pop search {rule.label()}: {table[-1]['cost_vs_static']:.3f} "
                     f"worst P95/SLO {worst:.2f}")
    ok = [i for i, row in enumerate(table) if row["meets"]]
    if not ok:
        return None, table
    best = min(ok, key=lambda i: table[i]["cost_vs_static"])
    return rules[best], table
