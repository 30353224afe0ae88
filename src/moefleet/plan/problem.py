"""``PlanningProblem``: everything a planner needs, in the ODS/BO paper's quantities.

Legend: ``L`` MoE layers (index ``li`` = position in ``moe_layers``), ``E`` experts per
layer (padded to the largest layer), ``J`` memory options the planners choose from.

Units: seconds, bytes, MB (1 MB = 2**20 bytes, as the platform specs), USD.

What the problem holds (READING-NOTES, ODS/BO "eqs. 3-12"):
- model shape: blocks, MoE layers, experts per MoE layer;
- sizes: P(e,i) parameter bytes of one expert per layer, D_in / D_out activation bytes one
  token carries into / out of an expert, the intermediate memory M^inter of an expert;
- U_j (eq. 3): marginal seconds per token of one expert of each MoE layer at memory option
  j (``per_token_s_LJ``), from a compute profile at ``vcpus(mem_j)`` of the platform;
- d(e,i): predicted tokens per expert (``counts_LE``);
- the platform spec (start times, storage latency/bandwidth, payload limit, prices);
- the end-to-end time limit (the SLO), the replica limit G, the non-MoE segment times
  T^NE and the segment parameter bytes (for T_load);
- ``warm_instances`` (opt-in, default False = the paper's model): steady-state serving
  where instances already hold their parameters (no parameter download or GET per batch,
  T_warm not billed; see :mod:`moefleet.plan.costmodel`).

Invariants (checked by ``__post_init__``): all times finite and > 0 where they are
per-token times; counts are non-negative integers, zero beyond each layer's experts;
memory options are offered by the platform and ascending.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moefleet.errors import DataError, MoefleetError
from moefleet.models.shape import ModelShape
from moefleet.plan.problem_checks import check_problem
from moefleet.platform.inline import planning_inline_bytes
from moefleet.platform.specs import LinearVcpu, PlatformSpec
from moefleet.profiles.model import ComputeProfile

MB = 1 << 20  # bytes per MB (platform memory sizes are binary MB)
DEFAULT_MAX_REPLICAS = 8  # ODS/BO evaluation: "maximal possible expert replica number as 8"
MAX_MEMORY_OPTIONS = 24  # platforms with 1 MB steps get a grid of at most this many options


class InfeasibleError(MoefleetError):
    """No deployment meets the constraints (SLO, memory, payload)."""


@dataclass(frozen=True, eq=False)
class PlanningProblem:
    """One planning instance. Build it with :meth:`explicit` or :meth:`from_profile`."""

    model: str
    platform: PlatformSpec
    num_blocks: int
    moe_layers: tuple[int, ...]
    num_experts: tuple[int, ...]
    tokens: int  # tokens in the batch (every token passes every block once)
    counts_LE: np.ndarray  # d(e,i), int64, predicted tokens per expert
    expert_param_bytes: tuple[int, ...]  # P(e,i), one value per MoE layer
    bytes_in: int  # D_in per token
    bytes_out: int  # D_out per token
    memory_options_mb: tuple[int, ...]  # candidate memory sizes M_j, ascending
    per_token_s_LJ: np.ndarray  # U_j per MoE layer, seconds per token
    slo_s: float  # T_limit, end-to-end seconds
    segment_time_s: tuple[float, ...]  # T^NE per block (non-expert segment), seconds
    segment_param_bytes: tuple[int, ...]  # per block, for T_load of the next segment
    segment_memory_mb: int
    max_replicas: int = DEFAULT_MAX_REPLICAS
    intermediate_bytes: int = 0  # fixed part of M^inter (eq. 12c)
    # Measured memory (profiles.footprint): the function process's own RSS (interpreter +
    # torch + handler), and the expert's intermediate bytes per token, per MoE layer.
    runtime_bytes: int = 0
    intermediate_bytes_per_token: tuple[int, ...] = ()
    # Eq. 12f's D_P: the packet bytes a direct request/response may carry inline on the
    # strictest backend (0: derive it from the platform's limit, platform.inline).
    inline_limit_bytes: int = 0
    storage_requests: bool = True  # bill object-store PUT/GET (our addition, see costmodel)
    # B·T positions the batch's non-MoE segments compute, padding included (0: tokens);
    # known when a batch is formed (request lengths), sizes the activations (transfers).
    positions: int = 0
    # Steady-state serving: instances already hold their parameters (see load_s, costmodel).
    warm_instances: bool = False
    # U at memory sizes outside the candidates (e.g. LambdaML's 3008 MB), per MoE layer.
    extra_per_token_s: dict[int, tuple[float, ...]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_problem(self)

    # ---- derived quantities -----------------------------------------------------------
    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    def counts(self, li: int) -> np.ndarray:
        """d(e,i) of MoE layer position ``li`` (int64, length num_experts[li])."""
        return self.counts_LE[li, : self.num_experts[li]]

    @property
    def fixed_latency_s(self) -> float:
        """Σ T^NE over all blocks: the head, tail and every non-MoE segment (eq. 12d)."""
        return float(sum(self.segment_time_s))

    def load_s(self, li: int) -> float:
        """T_load of MoE layer ``li``: the next segment's warm start + parameter download
        (the warm start only with ``warm_instances``: its parameters are in memory).

        The "next non-MoE function" gathers the experts' outputs; it is block l+1's segment
        (the last block's own segment carries the tail when the MoE layer is last).
        """
        s = self.platform
        assert s.startup is not None and s.storage is not None  # faas, checked in explicit()
        if self.warm_instances:
            return s.startup.warm_start_s
        nxt = min(self.moe_layers[li] + 1, self.num_blocks - 1)
        return (
            s.startup.warm_start_s
            + s.storage.access_latency_s
            + self.segment_param_bytes[nxt] / s.storage.bandwidth_bytes_per_s
        )

    def per_token_s(self, li: int, mem_mb: int) -> float:
        """U at any memory size the problem knows (candidates and ``extra_per_token_s``)."""
        if mem_mb in self.memory_options_mb:
            return float(self.per_token_s_LJ[li, self.memory_options_mb.index(mem_mb)])
        if mem_mb in self.extra_per_token_s:
            return float(self.extra_per_token_s[mem_mb][li])
        raise MoefleetError(
            f"no per-token time known at {mem_mb} MB",
            f"plan with memory among {list(self.memory_options_mb)} MB",
        )

    @functools.cached_property
    def price_per_s_J(self) -> np.ndarray:
        """USD per billed second at each candidate memory option (memory GB-s + vCPU-s)."""
        return np.array([self.platform.compute_cost(m, 1.0) for m in self.memory_options_mb])

    @property
    def payload_limit_bytes(self) -> int:
        """D_P of eq. 12f: packet bytes a direct request may carry inline on every backend
        (the platform's synchronous limit less the strictest wire envelope, base64)."""
        if self.inline_limit_bytes:
            return self.inline_limit_bytes
        assert self.platform.limits is not None
        return planning_inline_bytes(self.platform.limits.sync_payload_bytes)

    def inter_per_token(self, li: int) -> int:
        """Intermediate bytes per token of MoE layer ``li``'s expert (0 if unmeasured)."""
        return self.intermediate_bytes_per_token[li] if self.intermediate_bytes_per_token else 0

    def with_slo(self, slo_s: float) -> PlanningProblem:
        """A copy with another end-to-end limit (everything else shared)."""
        return dataclasses.replace(self, slo_s=slo_s)

    def with_counts(self, counts_LE: np.ndarray) -> PlanningProblem:
        return dataclasses.replace(self, counts_LE=np.asarray(counts_LE, dtype=np.int64))

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def explicit(
        cls,
        *,
        model: str,
        platform: PlatformSpec,
        moe_layers: Sequence[int],
        num_experts: Sequence[int],
        num_blocks: int,
        counts_LE: np.ndarray | Sequence[Sequence[int]],
        expert_param_bytes: int | Sequence[int],
        bytes_per_token: int,
        memory_options_mb: Sequence[int],
        per_token_s: Sequence[float] | np.ndarray,
        slo_s: float,
        tokens: int | None = None,
        segment_time_s: float | Sequence[float] = 0.0,
        segment_param_bytes: int | Sequence[int] = 0,
        segment_memory_mb: int | None = None,
        max_replicas: int = DEFAULT_MAX_REPLICAS,
        intermediate_bytes: int = 0,
        storage_requests: bool = True,
        extra_per_token_s: Mapping[int, Sequence[float]] | None = None,
        top_k: int = 1,
        warm_instances: bool = False,
        runtime_bytes: int = 0,
        intermediate_bytes_per_token: int | Sequence[int] = 0,
        inline_limit_bytes: int = 0,
    ) -> PlanningProblem:
        """Explicit shapes and times. ``per_token_s`` is U_j over ``memory_options_mb``,
        either one row (all layers) or an (L, J) array. Scalars broadcast over layers/blocks.
        ``tokens`` defaults to the largest per-layer count sum divided by ``top_k``.

        ``warm_instances`` (default False: the paper's model) models steady-state serving
        where function instances already hold their parameters: no parameter download in
        T_head or T_load, no parameter GET, and T_warm not billed (costmodel docstring)."""
        if not platform.is_faas:
            raise MoefleetError(
                f"platform '{platform.name}' is a {platform.kind}; plans are for FaaS platforms",
                "pick a serverless platform (moefleet platforms list)",
            )
        n_l = len(moe_layers)
        counts = np.asarray(counts_LE)
        if counts.dtype.kind == "f":
            if not np.all(np.isfinite(counts)):
                raise DataError("counts contain NaN or infinity", "check the predictor output")
            counts = np.ceil(counts - 1e-9)  # expected counts from a predictor: round up
        counts = counts.astype(np.int64) if counts.size else counts.reshape(n_l, 0)
        u = np.asarray(per_token_s, dtype=float)
        u_lj = np.broadcast_to(u, (n_l, len(memory_options_mb))).copy() if u.ndim == 1 else u
        if tokens is None:
            tokens = max(1, math.ceil(int(counts.sum(axis=1).max(initial=0)) / max(1, top_k)))
        return cls(
            model=model,
            platform=platform,
            num_blocks=num_blocks,
            moe_layers=tuple(int(x) for x in moe_layers),
            num_experts=tuple(int(x) for x in num_experts),
            tokens=int(tokens),
            counts_LE=counts,
            expert_param_bytes=_per(expert_param_bytes, n_l, int),
            bytes_in=int(bytes_per_token),
            bytes_out=int(bytes_per_token),
            memory_options_mb=tuple(int(m) for m in memory_options_mb),
            per_token_s_LJ=u_lj,
            slo_s=float(slo_s),
            segment_time_s=_per(segment_time_s, num_blocks, float),
            segment_param_bytes=_per(segment_param_bytes, num_blocks, int),
            segment_memory_mb=segment_memory_mb or platform.baseline_memory(),
            max_replicas=max_replicas,
            intermediate_bytes=intermediate_bytes,
            runtime_bytes=int(runtime_bytes),
            intermediate_bytes_per_token=_per(intermediate_bytes_per_token, n_l, int),
            inline_limit_bytes=int(inline_limit_bytes),
            storage_requests=storage_requests,
            warm_instances=warm_instances,
            extra_per_token_s={
                k: tuple(map(float, v)) for k, v in (extra_per_token_s or {}).items()
            },
        )

    @classmethod
    def from_profile(
        cls,
        profile: ComputeProfile,
        platform: PlatformSpec,
        counts_LE: np.ndarray | Sequence[Sequence[int]],
        slo_s: float,
        *,
        model: str | None = None,
        num_experts: Sequence[int] | None = None,
        tokens: int | None = None,
        top_k: int = 1,
        memory_options_mb: Sequence[int] | None = None,
        max_replicas: int = DEFAULT_MAX_REPLICAS,
        segment_memory_mb: int | None = None,
        intermediate_bytes: int = 0,
        storage_requests: bool = True,
        warm_instances: bool = False,
        runtime_bytes: int | None = None,
        inline_limit_bytes: int = 0,
    ) -> PlanningProblem:
        """Shapes from the profile (blocks = its segments, its MoE layers) and the counts
        (experts per layer = the counts' width unless ``num_experts`` is given).
        ``warm_instances``: see :meth:`explicit`. Memory (eq. 12c) comes from the
        profile: its runtime footprint (the largest over backends, unless
        ``runtime_bytes`` is given) and its experts' intermediate bytes per token."""
        counts = np.asarray(counts_LE)
        layers = list(profile.moe_layers)
        if counts.ndim != 2 or counts.shape[0] != len(layers):
            raise DataError(
                f"counts have shape {tuple(counts.shape)}, the profile's model has "
                f"{len(layers)} MoE layers",
                "use counts and a profile of the same model",
            )
        experts = list(num_experts) if num_experts is not None else [counts.shape[1]] * len(layers)
        opts = list(memory_options_mb or candidate_memory_options(platform))
        seg_mem = segment_memory_mb or platform.baseline_memory()
        extra = sorted({platform.baseline_memory()} - set(opts))
        u_lj = np.array([[_u(profile, layer, platform, m) for m in opts] for layer in layers])
        extra_u = {m: [_u(profile, layer, platform, m) for layer in layers] for m in extra}
        if tokens is None:
            tokens = max(1, math.ceil(int(counts.sum(axis=1).max(initial=0)) / max(1, top_k)))
        seg_v = platform.vcpus(seg_mem)
        seg_t = [s.time_s(tokens, seg_v) for s in profile.segments]
        return cls.explicit(
            model=model or profile.model,
            platform=platform,
            moe_layers=layers,
            num_experts=experts,
            num_blocks=len(profile.segments),
            counts_LE=counts,
            expert_param_bytes=[profile.expert(layer).param_bytes for layer in layers],
            bytes_per_token=profile.bytes_per_token,
            memory_options_mb=opts,
            per_token_s=u_lj,
            slo_s=slo_s,
            tokens=tokens,
            segment_time_s=seg_t,
            segment_param_bytes=[s.param_bytes for s in profile.segments],
            segment_memory_mb=seg_mem,
            max_replicas=max_replicas,
            intermediate_bytes=intermediate_bytes,
            runtime_bytes=profile.footprint_bytes if runtime_bytes is None else runtime_bytes,
            intermediate_bytes_per_token=[
                profile.intermediate_bytes_per_token.get(layer, 0) for layer in layers],
            inline_limit_bytes=inline_limit_bytes,
            storage_requests=storage_requests,
            warm_instances=warm_instances,
            extra_per_token_s=extra_u,
        )

    @classmethod
    def from_summary(
        cls,
        summary: ModelShape,
        profile: ComputeProfile,
        platform: PlatformSpec,
        counts_LE: np.ndarray | Sequence[Sequence[int]],
        slo_s: float,
        **kw: Any,
    ) -> PlanningProblem:
        """Shapes from an adapter's ``summary()``; times and sizes from the profile;
        ``kw`` go to :meth:`from_profile` (e.g. ``warm_instances=True``)."""
        if list(summary.moe_layers) != list(profile.moe_layers) or summary.num_layers != len(
            profile.segments
        ):
            raise DataError(
                f"profile ({profile.model}: MoE layers {profile.moe_layers}, "
                f"{len(profile.segments)} blocks) does not match model {summary.name} "
                f"(MoE layers {summary.moe_layers}, {summary.num_layers} blocks)",
                "measure the profile on this model",
            )
        kw.setdefault("top_k", summary.top_k)
        return cls.from_profile(
            profile, platform, counts_LE, slo_s, model=summary.name,
            num_experts=summary.num_experts, **kw,
        )


def _u(profile: ComputeProfile, layer: int, platform: PlatformSpec, mem_mb: int) -> float:
    # eq. 3: U_j = per-token time of the layer's expert at the vCPUs memory option j gets.
    return profile.expert(layer).per_token_s(platform.vcpus(mem_mb))


def _per(value: Any, n: int, kind: type) -> tuple[Any, ...]:
    if isinstance(value, int | float):
        return tuple(kind(value) for _ in range(n))
    out = tuple(kind(v) for v in value)
    if len(out) != n:
        raise DataError(f"expected {n} values, got {len(out)}: {list(out)[:6]}")
    return out


def candidate_memory_options(
    spec: PlatformSpec, max_options: int = MAX_MEMORY_OPTIONS
) -> list[int]:
    """The memory sizes planners choose from: all offered ones when there are at most
    ``max_options`` (aws-lambda-2020's 14), otherwise a geometric grid between the
    smallest and largest plus the sizes where a linear vCPU rule reaches whole vCPUs
    (CPU time per token changes slope there), each rounded up to an offered size."""
    opts = spec.memory_options_mb()
    if len(opts) <= max_options:
        return opts
    lo, hi = opts[0], opts[-1]
    grid = set(np.geomspace(lo, hi, max_options - 6).round().astype(int).tolist())
    rule = spec.vcpu
    if isinstance(rule, LinearVcpu):
        k = 1
        while k * rule.mb_per_vcpu <= hi and k <= 6:
            grid.add(math.ceil(k * rule.mb_per_vcpu))
            k += 1
    return sorted({spec.round_up_memory(min(max(m, lo), hi)) for m in grid})
