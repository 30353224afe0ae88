"""Model shapes, timing and platform prices → a :class:`RemoeProblem`.

Per-expert CPU times are *scaled from a measured FLOP rate*: :func:`measure_cpu` times
one SwiGLU expert of the shape's size (fp32, torch, one thread) at one token (decode)
and at 64 tokens (prefill) and keeps FLOPs / second. A function with y GB gets the
vCPUs the platform's rule gives it (:func:`gb_per_vcpu`; the paper assumed 1 GB = 1 vCPU);
thread scaling cannot be measured on this loaded 2-core machine, so T(y) is fitted
(:func:`fit_time_law`) to Amdahl points t1·(f + (1 − f)/v), v = 1..8, with serial
fraction f = 5% (an ASSUMPTION). GPU times are a roofline from the platform GPU's
datasheet (bf16 FLOP/s, memory bandwidth): nothing is measured on a GPU here, so every
figure that uses them is "GPU emulated".
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from moefleet.errors import UnknownNameError
from moefleet.plan.remoe.problem import RemoeError, RemoeProblem, fit_time_law
from moefleet.profiles.gpu import (
    A10_BYTES_S,
    A10_FLOPS_S,
    GPU_RUNTIME_MB,
    PCIE4_BYTES_S,
    RUNTIME_MB,
    GpuRoofline,
)


@dataclass(frozen=True)
class ModelDims:
    """What the planner needs of a model (bf16 parameters, 2 bytes each)."""

    name: str
    moe_layers: int
    experts: int
    top_k: int
    hidden: int
    expert_intermediate: int
    nonexpert_params: float  # attention, norms, gates, shared experts, embeddings
    kv_bytes_per_token: float  # all layers
    bytes_per_param: int = 2

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_intermediate  # SwiGLU: gate, up, down

    @property
    def expert_flops_per_token(self) -> float:
        return 2.0 * self.expert_params


# DeepSeek-V2-Lite: 27 layers (the first dense), 64 routed + 2 shared experts, top-6,
# hidden 2048, expert intermediate 1408; non-expert ~0.5B parameters (issue 14); MLA's
# compressed KV cache: 512 + 64 values per layer per token.
SHAPES: dict[str, ModelDims] = {
    "deepseek-v2-lite": ModelDims("deepseek-v2-lite", 26, 64, 6, 2048, 1408, 0.5e9,
                                  27 * (512 + 64) * 2.0),
    # GPT2-moe (Remoe V-A): 12 layers, 8 experts of the 768x3072 GPT-2 MLP, top-2.
    "gpt2-moe": ModelDims("gpt2-moe", 12, 8, 2, 768, 1024, 124e6 - 12 * 2 * 768 * 3072,
                          12 * 2 * 768 * 2.0),
}


def model_dims(name: str) -> ModelDims:
    if name not in SHAPES:
        raise UnknownNameError(f"no Remoe model shape '{name}'",
                               f"known: {', '.join(SHAPES)}")
    return SHAPES[name]


@dataclass(frozen=True)
class Timing:
    """CPU FLOP rates measured here (1 and 2 threads) and the GPU's datasheet roofline."""

    cpu_flops_1: float  # one token (decode): bound by reading the weights
    cpu_flops_batch: float  # 64 tokens (prefill)
    serial_fraction: float = 0.05  # Amdahl's f for thread scaling (ASSUMPTION)
    gpu_flops: float = A10_FLOPS_S  # the shared GPU model: moefleet.profiles.gpu
    gpu_bytes_s: float = A10_BYTES_S
    swap_bytes_s: float = PCIE4_BYTES_S
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def roofline(self) -> GpuRoofline:
        """This timing's GPU as the shared roofline (the simulator's GPU slices use it)."""
        return GpuRoofline(self.gpu_flops, self.gpu_bytes_s, self.swap_bytes_s)


def measure_cpu(dims: ModelDims, repeats: int = 15, distinct: int = 4) -> Timing:
    """Best FLOP rate of one expert on 1 and on 64 tokens (fp32, one torch thread): the
    fastest of ``repeats`` calls, because on a shared machine every slower call is another
    process's time slice, not the expert's.

    Each timed call uses the next of ``distinct`` experts' weights in turn, so that (as in
    a real decode step, which reads K experts per layer) the weights come from memory,
    not from a cache warmed by the previous call. fp32 because torch's bf16 matmul on CPUs
    without bf16 instructions is slower, not faster (checked on this machine)."""
    import torch

    ws = [(torch.randn(dims.hidden, 2 * dims.expert_intermediate),
           torch.randn(dims.expert_intermediate, dims.hidden)) for _ in range(max(1, distinct))]
    rates = []
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for n in (1, 64):
            x = torch.randn(n, dims.hidden)
            times = []
            for r in range(repeats + 1):
                w1, w2 = ws[r % len(ws)]
                t0 = time.perf_counter()
                gu = x @ w1
                g, u = gu.chunk(2, dim=1)
                (torch.nn.functional.silu(g) * u) @ w2
                if r:  # the first call pays one-off allocation costs
                    times.append(time.perf_counter() - t0)
            rates.append(n * dims.expert_flops_per_token / float(np.min(times)))
    finally:
        torch.set_num_threads(old)
    return Timing(rates[0], max(rates[0], rates[1]),
                  source=f"measured: {len(ws)} {dims.hidden}x{dims.expert_intermediate} "
                  f"SwiGLU experts in turn, 1 and 64 tokens, fp32 torch, 1 thread, fastest "
                  f"of {repeats}")


def _max_vcpus(spec: Any) -> float:
    """The most vCPUs one function of the platform gets (inf where it does not say)."""
    rule = spec.vcpu
    if rule is None:
        return math.inf
    if getattr(rule, "rule", "") == "table":
        return float(max(r.vcpu for r in rule.rows))
    return float(getattr(rule, "max_vcpu", getattr(rule, "vcpu", math.inf)))


def gb_per_vcpu(spec: Any) -> float:
    """GB of function memory per vCPU under the platform's rule (linear: its MB per vCPU;
    a table: the smallest size it gives one vCPU or more, per vCPU; none: the paper's 1)."""
    rule = spec.vcpu
    kind = getattr(rule, "rule", "")
    if kind == "linear":
        return float(rule.mb_per_vcpu) / 1024.0
    if kind == "table":
        row = next((r for r in rule.rows if r.vcpu >= 1.0), rule.rows[-1])
        return float(row.up_to_mb) / 1024.0 / float(row.vcpu)
    return 1.0


def problem_for(dims: ModelDims, timing: Timing, spec: Any, s_LE: np.ndarray, *,
                n_in: int, n_out: int, ttft_slo_s: float, tpot_slo_s: float,
                main_memory_mb: list[int] | None = None,
                remote_memory_mb: list[int] | None = None, gpu: bool = True,
                max_replicas: int = 8, model: str | None = None,
                remote_spec: Any = None, load_bytes_s: float = 0.0,
                runtime_mb: float = RUNTIME_MB) -> RemoeProblem:
    """A problem on platform ``spec`` (a faas PlatformSpec). CPU price per GB-s is memory
    plus its share of a vCPU under the remote platform's rule (the paper assumed 1 GB = 1
    vCPU; aws-lambda gives one per 1,769 MB); GPU price per GB of GPU
    memory, billed in the platform's slices. Memory options default to the platform's
    (remote functions up to 5 GB, as the paper's DeepSeek setting); given ones must be
    offered by the platform. ``load_bytes_s`` > 0 adds loading the weights at that rate
    to every cold start (e.g. the platform's object-store bandwidth)."""
    s_LE = np.asarray(s_LE, np.float64)
    if s_LE.shape != (dims.moe_layers, dims.experts):
        raise RemoeError(
            f"the activation matrix has shape {s_LE.shape}, but {dims.name} has "
            f"{dims.moe_layers} MoE layers x {dims.experts} experts",
            "the matrix was predicted for another model: predict it for this one")
    if not spec.is_faas:
        raise RemoeError(f"platform '{spec.name}' is not a FaaS platform",
                         "use e.g. alibaba-fc-gpu or gcp-cloud-run-l4")
    if gpu and spec.gpu is None:
        raise RemoeError(f"platform '{spec.name}' has no GPU functions",
                         "use a GPU platform (alibaba-fc-gpu, gcp-cloud-run-l4) or "
                         "--policy cpu")
    rspec = remote_spec or spec
    if not rspec.is_faas:
        raise RemoeError(f"remote platform '{rspec.name}' is not a FaaS platform",
                         "use e.g. alibaba-fc or gcp-cloud-run-functions")
    main = main_memory_mb or spec.memory_options_mb()
    r_offered = rspec.memory_options_mb()
    remote = remote_memory_mb or [m for m in r_offered if m <= 5120] or r_offered[:1]
    for what, sp, opts in (("main", spec, main), ("remote", rspec, remote)):
        bad = [m for m in opts if not sp.is_valid_memory(int(m))]
        if bad:
            raise RemoeError(
                f"{what} memory option(s) {bad[:5]} MB are not offered by '{sp.name}'",
                f"nearest valid options: {sp.nearest_memory_options(bad[0])} MB")
    pr, rpr = spec.prices, rspec.prices
    # One price for CPU GB-s: the remote platform's (the main's CPU part differs little).
    g = gb_per_vcpu(rspec)  # the remote functions' rule (the main's differs little)
    c_c = rpr.per_gb_s + rpr.per_vcpu_s / g
    max_vcpus = _max_vcpus(spec)
    c_g = pr.per_gpu_s / spec.gpu.memory_gb if (gpu and spec.gpu is not None) else 0.0
    slice_gb = spec.gpu.slice_gb if spec.gpu is not None else 1.0
    t1 = dims.expert_flops_per_token / timing.cpu_flops_1
    f = timing.serial_fraction
    v = np.arange(1, 9, dtype=np.float64)
    law = fit_time_law(1024 * g * v, t1 * (f + (1 - f) / v), gb_per_vcpu=g)
    B = dims.bytes_per_param
    ne_layer = dims.nonexpert_params / dims.moe_layers
    # Decode on a GPU is bound by reading the weights (batch 1): per layer and token.
    roof = timing.roofline()
    ne_gpu = roof.kernel_s(2 * ne_layer, ne_layer * B)
    ex_gpu = roof.kernel_s(2 * dims.expert_params, dims.expert_params * B)
    return RemoeProblem(
        model=model or dims.name, s_LE=s_LE, top_k=dims.top_k, n_in=n_in, n_out=n_out,
        ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s, main_memory_mb=tuple(main),
        remote_memory_mb=tuple(remote), cpu_price_gb_s=c_c, gpu_price_gb_s=c_g,
        token_bytes=float(dims.hidden * B),
        transfer_bytes_s=rspec.network.function_bandwidth_bytes_per_s,
        invoke_overhead_s=rspec.startup.warm_start_s, law=law,
        expert_bytes=float(dims.expert_params * B),
        nonexpert_bytes=float(dims.nonexpert_params * B),
        kv_bytes_per_token=dims.kv_bytes_per_token, nonexpert_token_s=ne_gpu,
        nonexpert_prefill_token_s=2 * ne_layer / timing.gpu_flops,
        prefill_factor=timing.cpu_flops_1 / timing.cpu_flops_batch,
        nonexpert_cpu_token_s=2 * ne_layer / timing.cpu_flops_1,
        gpu_expert_token_s=ex_gpu, swap_bytes_s=timing.swap_bytes_s,
        cold_main_s=spec.startup.cold_start_s, cold_remote_s=rspec.startup.cold_start_s,
        gpu_slice_gb=slice_gb, payload_bytes=float(rspec.limits.sync_payload_bytes),
        max_replicas=min(max_replicas, rspec.limits.max_replicas),
        max_vcpus=max_vcpus, cpu_mem_price_gb_s=rpr.per_gb_s, load_bytes_s=load_bytes_s,
        gpu_card_gb=float(spec.gpu.memory_gb) if spec.gpu is not None else math.inf,
        runtime_mb=runtime_mb, gpu_runtime_mb=GPU_RUNTIME_MB if gpu else 0.0,
        platform=spec.name if rspec is spec else f"{spec.name}+{rspec.name}")
