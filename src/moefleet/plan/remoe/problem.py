"""``RemoeProblem``: what the Remoe planner is given, and the fitted remote time law.

Units: memory options in MB, memory inside the formulas in GB (1 GB = 1024 MB); a CPU
function with y GB gets y / ``law.gb_per_vcpu`` vCPUs (the paper's assumption, III-A, is
1 GB = 1 vCPU; ``problem_for`` takes the platform's rule); times in seconds, sizes in
bytes, prices in USD per GB-second (CPU: memory plus its share of a vCPU; GPU: per GB of
GPU memory).

Shape legend: L MoE layers, E routed experts per layer.

Invariants after construction (``__post_init__``): ``s_LE`` is finite, non-negative, each
row sums to 1 (the SPS activation distribution of one request, Remoe IV-B); memory
options are strictly increasing; every time, price and size is finite and positive where
a zero would divide (transfer rates) and non-negative elsewhere; the time law is
non-increasing in memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moefleet.errors import MoefleetError
from moefleet.plan.problem import InfeasibleError

__all__ = ["InfeasibleError", "RemoeError", "RemoeProblem", "TimeLaw", "fit_time_law",
           "theorem1_bound"]

MB_PER_GB = 1024.0


class RemoeError(MoefleetError):
    """A Remoe planning input that does not fit (shape, memory options, platform)."""


@dataclass(frozen=True)
class TimeLaw:
    """T(y) = θ1·exp(−θ2·y) + θ3: seconds one expert spends on one token with y GB.
    ``gb_per_vcpu`` GB buy one vCPU (the paper's model: 1; aws-lambda: 1769 / 1024);
    below that a function holds a fraction of a core and runs proportionally slower."""

    theta1: float
    theta2: float
    theta3: float
    gb_per_vcpu: float = 1.0

    def __post_init__(self) -> None:
        vals = (self.theta1, self.theta2, self.theta3)
        if not (math.isfinite(self.gb_per_vcpu) and self.gb_per_vcpu > 0):
            raise RemoeError(f"gb_per_vcpu must be > 0, got {self.gb_per_vcpu!r}",
                             "take it from the platform's vCPU rule")
        if not all(math.isfinite(v) and v >= 0 for v in vals) or self.one_vcpu_s <= 0:
            raise RemoeError(f"time law needs θ1, θ2, θ3 >= 0 and T(1 vCPU) > 0, got {vals}",
                             "fit it with fit_time_law from measured points")

    @property
    def one_vcpu_s(self) -> float:
        """T at one vCPU (``gb_per_vcpu`` GB)."""
        return self.theta1 * math.exp(-self.theta2 * self.gb_per_vcpu) + self.theta3

    def __call__(self, y_gb: float) -> float:
        g = self.gb_per_vcpu
        if y_gb < g:
            return self.one_vcpu_s * g / max(y_gb, 1e-6)
        return self.theta1 * math.exp(-self.theta2 * y_gb) + self.theta3

    def array(self, y_gb: np.ndarray) -> np.ndarray:
        y, g = np.asarray(y_gb, np.float64), self.gb_per_vcpu
        big = self.theta1 * np.exp(-self.theta2 * np.maximum(y, g)) + self.theta3
        return np.where(y < g, self.one_vcpu_s * g / np.maximum(y, 1e-6), big)

    def to_dict(self) -> dict[str, float]:
        return {"theta1": self.theta1, "theta2": self.theta2, "theta3": self.theta3,
                "gb_per_vcpu": self.gb_per_vcpu}


def fit_time_law(memory_mb: Any, time_s: Any, gb_per_vcpu: float = 1.0) -> TimeLaw:
    """Fit T(y) to measured (memory MB, seconds per token) points (Remoe Fig. 6), on a
    platform where ``gb_per_vcpu`` GB buy one vCPU.

    The fit itself is the compute profiles' non-negative nonlinear least squares on
    relative residuals (:func:`moefleet.profiles.fit.fit_thread_law`), with y in GB."""
    from moefleet.profiles.fit import fit_thread_law

    mem = np.asarray(memory_mb, np.float64)
    if mem.ndim != 1 or mem.size == 0 or np.any(~np.isfinite(mem)) or np.any(mem <= 0):
        raise RemoeError(f"memory points must be positive MB values, got {mem.tolist()}",
                         "pass the memory sizes the times were measured at")
    law = fit_thread_law(mem / MB_PER_GB, time_s).law
    return TimeLaw(law.theta1, law.theta2, law.theta3, gb_per_vcpu)


def theorem1_bound(n: float, k: int, m: int = 1) -> float:
    """Remoe Theorem 1 / Corollary 1: with n tokens over k experts, m of them receive at
    most sqrt(3n)/2 + m·n/k tokens with probability 0.95 (never more than n)."""
    if n <= 0:
        return 0.0
    return float(min(n, math.sqrt(3.0 * n) / 2.0 + m * n / k))


def _options(name: str, values: Any) -> tuple[int, ...]:
    opts = tuple(int(v) for v in values)
    if not opts or any(v <= 0 for v in opts) or list(opts) != sorted(set(opts)):
        raise RemoeError(f"{name} must be a non-empty, strictly increasing list of MB, "
                         f"got {list(values)}", "e.g. 1024, 2048, ... (platform options)")
    return opts


@dataclass(frozen=True)
class RemoeProblem:
    """One request (or a batch planned as one) for the Remoe planner. See module doc."""

    model: str
    s_LE: np.ndarray  # predicted activation distribution, rows sum to 1
    top_k: int
    n_in: int
    n_out: int
    ttft_slo_s: float
    tpot_slo_s: float
    main_memory_mb: tuple[int, ...]
    remote_memory_mb: tuple[int, ...]
    cpu_price_gb_s: float  # c_c: a GB of memory and its share of a vCPU
    gpu_price_gb_s: float  # c_g: per GB of GPU memory (0: no GPU)
    token_bytes: float  # D: one token's hidden state on the wire
    transfer_bytes_s: float  # B: function-to-function rate
    invoke_overhead_s: float  # t_rem: warm invocation overhead of a remote call
    law: TimeLaw  # one expert, one token, vs memory GB (CPU), the platform's vCPU rule
    expert_bytes: float  # μ(e): one routed expert's parameters
    nonexpert_bytes: float  # Σμ(f_l): attention, norms, gates, shared experts, embeddings
    kv_bytes_per_token: float  # Σ_l a_l
    nonexpert_token_s: float  # one layer's non-expert modules, one decode token, GPU
    nonexpert_cpu_token_s: float  # the same on one vCPU (scaled like T(y))
    gpu_expert_token_s: float  # one expert, one token, on the GPU (GPU / Fetch baselines)
    swap_bytes_s: float  # GPU<->CPU copy rate (τ_sw)
    cold_main_s: float
    cold_remote_s: float
    nonexpert_prefill_token_s: float = -1.0  # per prompt token (-1: as decode)
    prefill_factor: float = 1.0  # an expert's per-token time in a prefill batch vs T(y)
    # One layer's non-experts per prompt token on one vCPU; -1: the decode time x
    # prefill_factor (kept -1, resolved where used, so a replace of the decode time holds).
    nonexpert_cpu_prefill_token_s: float = -1.0
    # The main's CPU work below one vCPU: measured (vCPU share, decode factor, prefill
    # factor) points, shares ascending in (0, 1). A quota runs the main in slices, and a
    # step that starts after a pause costs more CPU than one run back to back (caches
    # cooled); the factor multiplies the main's CPU time at that share. () = no such cost
    # (the paper's model). Measured by ``calibration.remoe.held_factors``.
    main_held: tuple[tuple[float, float, float], ...] = ()
    gpu_slice_gb: float = 1.0  # GPU memory is billed in these steps
    payload_bytes: float = 6 * 2**20
    max_replicas: int = 8
    # The platform's vCPU cap per function and the memory-only part of c_c: above
    # ``max_vcpus`` vCPUs (``max_cpu_gb``) a function gets no more (and pays for none), so
    # its CPU rate is c_c·max_cpu_gb + c_mem·(y − max_cpu_gb) and its experts run at
    # T(max_cpu_gb). Defaults (inf, 0) and the law's gb_per_vcpu = 1 are the paper's pure
    # 1 GB = 1 vCPU model.
    max_vcpus: float = math.inf
    cpu_mem_price_gb_s: float = 0.0
    # Cold starts: container start (cold_*_s) plus loading the function's weights at this
    # rate (0: weights are not counted, the cold start is the platform's constant only).
    load_bytes_s: float = 0.0
    gpu_card_gb: float = math.inf  # one GPU's memory: a main function must fit on one
    # Host memory beyond weights, tokens and cache (MB), absent from the paper's (10e)/(10f):
    # every function's runtime (interpreter + torch), and a GPU main's CUDA runtime
    # (context, kernels, cuBLAS). Measured values come from ``shapes``; 0 keeps the
    # paper's constraints exactly (hand-checkable tests).
    runtime_mb: float = 0.0
    gpu_runtime_mb: float = 0.0
    eta: float = 0.1  # PT <= η·GT in the memory subproblem (IV-E)
    epsilon: float = 1.0 / 64  # MMP's step of the remote ratio b
    platform: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        s = np.asarray(self.s_LE, np.float64)
        if s.ndim != 2 or 0 in s.shape or not np.all(np.isfinite(s)) or np.any(s < 0):
            raise RemoeError(f"activation matrix must be a finite, non-negative (layers, "
                             f"experts) array, got shape {s.shape}",
                             "pass SPS's predict_distribution for one request")
        if not np.allclose(s.sum(axis=1), 1.0, atol=1e-6):
            raise RemoeError("every layer of the activation matrix must sum to 1",
                             "pass a distribution (SPS predict_distribution), not counts")
        object.__setattr__(self, "s_LE", s)
        if not 1 <= self.top_k <= s.shape[1]:
            raise RemoeError(f"top_k={self.top_k} must be in 1..{s.shape[1]} experts")
        if self.n_in < 1 or self.n_out < 1:
            raise RemoeError(f"need n_in, n_out >= 1, got {self.n_in}, {self.n_out}")
        for name in ("ttft_slo_s", "tpot_slo_s", "transfer_bytes_s", "swap_bytes_s",
                     "cpu_price_gb_s", "payload_bytes"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise RemoeError(f"{name} must be a positive number, got {v!r}")
        for name in ("gpu_price_gb_s", "token_bytes", "invoke_overhead_s", "expert_bytes",
                     "nonexpert_bytes", "kv_bytes_per_token", "nonexpert_token_s",
                     "nonexpert_cpu_token_s", "gpu_expert_token_s", "cold_main_s",
                     "cold_remote_s", "eta", "gpu_slice_gb", "cpu_mem_price_gb_s",
                     "load_bytes_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise RemoeError(f"{name} must be a non-negative number, got {v!r}")
        object.__setattr__(self, "main_memory_mb", _options("main memory options",
                                                            self.main_memory_mb))
        object.__setattr__(self, "remote_memory_mb", _options("remote memory options",
                                                              self.remote_memory_mb))
        if self.nonexpert_prefill_token_s < 0:
            object.__setattr__(self, "nonexpert_prefill_token_s", self.nonexpert_token_s)
        v = self.nonexpert_cpu_prefill_token_s
        if not (math.isfinite(v) and (v >= 0 or v == -1.0)):
            raise RemoeError(f"nonexpert_cpu_prefill_token_s must be >= 0 (or -1: from the "
                             f"decode time), got {v!r}")
        if not 0 < self.prefill_factor <= 1:
            raise RemoeError(f"prefill_factor must be in (0, 1], got {self.prefill_factor}")
        if self.cpu_mem_price_gb_s > self.cpu_price_gb_s:
            raise RemoeError(f"cpu_mem_price_gb_s={self.cpu_mem_price_gb_s} exceeds the whole "
                             f"CPU price c_c={self.cpu_price_gb_s}",
                             "c_c is memory plus one vCPU per GB; pass the memory part only")
        if not (self.max_vcpus >= 1):
            raise RemoeError(f"max_vcpus must be >= 1, got {self.max_vcpus!r}")
        if not 1 <= self.max_replicas <= 1000:
            raise RemoeError(f"max_replicas must be in 1..1000, got {self.max_replicas}")
        if not 0 < self.epsilon <= 0.5:
            raise RemoeError(f"epsilon must be in (0, 0.5], got {self.epsilon}")
        shares = [pt[0] for pt in self.main_held]
        if (any(len(pt) != 3 or not all(math.isfinite(v) for v in pt) for pt in self.main_held)
                or any(not 0 < v < 1 for v in shares) or shares != sorted(set(shares))
                or any(min(pt[1:]) < 1 for pt in self.main_held)):
            raise RemoeError(f"main_held must be (share, decode factor, prefill factor) "
                             f"points, shares ascending in (0, 1), factors >= 1, got "
                             f"{self.main_held!r}", "measure them with held_factors")

    def held_factors(self, vcpus: float) -> tuple[float, float]:
        """(decode, prefill) CPU factors of the main's work at ``vcpus``: 1 at a whole
        vCPU or more, linear between the measured shares (and 1 at one vCPU), the lowest
        measured share's factors below it (not extrapolated)."""
        if not self.main_held or vcpus >= 1:
            return 1.0, 1.0
        pts = [*self.main_held, (1.0, 1.0, 1.0)]
        xs = [pt[0] for pt in pts]
        return (float(np.interp(vcpus, xs, [pt[1] for pt in pts])),
                float(np.interp(vcpus, xs, [pt[2] for pt in pts])))

    # ---- shape --------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return int(self.s_LE.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.s_LE.shape[1])

    @property
    def has_gpu(self) -> bool:
        return self.gpu_price_gb_s > 0

    # ---- expected loads (IV-D) ----------------------------------------------------
    @property
    def prefill_tokens_LE(self) -> np.ndarray:
        """E[N_pre] = n_in·K·s: tokens routed to each expert during prefill. (The paper
        writes n_in·s; with s summing to 1 per layer that counts tokens, not routed slots,
        so we multiply by K as it does for decoding.)"""
        return self.n_in * self.top_k * self.s_LE

    @property
    def decode_tokens_LE(self) -> np.ndarray:
        """E[N_dec] = n_out·K·s."""
        return self.n_out * self.top_k * self.s_LE

    @property
    def utility_LE(self) -> np.ndarray:
        """u = E[N_pre] + E[N_dec] (IV-D)."""
        return self.prefill_tokens_LE + self.decode_tokens_LE

    def gb(self, mb: float) -> float:
        return mb / MB_PER_GB

    # ---- CPU functions of y GB: vCPUs capped at ``max_vcpus`` --------------------------
    @property
    def max_cpu_gb(self) -> float:
        """The memory at which a function reaches the platform's vCPU cap."""
        return self.max_vcpus * self.law.gb_per_vcpu

    def cpu_rate(self, y_gb: Any) -> Any:
        """USD per second of a CPU function with y GB: c_c·y up to the vCPU cap, only the
        memory part above it (works on floats and arrays)."""
        over = np.maximum(np.asarray(y_gb, np.float64) - self.max_cpu_gb, 0.0)
        rate = self.cpu_price_gb_s * np.asarray(y_gb, np.float64) - (
            self.cpu_price_gb_s - self.cpu_mem_price_gb_s) * over
        return float(rate) if np.ndim(rate) == 0 else rate

    def expert_s(self, y_gb: float) -> float:
        """T(y) at the vCPUs a y GB function actually gets: one expert, one token."""
        return self.law(min(y_gb, self.max_cpu_gb))

    def expert_s_array(self, y_gb: np.ndarray) -> np.ndarray:
        return self.law.array(np.minimum(np.asarray(y_gb, np.float64), self.max_cpu_gb))

    def gpu_memory_gb(self, expert_bytes_on_gpu: float = 0.0) -> float:
        """M_g (eq. 7): tokens and KV cache for n_in + n_out tokens plus the non-expert
        modules (and, for the GPU / Fetch baselines, experts), rounded up to the slice."""
        need = ((self.n_in + self.n_out) * (self.token_bytes + self.kv_bytes_per_token)
                + self.nonexpert_bytes + expert_bytes_on_gpu) / 2**30
        step = self.gpu_slice_gb or 1e-9
        return math.ceil(need / step - 1e-9) * step

    def cold_s(self, main_experts: float, remote_group_experts: float) -> float:
        """T_cold: the main function's start (container + non-experts + ``main_experts``
        experts loaded) overlapped with the remote functions' (container + their largest
        group); every remote function starts when the request arrives (IV-C), so the two
        run side by side and the slower one counts."""
        load = (1.0 / self.load_bytes_s) if self.load_bytes_s > 0 else 0.0
        main = self.cold_main_s + (self.nonexpert_bytes
                                   + main_experts * self.expert_bytes) * load
        if remote_group_experts <= 0:
            return main
        return max(main, self.cold_remote_s + remote_group_experts * self.expert_bytes * load)

    def swap_s(self, tokens: float) -> float:
        """τ_sw(n): GPU<->CPU copy of n tokens (0 without a GPU)."""
        return tokens * self.token_bytes / self.swap_bytes_s if self.has_gpu else 0.0

    def round_main(self, need_mb: float) -> int:
        for m in self.main_memory_mb:
            if m >= need_mb - 1e-6:
                return m
        raise InfeasibleError(
            f"infeasible: the main function needs {need_mb:.0f} MB, the largest option is "
            f"{self.main_memory_mb[-1]} MB", "use a platform with larger functions")
