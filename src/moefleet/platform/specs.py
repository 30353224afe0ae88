"""``PlatformSpec``: what a platform offers and what it charges (one YAML file each).

Units, everywhere in this module (field names repeat them):
- memory in MB, binary: 1 GB = 1024 MB, which is how AWS, GCP and Alibaba turn a memory
  setting into GB-seconds;
- durations in seconds, except the YAML billing fields ``*_ms`` (providers quote ms);
- sizes in bytes, bandwidths in bytes/s;
- money in USD.

Invariants after validation: a ``faas`` spec has every per-invocation block (memory, vcpu,
prices, billing, limits, startup, storage, network) and no ``hourly`` block; a ``cluster`` or
``server`` spec has ``hourly``. Specs are frozen, so a loaded spec can be cached and shared.
The blocks themselves live in :mod:`moefleet.platform.spec_blocks`.
"""

from __future__ import annotations

import math
from typing import Literal, TypeVar

from pydantic import Field, PositiveInt, model_validator

from moefleet.platform.errors import InvalidMemoryError, PlatformError
from moefleet.platform.spec_blocks import (
    Billing,
    FixedVcpu,
    GpuOptions,
    Hourly,
    Limits,
    LinearVcpu,
    MemoryOptions,
    Network,
    Node,
    Prices,
    Startup,
    Storage,
    StrictBlock,
    TableVcpu,
    VcpuRow,
    VcpuRule,
)

__all__ = [
    "MB_PER_GB",
    "Billing",
    "FixedVcpu",
    "GpuOptions",
    "Hourly",
    "Limits",
    "LinearVcpu",
    "MemoryOptions",
    "Network",
    "Node",
    "PlatformSpec",
    "Prices",
    "Startup",
    "Storage",
    "TableVcpu",
    "VcpuRow",
    "VcpuRule",
]

MB_PER_GB = 1024  # billing GB = 1024 MB on every platform in the catalog
_REL_TOL = 1e-6  # float comparisons of vCPU counts / GPU shares read from YAML or records
_T = TypeVar("_T")


class PlatformSpec(StrictBlock):
    """One platform. See the module docstring for units and invariants."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9.-]*$")
    kind: Literal["faas", "cluster", "server"]
    provider: str
    description: str
    as_of: str
    region: str | None = None
    sources: list[str] = Field(default_factory=list)
    memory: MemoryOptions | None = None
    vcpu: VcpuRule | None = None
    prices: Prices | None = None
    billing: Billing | None = None
    limits: Limits | None = None
    startup: Startup | None = None
    storage: Storage | None = None
    network: Network | None = None
    gpu: GpuOptions | None = None
    node: Node | None = None
    hourly: Hourly | None = None
    baseline_memory_mb: PositiveInt | None = None  # fixed-size baseline (ODS/BO's LambdaML)

    @model_validator(mode="after")
    def _kind_rules(self) -> PlatformSpec:
        faas_blocks = ("memory", "vcpu", "prices", "billing", "limits", "startup", "storage")
        if self.kind == "faas":
            for block in (*faas_blocks, "network"):
                if getattr(self, block) is None:
                    raise ValueError(f"kind 'faas' needs the field '{block}'")
            if self.hourly is not None:
                raise ValueError("kind 'faas' must not have 'hourly' (that is for cluster/server)")
        else:
            if self.hourly is None:
                raise ValueError(f"kind '{self.kind}' needs the field 'hourly'")
            for block in ("memory", "vcpu", "prices", "billing", "gpu", "node"):
                if getattr(self, block) is not None:
                    raise ValueError(f"kind '{self.kind}' must not have '{block}' (faas only)")
        if self.baseline_memory_mb is not None and self.memory is not None:
            lo, hi = self.memory.lowest_mb, self.memory.highest_mb
            if not lo <= self.baseline_memory_mb <= hi:
                raise ValueError(
                    f"baseline_memory_mb={self.baseline_memory_mb} is outside {lo}..{hi} MB"
                )
        if self.gpu is not None and self.prices is not None and self.prices.per_gpu_s <= 0:
            raise ValueError("a 'gpu' block needs prices.per_gpu_s > 0")
        if (
            isinstance(self.vcpu, TableVcpu)
            and self.memory is not None
            and self.vcpu.rows[-1].up_to_mb < self.memory.highest_mb
        ):
            raise ValueError("vcpu.rows must cover the largest memory option")
        if self.startup is not None and self.startup.warm_start_s > self.startup.cold_start_s:
            raise ValueError("startup.warm_start_s must not exceed startup.cold_start_s")
        self._check_node_prices()
        return self

    def _check_node_prices(self) -> None:
        """Self-hosted prices must add up to the node's hourly price (within 0.5%)."""
        if self.node is None or self.prices is None:
            return
        n, p = self.node, self.prices
        full_hour = 3600 * (n.vcpus * p.per_vcpu_s + n.memory_gib * p.per_gb_s)
        if not math.isclose(full_hour, n.price_per_hour, rel_tol=5e-3):
            raise ValueError(
                f"prices give ${full_hour:.5f} for the whole node per hour, but "
                f"node.price_per_hour is ${n.price_per_hour:.5f}: recompute per_vcpu_s/per_gb_s"
            )

    # ---- helpers -------------------------------------------------------------------------

    def _need(self, value: _T | None, what: str) -> _T:
        if value is None:
            raise PlatformError(
                f"platform '{self.name}' (kind {self.kind}) has no {what}",
                "cluster/server platforms are billed by the hour: use bill_cluster()",
            )
        return value

    @property
    def is_faas(self) -> bool:
        return self.kind == "faas"

    # ---- memory and vCPU -----------------------------------------------------------------

    def memory_options_mb(self) -> list[int]:
        """Every memory size (MB) the platform offers, ascending."""
        return self._need(self.memory, "memory options").options()

    def is_valid_memory(self, mem_mb: int) -> bool:
        """Offered by the platform, or the spec's ``baseline_memory_mb`` (LambdaML's 3008)."""
        mem = self._need(self.memory, "memory options")
        return mem.contains(mem_mb) or mem_mb == self.baseline_memory_mb

    def check_memory(self, mem_mb: int) -> int:
        """Return ``mem_mb`` if valid, else raise naming it and the nearest valid options."""
        if isinstance(mem_mb, bool) or not isinstance(mem_mb, int):
            near = ""
            if isinstance(mem_mb, float) and math.isfinite(mem_mb):
                near = f"nearest valid options: {self.nearest_memory_options(mem_mb)} MB"
            raise InvalidMemoryError(f"memory must be a whole number of MB, got {mem_mb!r}", near)
        if self.is_valid_memory(mem_mb):
            return mem_mb
        raise InvalidMemoryError(
            f"platform '{self.name}' does not offer {mem_mb} MB of memory",
            f"nearest valid options: {self.nearest_memory_options(mem_mb)} MB",
        )

    def nearest_memory_options(self, mem_mb: float) -> list[int]:
        """The offered sizes (MB) just below and just above ``mem_mb``."""
        return self._need(self.memory, "memory options").neighbours(mem_mb)

    def round_up_memory(self, need_mb: float) -> int:
        """Smallest offered size (MB) >= ``need_mb``; error if even the largest is too small."""
        mem = self._need(self.memory, "memory options")
        for cand in mem.neighbours(need_mb):
            if cand >= need_mb:
                return cand
        raise InvalidMemoryError(
            f"platform '{self.name}' offers at most {mem.highest_mb} MB, {need_mb:g} MB needed",
            "split the function (more replicas / fewer experts per function)",
        )

    def baseline_memory(self) -> int:
        """Memory (MB) of the fixed-size baseline: ``baseline_memory_mb`` or the maximum."""
        return self.baseline_memory_mb or self._need(self.memory, "memory").highest_mb

    def vcpus(self, mem_mb: int) -> float:
        """The vCPUs a function with ``mem_mb`` MB gets by default."""
        self.check_memory(mem_mb)
        return self._vcpu_rule().default(mem_mb)

    def _vcpu_rule(self) -> LinearVcpu | TableVcpu | FixedVcpu:
        if self.vcpu is None:
            return self._need(None, "vCPU rule")
        return self.vcpu

    def check_vcpus(self, mem_mb: int, vcpus: float | None) -> float:
        """``vcpus`` if the platform allows it at ``mem_mb`` (None → the default)."""
        default = self.vcpus(mem_mb)
        if vcpus is None:
            return default
        rule = self._vcpu_rule()
        if not (math.isfinite(vcpus) and vcpus > 0):
            raise PlatformError(f"vcpus must be a positive number, got {vcpus!r}")
        lo_r = rule.choice_min_mb_per_vcpu if isinstance(rule, LinearVcpu) else None
        hi_r = rule.choice_max_mb_per_vcpu if isinstance(rule, LinearVcpu) else None
        if isinstance(rule, LinearVcpu) and lo_r is not None and hi_r is not None:
            ratio = mem_mb / vcpus
            ok = lo_r * (1 - _REL_TOL) <= ratio <= hi_r * (1 + _REL_TOL)
            if ok and vcpus <= rule.max_vcpu * (1 + _REL_TOL):
                return vcpus
            raise PlatformError(
                f"platform '{self.name}' does not allow {vcpus:g} vCPUs with {mem_mb} MB",
                f"allowed: {mem_mb / hi_r:.3g}..{min(mem_mb / lo_r, rule.max_vcpu):.3g} vCPUs",
            )
        if math.isclose(vcpus, default, rel_tol=_REL_TOL):
            return default
        raise PlatformError(
            f"platform '{self.name}' ties vCPUs to memory: {mem_mb} MB gets {default:.4g} vCPUs,"
            f" not {vcpus:g}",
            "leave vcpus unset (None) to use the platform's value",
        )

    def check_gpu_share(self, gpu_share: float) -> float:
        """A GPU share in [0, 1] that the platform can allocate (0 = no GPU)."""
        if not (math.isfinite(gpu_share) and 0.0 <= gpu_share <= 1.0):
            raise PlatformError(f"gpu_share must be in [0, 1], got {gpu_share!r}")
        if gpu_share == 0.0:
            return 0.0
        if self.gpu is None:
            raise PlatformError(
                f"platform '{self.name}' has no GPU functions (gpu_share={gpu_share:g})",
                "use a GPU platform such as 'alibaba-fc-gpu', or gpu_share=0",
            )
        slices = gpu_share * self.gpu.memory_gb / self.gpu.slice_gb
        if not math.isclose(slices, round(slices), rel_tol=_REL_TOL, abs_tol=1e-9):
            step = self.gpu.slice_gb / self.gpu.memory_gb
            raise PlatformError(
                f"gpu_share={gpu_share:g} is not a multiple of {step:.4g} on '{self.name}'",
                f"GPU memory is allocated in {self.gpu.slice_gb:g} GB slices of "
                f"{self.gpu.memory_gb:g} GB",
            )
        return gpu_share

    def gpu_share_options(self) -> list[float]:
        """Every GPU share the platform allocates, ascending, 0 (CPU only) first."""
        if self.gpu is None:
            return [0.0]
        n = max(1, round(self.gpu.memory_gb / self.gpu.slice_gb))
        return [0.0] + [k / n for k in range(1, n + 1)]

    def clamp_gpu_share(self, gpu_share: float) -> float:
        """The share the platform can allocate for a wanted one: 0 on a CPU-only
        platform; otherwise rounded *up* to the next slice (a smaller slice would be
        slower than decided), within (0, 1]. 0 stays 0. Never raises for a finite
        number: a controller's decision is clamped (the caller logs it), not refused."""
        if not math.isfinite(gpu_share) or gpu_share <= 0.0:
            return 0.0
        opts = self.gpu_share_options()
        return next((o for o in opts[1:] if o >= gpu_share * (1 - _REL_TOL)), opts[-1])

    # ---- billing -------------------------------------------------------------------------

    def billed_duration_s(self, duration_s: float) -> float:
        """Duration (s) rounded up to the billing granularity, at least the minimum."""
        _check_duration(duration_s, "duration_s")
        return self._need(self.billing, "billing rules").billed_s(duration_s)

    def compute_cost(
        self, mem_mb: int, billed_s: float, vcpus: float | None = None, gpu_share: float = 0.0
    ) -> float:
        """USD for ``billed_s`` already-rounded seconds at this configuration."""
        _check_duration(billed_s, "billed_s")
        p = self._need(self.prices, "prices")
        v = self.check_vcpus(mem_mb, vcpus)
        g = self.check_gpu_share(gpu_share)
        per_s = mem_mb / MB_PER_GB * p.per_gb_s + v * p.per_vcpu_s + g * p.per_gpu_s
        return per_s * billed_s

    def invocation_billed_s(self, duration_s: float, init_s: float = 0.0) -> float:
        """Billed seconds of one invocation: INIT counts only where the platform bills it
        (:meth:`Billing.billed_s`, the one rule, after checking the inputs)."""
        _check_duration(duration_s, "duration_s")
        _check_duration(init_s, "init_s")
        return self._need(self.billing, "billing rules").billed_s(duration_s, init_s)

    def invocation_cost(
        self,
        mem_mb: int,
        duration_s: float,
        vcpus: float | None = None,
        gpu_share: float = 0.0,
        init_s: float = 0.0,
    ) -> float:
        """USD for one invocation: compute for the billed duration plus the request price."""
        billed = self.invocation_billed_s(duration_s, init_s)
        return self.compute_cost(mem_mb, billed, vcpus, gpu_share) + self.request_cost(1)

    def request_cost(self, n_requests: int = 1) -> float:
        """USD for ``n_requests`` invocations (the per-request part only)."""
        if n_requests < 0:
            raise PlatformError(f"n_requests must be >= 0, got {n_requests}")
        return n_requests * self._need(self.prices, "prices").per_request

    def storage_request_cost(self, puts: int, gets: int) -> float:
        """USD for ``puts`` PUT and ``gets`` GET requests to the platform's object store."""
        if puts < 0 or gets < 0:
            raise PlatformError(f"request counts must be >= 0, got puts={puts}, gets={gets}")
        if self.storage is None:
            if puts or gets:
                raise PlatformError(f"platform '{self.name}' has no object store configured")
            return 0.0
        return puts * self.storage.price_per_put + gets * self.storage.price_per_get

    def hourly_billed_s(self, wall_s: float) -> float:
        """Rented time (s) billed for ``wall_s`` seconds: rounded up, at least the minimum."""
        _check_duration(wall_s, "wall_s")
        h = self._need(self.hourly, "hourly price")
        units = math.ceil(round(wall_s * 1e6) / (h.granularity_s * 1_000_000))
        return float(max(units * h.granularity_s, h.min_billed_s))


def _check_duration(value: float, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PlatformError(f"{name} must be a finite number of seconds, got {value!r}")
    if value < 0:
        raise PlatformError(f"{name} must be >= 0 seconds, got {value!r}")
