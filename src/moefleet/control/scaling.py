"""Scaling controllers: the window they observe, the configs they decide, their bounds.

A scaling controller is called once per control interval: it reads a
:class:`MetricsSnapshot` (per-function utilisation, concurrency, tail latency, token and
request shares over the last interval) and returns new :class:`FunctionConfig` values
for the functions it wants changed. It never touches the system; the driver applies the
decisions, with realistic delays. Bounds, hysteresis, decision delays and the memory
floor are wrappers (:mod:`.wrappers`), the same for every controller.

Units: seconds, MB, tokens, requests. Invariants: every config has ``memory_mb > 0``,
``replicas >= 1``, ``concurrency >= 1`` and ``0 <= gpu_share <= 1``; an empty snapshot
(no functions) is valid and yields no decisions.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from moefleet.control.base import ControlError

PolicyState = Any  # an immutable value chosen by the policy (None, a tuple, a frozen dataclass)


@dataclass(frozen=True, slots=True)
class FunctionConfig:
    """How one function is deployed right now.

    ``replicas``: on a pod-style platform the instances the function runs on (sMoE's
    phi_rep); on an on-demand platform, where instances follow the load by themselves,
    the invocations an expert call's tokens are split over (ODS/BO's g).
    ``concurrency``: calls one instance runs at once (sMoE's phi_crr; Lambda allows 1).
    ``gpu_share``: the fraction of one GPU each instance holds (0 = CPU only; an
    MPS-style slice otherwise, so a call's GPU work takes 1 / share as long as on the
    whole card). Which shares a platform offers is the platform's business
    (``PlatformSpec.check_gpu_share``); here only 0 <= share <= 1 holds.
    """

    memory_mb: int
    replicas: int = 1
    concurrency: int = 1
    gpu_share: float = 0.0

    def __post_init__(self) -> None:
        if self.memory_mb <= 0 or self.replicas < 1 or self.concurrency < 1:
            raise ControlError(
                f"invalid function config {self}",
                "memory_mb > 0, replicas >= 1 and concurrency >= 1 are required",
            )
        share = self.gpu_share
        if isinstance(share, bool) or not isinstance(share, int | float) or not (
                math.isfinite(share) and 0.0 <= share <= 1.0):
            raise ControlError(f"invalid function config {self}: gpu_share {share!r}",
                                 "gpu_share is a fraction of one GPU in [0, 1] (0 = CPU only)")


Decisions = dict[str, FunctionConfig]  # function name -> its new configuration


@dataclass(frozen=True, slots=True)
class FunctionMetrics:
    """One function over the last interval (counters) and at the snapshot (gauges).

    ``busy_s`` sums call time (start delay + handler) of calls that finished in the
    interval; ``instance_s`` is alive-instance time in the interval. ``utilisation`` =
    busy_s / (instance_s x concurrency), the share of instance slots in use (0..1).
    ``capacity_tokens_per_s`` is what one instance computes per second at its memory
    (from the compute profile, transfers excluded). Shares are within the function's
    MoE layer (0 for segments): token share = its tokens / the layer's tokens; request
    share = passes that routed >= 1 token to it / the layer's passes.
    """

    name: str
    kind: Literal["segment", "expert"]
    layer: int
    expert: int | None
    config: FunctionConfig
    instances: int = 0
    in_flight: int = 0
    queued: int = 0
    calls: int = 0
    tokens: int = 0
    cold_starts: int = 0
    busy_s: float = 0.0
    instance_s: float = 0.0
    p95_latency_s: float = 0.0
    token_share: float = 0.0
    request_share: float = 0.0
    capacity_tokens_per_s: float = 0.0
    interval_s: float = 1.0

    @property
    def utilisation(self) -> float:
        slots = self.instance_s * self.config.concurrency
        return min(1.0, self.busy_s / slots) if slots > 0 else 0.0

    @property
    def mean_concurrency(self) -> float:
        """Mean calls in flight over the interval (Little's law: busy_s / interval)."""
        return self.busy_s / self.interval_s

    @property
    def concurrency_utilisation(self) -> float:
        """In-flight calls / (instances x concurrency) at the snapshot instant."""
        slots = self.instances * self.config.concurrency
        return self.in_flight / slots if slots else (1.0 if self.in_flight else 0.0)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.interval_s

    @property
    def calls_per_s(self) -> float:
        return self.calls / self.interval_s


@dataclass(frozen=True, slots=True)
class LayerMetrics:
    """One MoE layer over the interval, from its experts' :class:`FunctionMetrics`.

    ``routing_entropy`` = -sum(token_share x ln token_share) over its experts (0 = all
    tokens to one expert); ``latency_variance_s2`` = population variance of the experts'
    P95 latencies; ``straggler_ratio`` per expert = its P95 / the layer's largest P95
    (1 = the straggler; 0 when no expert ran); ``gflops`` = tokens x FLOPs per token
    / 1e9 when the caller knows FLOPs per token, else 0.
    """

    layer: int
    tokens: int
    token_share: Mapping[str, float]
    request_share: Mapping[str, float]
    routing_entropy: float
    latency_variance_s2: float
    straggler_ratio: Mapping[str, float]
    gflops: float = 0.0


def layer_metrics(functions: Mapping[str, FunctionMetrics],
                  flops_per_token: Mapping[int, float] | None = None) -> dict[int, LayerMetrics]:
    """Layer-level metrics of every MoE layer that has expert functions."""
    by_layer: dict[int, list[FunctionMetrics]] = {}
    for m in functions.values():
        if m.kind == "expert":
            by_layer.setdefault(m.layer, []).append(m)
    out: dict[int, LayerMetrics] = {}
    for layer, ms in sorted(by_layer.items()):
        lat = [m.p95_latency_s for m in ms]
        mean = sum(lat) / len(lat)
        worst = max(lat)
        tokens = sum(m.tokens for m in ms)
        out[layer] = LayerMetrics(
            layer=layer, tokens=tokens,
            token_share={m.name: m.token_share for m in ms},
            request_share={m.name: m.request_share for m in ms},
            routing_entropy=-sum(m.token_share * math.log(m.token_share) for m in ms
                                 if m.token_share > 0),
            latency_variance_s2=sum((x - mean) ** 2 for x in lat) / len(lat),
            straggler_ratio={m.name: (m.p95_latency_s / worst if worst > 0 else 0.0)
                             for m in ms},
            gflops=tokens * (flops_per_token or {}).get(layer, 0.0) / 1e9)
    return out


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """The whole deployment at time ``t_s`` (seconds since the run started)."""

    t_s: float
    interval_s: float
    functions: Mapping[str, FunctionMetrics]
    arrivals: int = 0
    completions: int = 0
    in_flight_requests: int = 0
    p95_latency_s: float = 0.0
    slo_s: float | None = None
    slo_violation_rate: float = 0.0

    @property
    def request_rate_rps(self) -> float:
        return self.arrivals / self.interval_s

    def config(self, name: str) -> FunctionConfig:
        return self.functions[name].config

    def layers(self, flops_per_token: Mapping[int, float] | None = None
               ) -> dict[int, LayerMetrics]:
        """Layer-level metrics (token/request share, routing entropy, latency variance,
        straggler ratio, FLOPs) of each MoE layer; see :func:`layer_metrics`."""
        return layer_metrics(self.functions, flops_per_token)


class ScalingController(ABC):
    """A :class:`~moefleet.control.base.Controller` over function configurations:
    ``decide(snapshot, state) -> (decisions, state)``; must not mutate ``state`` or the
    snapshot. The sMoE RL controller, HPA, ElasticMoE, FaaSConf-like and static plans
    are scaling controllers; the simulator (``Simulator(controller=...)``) and the
    runtime control loop (``runtime.control.ControlLoop``) drive the same objects.
    """

    name: str = "policy"

    def initial_state(self) -> PolicyState:
        return None

    def deployed_configs(self) -> Decisions:
        """Configs this controller's plan is *deployed* with, before the run starts (a
        planner's fixed plan); empty for controllers that act only through decisions."""
        return {}

    @abstractmethod
    def decide(self, snapshot: MetricsSnapshot, state: PolicyState) -> tuple[Decisions,
                                                                             PolicyState]:
        """New configs for the functions to change (others keep theirs), and the state."""


class StaticPolicy(ScalingController):
    """Never changes anything: the deployment plan as written (ServerlessMoE baseline)."""

    name = "static"

    def decide(self, snapshot: MetricsSnapshot, state: PolicyState) -> tuple[Decisions,
                                                                             PolicyState]:
        return {}, state


# ------------------------------------------------------------------ bounds


@dataclass(frozen=True)
class ScalingBounds:
    """Limits every emitted config obeys. ``memory_options_mb`` empty = any memory;
    otherwise a wanted size is rounded up to the next option (clamped to the largest)."""

    min_replicas: int = 1
    max_replicas: int = 8
    min_concurrency: int = 1
    max_concurrency: int = 10
    memory_options_mb: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ControlError(
                f"replica bounds {self.min_replicas}..{self.max_replicas} are invalid",
                "need 1 <= min_replicas <= max_replicas",
            )
        if not 1 <= self.min_concurrency <= self.max_concurrency:
            raise ControlError(
                f"concurrency bounds {self.min_concurrency}..{self.max_concurrency} are invalid",
                "need 1 <= min_concurrency <= max_concurrency",
            )
        if list(self.memory_options_mb) != sorted(set(self.memory_options_mb)):
            raise ControlError("memory_options_mb must be strictly increasing")

    def clamp(self, cfg: FunctionConfig) -> FunctionConfig:
        mem = cfg.memory_mb
        opts = self.memory_options_mb
        if opts:
            mem = next((m for m in opts if m >= mem), opts[-1])
        return FunctionConfig(
            memory_mb=mem,
            replicas=min(max(cfg.replicas, self.min_replicas), self.max_replicas),
            concurrency=min(max(cfg.concurrency, self.min_concurrency), self.max_concurrency),
            gpu_share=cfg.gpu_share,  # the platform bounds it (PlatformSpec.clamp_gpu_share)
        )
