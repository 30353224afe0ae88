"""The blocks a ``PlatformSpec`` is built from (memory, vCPU rule, prices, billing, ...).

Units as in :mod:`moefleet.platform.specs`: MB (1 GB = 1024 MB), seconds (``*_ms`` fields in
ms), bytes, bytes/s, USD. Every block is strict, closed (unknown fields are errors) and
frozen.
"""

from __future__ import annotations

import bisect
import math
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    model_validator,
)

from moefleet.limits import MAX_MEMORY_OPTIONS, MAX_PLATFORM_REPLICAS
from moefleet.platform.errors import PlatformError


class StrictBlock(BaseModel):
    """Strict, closed, immutable: a typo in YAML is an error, never a silent default."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class MemoryOptions(StrictBlock):
    """Either an explicit ``options_mb`` list or ``min_mb``..``max_mb`` in ``step_mb`` steps."""

    options_mb: list[PositiveInt] | None = None
    min_mb: PositiveInt | None = None
    max_mb: PositiveInt | None = None
    step_mb: PositiveInt | None = None

    @model_validator(mode="after")
    def _one_form(self) -> MemoryOptions:
        has_range = (self.min_mb, self.max_mb, self.step_mb) != (None, None, None)
        if self.options_mb is not None:
            if has_range:
                raise ValueError("give either options_mb or min_mb/max_mb/step_mb, not both")
            if not self.options_mb or self.options_mb != sorted(set(self.options_mb)):
                raise ValueError("options_mb must be a non-empty, strictly increasing list")
            return self
        if self.min_mb is None or self.max_mb is None or self.step_mb is None:
            raise ValueError("memory needs options_mb, or all of min_mb, max_mb and step_mb")
        if self.max_mb < self.min_mb or (self.max_mb - self.min_mb) % self.step_mb:
            raise ValueError("max_mb must be min_mb plus a whole number of step_mb")
        if (self.max_mb - self.min_mb) // self.step_mb + 1 > MAX_MEMORY_OPTIONS:
            raise ValueError(f"min_mb..max_mb in step_mb steps gives more than "
                             f"{MAX_MEMORY_OPTIONS} memory options")
        return self

    @property
    def lowest_mb(self) -> int:
        return self.options_mb[0] if self.options_mb else int(self.min_mb or 0)

    @property
    def highest_mb(self) -> int:
        return self.options_mb[-1] if self.options_mb else int(self.max_mb or 0)

    def _range(self) -> tuple[int, int, int]:
        # Only called when options_mb is None; _one_form guarantees all three are set then.
        if self.min_mb is None or self.max_mb is None or self.step_mb is None:
            raise PlatformError("memory range is incomplete")  # unreachable after validation
        return self.min_mb, self.max_mb, self.step_mb

    def options(self) -> list[int]:
        if self.options_mb is not None:
            return list(self.options_mb)
        lo, hi, step = self._range()
        return list(range(lo, hi + 1, step))

    def contains(self, mem_mb: int) -> bool:
        if self.options_mb is not None:
            return mem_mb in self.options_mb
        lo, hi, step = self._range()
        return lo <= mem_mb <= hi and (mem_mb - lo) % step == 0

    def neighbours(self, mem_mb: float) -> list[int]:
        """The offered options just below and just above ``mem_mb`` (one or two values)."""
        opts = self.options_mb
        if opts is None:
            lo, hi, step = self._range()
            below = lo + math.floor((mem_mb - lo) / step) * step
            if below == mem_mb:  # exactly on the grid: that option is the nearest
                return [min(max(below, lo), hi)]
            return sorted({min(max(c, lo), hi) for c in (below, below + step)})
        i = bisect.bisect_left(opts, mem_mb)
        return sorted({opts[j] for j in (i - 1, i) if 0 <= j < len(opts)})


class LinearVcpu(StrictBlock):
    """vcpu = clip(mem_mb / mb_per_vcpu, min_vcpu, max_vcpu) (AWS Lambda's rule).

    When ``choice_min_mb_per_vcpu``/``choice_max_mb_per_vcpu`` are set the user may pick
    the vCPU count (Alibaba FC, Kubernetes requests) as long as mem_mb / vcpus stays in
    that range; the linear value is then only the default.
    """

    rule: Literal["linear"]
    mb_per_vcpu: PositiveFloat
    max_vcpu: PositiveFloat
    min_vcpu: NonNegativeFloat = 0.0
    choice_min_mb_per_vcpu: PositiveFloat | None = None
    choice_max_mb_per_vcpu: PositiveFloat | None = None

    def default(self, mem_mb: int) -> float:
        return min(max(mem_mb / self.mb_per_vcpu, self.min_vcpu), self.max_vcpu)


class VcpuRow(StrictBlock):
    up_to_mb: PositiveInt
    vcpu: PositiveFloat


class TableVcpu(StrictBlock):
    """vcpu = the first row whose ``up_to_mb`` >= mem_mb (GCP's memory→CPU table)."""

    rule: Literal["table"]
    rows: list[VcpuRow] = Field(min_length=1)

    def default(self, mem_mb: int) -> float:
        for row in self.rows:
            if mem_mb <= row.up_to_mb:
                return row.vcpu
        raise PlatformError(f"the vCPU table ends at {self.rows[-1].up_to_mb} MB, got {mem_mb}")


class FixedVcpu(StrictBlock):
    """The same vCPU count at every memory size."""

    rule: Literal["fixed"]
    vcpu: PositiveFloat

    def default(self, mem_mb: int) -> float:
        return self.vcpu


VcpuRule = Annotated[LinearVcpu | TableVcpu | FixedVcpu, Field(discriminator="rule")]


class Prices(StrictBlock):
    """USD per GB-s of memory, per vCPU-s, per whole-GPU-s, and per request."""

    per_gb_s: NonNegativeFloat
    per_request: NonNegativeFloat
    per_vcpu_s: NonNegativeFloat = 0.0
    per_gpu_s: NonNegativeFloat = 0.0


class Billing(StrictBlock):
    """Billed duration = max(ceil(duration / granularity) * granularity, min_billed)."""

    granularity_ms: PositiveInt
    min_billed_ms: NonNegativeInt = 0
    init_billed: bool

    def billed_s(self, duration_s: float, init_s: float = 0.0) -> float:
        """THE billing rule: billed seconds of one invocation that ran ``duration_s`` after
        an INIT of ``init_s`` (counted only where the platform bills INIT), rounded up to
        the granularity, at least the minimum.

        Every biller uses this one function: the meter (via ``PlatformSpec``), the
        simulators and the engine's billers. Inputs are not checked here (the simulator
        calls it on its hottest path with durations >= 0 by construction);
        ``PlatformSpec.invocation_billed_s`` is the checked entry point.
        """
        # Integer nanoseconds: avoids ceil(0.3 / 0.1) == 4 style float artefacts.
        dur_ns = round((duration_s + init_s if self.init_billed else duration_s) * 1e9)
        gran_ns = self.granularity_ms * 1_000_000
        billed_ns = -(-dur_ns // gran_ns) * gran_ns
        min_ns = self.min_billed_ms * 1_000_000
        return (billed_ns if billed_ns > min_ns else min_ns) / 1e9


class Limits(StrictBlock):
    sync_payload_bytes: PositiveInt
    async_payload_bytes: PositiveInt
    max_replicas: Annotated[int, Field(gt=0, le=MAX_PLATFORM_REPLICAS)]
    max_concurrency_per_instance: PositiveInt
    timeout_s: PositiveFloat | None = None


class Startup(StrictBlock):
    cold_start_s: NonNegativeFloat
    warm_start_s: NonNegativeFloat


class Storage(StrictBlock):
    """The platform's object store as a function sees it (ODS/BO's T_acc and B_s)."""

    service: str
    access_latency_s: NonNegativeFloat
    bandwidth_bytes_per_s: PositiveFloat
    price_per_put: NonNegativeFloat
    price_per_get: NonNegativeFloat
    price_per_gb_month: NonNegativeFloat = 0.0


class Network(StrictBlock):
    function_bandwidth_bytes_per_s: PositiveFloat  # ODS/BO's B_f (direct invocation)


class GpuOptions(StrictBlock):
    """GPU functions: a share of one GPU, allocated in ``slice_gb`` pieces of its memory."""

    model: str
    memory_gb: PositiveFloat
    slice_gb: PositiveFloat


class Hourly(StrictBlock):
    """Rented machines: billed per ``granularity_s`` of wall time, idle time included."""

    instance: str
    price_per_hour: PositiveFloat
    cores: PositiveInt
    memory_gib: PositiveFloat
    gpus: NonNegativeInt = 0
    gpu_model: str | None = None
    granularity_s: PositiveInt = 3600
    min_billed_s: NonNegativeInt = 0
    idle_billed: bool = True


class Node(StrictBlock):
    """Self-hosted FaaS: the node whose hourly price the per-second prices spread out."""

    instance: str
    price_per_hour: PositiveFloat
    vcpus: PositiveFloat
    memory_gib: PositiveFloat
    cpu_price_fraction: float = Field(ge=0.0, le=1.0)
