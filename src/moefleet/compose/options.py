"""What the composition root is asked for: the expert stack (seam 1) and the engine's sizes.

Plain frozen values, validated on construction, so every command checks them before a model
loads; ``moefleet.compose.root`` turns them into objects.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from moefleet.engine.build import check_engine_args
from moefleet.engine.kv_sizing import check_fraction
from moefleet.errors import MoefleetError
from moefleet.experts.kernels import KERNELS, Kernel
from moefleet.models.attention import check_attention
from moefleet.runtime.retry import POLICIES, RetryPolicy

if TYPE_CHECKING:
    from moefleet.brownout.distill import DistillConfig
    from moefleet.brownout.salc import SALC
    from moefleet.engine.engine import StepHook
    from moefleet.experts.brownout_control import BrownoutSpec
    from moefleet.experts.stack import ExpertStack
    from moefleet.models.base import ExpertFn
    from moefleet.runtime.faults import FaultPlan

RunnerKind = Literal["auto", "in-process", "segments"]
RUNNERS: tuple[RunnerKind, ...] = ("auto", "in-process", "segments")


@dataclass(frozen=True)
class StackOptions:
    """Seam 1. ``kernel``: the in-process expert kernel. ``brownout``: ways, mode and either
    a fixed threshold or SLOs for SALC (None: no brownout). ``faults``: a fault plan
    (emulated at the expert seam without functions; at the backend with a plan).
    ``retry``: the outermost retry policy (None: failures are not retried). ``wrap``: an
    extra piece inside the retries (a profiler). ``max_parallel``: remote dispatch threads.
    ``local``: in-process experts other than the adapter's kernel (a measurement's own
    expert code); only without a plan, whose experts the plan places. ``salc``: a SALC
    controller of one's own (its SLOs and rates) instead of the one ``brownout`` builds.
    ``distill_progress(done, total, what)``: called per united expert while ``brownout``
    distils (not when cached), so a caller can show progress and an ETA.
    """

    kernel: Kernel = "auto"
    local: ExpertFn | None = None
    brownout: BrownoutSpec | None = None
    distill: DistillConfig | None = None
    distill_progress: Callable[[int, int, str], None] | None = None
    united_kernel: str = "loop"
    salc: SALC | None = None
    faults: FaultPlan | None = None
    retry: RetryPolicy | None = field(default_factory=lambda: POLICIES["engine"])
    wrap: Callable[[ExpertStack], ExpertStack | ExpertFn] | None = None
    max_parallel: int = 16

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise MoefleetError(f"unknown expert kernel {self.kernel!r}",
                                f"use one of {', '.join(KERNELS)}")
        if not 1 <= self.max_parallel <= 256:
            raise MoefleetError(f"max_parallel must be in [1, 256], got {self.max_parallel}",
                                "16 is a good default")


@dataclass(frozen=True)
class EngineOptions:
    """The engine's sizes and where its loop runs. ``runner``: ``auto`` (in process, the
    plan's experts wherever it puts them), ``in-process`` or ``segments`` (a plan's
    segment functions; prefill only). ``kv_budget_bytes``: the KV cache (None: sized by
    ``engine.kv_sizing``: ``gpu_memory_utilization`` of a GPU's memory after weights and
    a profiling forward, or the CPU default). ``eos_token_id``: None takes the
    tokenizer's; ``-1`` turns EOS off. ``attention``: how attention reads the KV cache:
    ``gather`` (each row's history copied out, the default), ``paged`` (FlexAttention over
    the cache's blocks, no copy) or ``auto`` (paged on CUDA, gather on the CPU, where eager
    FlexAttention scans the whole cache: correctness only); see ``models.paged``.
    ``hold_main_share``: a Remoe plan's CPU main (this process) is held to the vCPU share
    the platform gives its memory (emulated, :mod:`moefleet.compose.held_share`).
    ``play_segments``: an ODS/BO plan's segment functions are played by this process,
    held to their vCPU share and billed as their invocations (emulated,
    :mod:`moefleet.compose.played_segments`; in-process runner only)."""

    device: str = "cpu"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_budget_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    max_model_len: int | None = None
    runner: RunnerKind = "auto"
    attention: str = "gather"
    hold_main_share: bool = False
    play_segments: bool = False
    eos_token_id: int | None = None
    clock: Callable[[], float] = time.monotonic
    hooks: tuple[StepHook, ...] = ()

    def __post_init__(self) -> None:
        check_engine_args(self.device, self.max_num_seqs, self.max_num_batched_tokens)
        if self.runner not in RUNNERS:
            raise MoefleetError(f"unknown runner {self.runner!r}",
                                f"use one of {', '.join(RUNNERS)}")
        check_attention(self.attention)
        if self.play_segments and self.runner == "segments":
            raise MoefleetError("play_segments emulates the segment functions the "
                                "'segments' runner really invokes",
                                "use one or the other")
        if self.kv_budget_bytes is not None and self.kv_budget_bytes < 1:
            raise MoefleetError(f"kv_budget_bytes must be positive, got {self.kv_budget_bytes}",
                                "omit it for the default")
        check_fraction(self.gpu_memory_utilization)


@dataclass(frozen=True)
class Billing:
    """How requests are billed when nothing is invoked remotely (no plan): as one function
    of ``memory_mb`` on ``platform`` running the engine's forward time (an estimate)."""

    platform: str = "aws-lambda"
    memory_mb: int = 2048
