"""The one GPU time model of moefleet: a datasheet roofline (nothing is measured on a GPU),
and the host memory a function's runtimes take (measured, on a CPU and on an H100).

Remoe's planner (:mod:`moefleet.plan.remoe.shapes`) prices its GPU main function with
it, and the simulator times expert and segment calls on a GPU slice with it
(:func:`gpu_call_s`); every figure that depends on it is "GPU emulated".

A kernel over ``flops`` FLOPs that reads ``weight_bytes`` of weights takes
``max(flops / flops_s, weight_bytes / bytes_s)`` on the whole card (compute- or
bandwidth-bound, whichever is slower). A call on an MPS-style slice of share s runs
that kernel at s of the card, so it takes 1 / s as long. Host <-> device copies run at
``copy_bytes_s`` (PCIe) whatever the share.

Defaults: NVIDIA A10 (bf16 tensor peak 125 TFLOP/s, 600 GB/s) at 30% and 70% of peak,
PCIe 4.0 x16 at 12 GB/s effective: all ASSUMPTIONS, as Remoe's ``Timing`` has always
used them. Units: seconds, FLOPs, bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moefleet.errors import MoefleetError

# Host memory a function needs before any weight (MB), measured with
# ``moefleet.runtime.local_limits.rss_bytes`` (README, "Measured on a real GPU (H100)"):
# RUNTIME_MB: a ready local worker (Python + torch + moefleet), 233 MB here (torch 2.13,
# CPU build), rounded up. GPU_RUNTIME_MB: what a GPU main adds on an H100 machine (torch
# 2.11 + CUDA 13): the CUDA build of torch (505 MB ready worker), its context and cuBLAS
# (+263 MB) and the kernels a step loads. The GPU-only plan's main of tiny-moe-lm-e32 (no
# host-resident weights) peaked at 1,357 MB RSS there: 1,101 MB over RUNTIME_MB, rounded
# up to 1,280 MB for the kernels other batch shapes load. Sized without it, that main
# (1,024 MB) did not start: 1,240 MB used during init.
# GPU_EMULATED_HOST_MB: what a main with an emulated GPU is charged on a CPU-only machine
# (the local backend's limits), i.e. what CUDA adds to the *same* main: the GPU-only
# plan's main peaked at 1,357 MB on the H100 and at 447 MB on this CPU (its non-experts
# in host memory), 910 MB apart, rounded up. Planner and charge then agree: that main is
# sized 1,600 MB and is charged 447 + 1,024 MB here.
RUNTIME_MB = 256.0
GPU_RUNTIME_MB = 1280.0
GPU_EMULATED_HOST_MB = 1024.0

A10_FLOPS_S = 125e12 * 0.3  # A10 bf16 tensor peak x 30% (ASSUMPTION)
A10_BYTES_S = 600e9 * 0.7  # A10 600 GB/s x 70% (ASSUMPTION)
PCIE4_BYTES_S = 12e9  # PCIe 4.0 x16 host<->device, effective (ASSUMPTION)
GPU_BYTES_PER_PARAM = 2  # weights held in bf16 on the GPU (as Remoe's model dims)
PROFILE_BYTES_PER_PARAM = 4  # compute profiles count fp32 parameter bytes


@dataclass(frozen=True)
class GpuRoofline:
    """A GPU's sustained FLOP rate, weight-read bandwidth and host-copy bandwidth."""

    flops_s: float = A10_FLOPS_S
    bytes_s: float = A10_BYTES_S
    copy_bytes_s: float = PCIE4_BYTES_S

    def __post_init__(self) -> None:
        for name in ("flops_s", "bytes_s", "copy_bytes_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise MoefleetError(f"GPU roofline {name} must be a positive rate, got {v!r}")

    def kernel_s(self, flops: float, weight_bytes: float) -> float:
        """Seconds of a kernel on the whole card (the roofline)."""
        return max(flops / self.flops_s, weight_bytes / self.bytes_s)

    def copy_s(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` between host and device."""
        return nbytes / self.copy_bytes_s


def gpu_call_s(roof: GpuRoofline, share: float, tokens: int, profile_param_bytes: int,
               bytes_per_token: int) -> float:
    """GPU part of one call of ``tokens`` tokens through a function whose compute
    profile counts ``profile_param_bytes`` (fp32) of weights, on a slice ``share``:
    the kernel (2 FLOPs per parameter per token, bf16 weights read once) / share, plus
    copying the call's activations to the device and back (``bytes_per_token`` each
    way). The caller adds the host-side per-call overhead."""
    if not 0 < share <= 1:
        raise MoefleetError(f"a GPU call needs a share in (0, 1], got {share!r}")
    params = profile_param_bytes / PROFILE_BYTES_PER_PARAM
    kernel = roof.kernel_s(2.0 * params * tokens, params * GPU_BYTES_PER_PARAM)
    return kernel / share + roof.copy_s(2.0 * tokens * bytes_per_token)
