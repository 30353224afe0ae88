"""The per-function configuration space sMoE chooses from, and its memory filter.

A configuration phi = (memory MB, GPU share, replicas, concurrency); vCPUs follow memory
by the platform's rule (OpenFaaS/k8s-style, as in the paper's evaluation where a memory
limit sets the CPU share proportionally). The space is the Cartesian product of the
option lists, in a fixed order (memory-major, then GPU share, replicas, concurrency), so
an action is an index into ``configs``. The GPU-share axis defaults to ``(0.0,)`` (CPU
only): the default space, its order, its vectors and its ``fingerprint()`` are then
exactly those of the space before the axis existed, so older checkpoints still load.

Memory filter (the paper's constraint 2, our reading for pod-style scaling, where a call
goes whole to one replica): a configuration is valid for a function iff
``alpha * memory >= runtime + parameters + 2 * bytes_per_token * peak_tokens * concurrency``
(an instance holds ``concurrency`` calls at once, each with its input and output
tokens). With a GPU share s > 0 the host also holds the CUDA runtime (``gpu_host_mb``:
1,280 MB measured on an H100 machine, ``profiles.gpu.GPU_RUNTIME_MB``), and the
weights and activations plus a CUDA context must fit ``alpha * s * gpu_memory_mb`` on the
slice (the host still stages the weights). ``runtime_mb`` (Python + torch resident set)
and ``gpu_context_mb`` are ASSUMPTIONS. At least one configuration is
always valid (the largest memory is kept when nothing fits, so the policy never has an
empty choice); the caller sees that case via ``any_fits``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import asdict, dataclass

import torch

from moefleet.autoscale.errors import AutoscaleError
from moefleet.control import FunctionConfig
from moefleet.profiles.gpu import GPU_RUNTIME_MB

MB = 1024 * 1024


@dataclass(frozen=True)
class ConfigSpace:
    """Option lists (each strictly increasing; positive integers, GPU shares in [0, 1])
    and the filter's constants."""

    memory_mb: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
    replicas: tuple[int, ...] = (1, 2, 4, 8)
    concurrency: tuple[int, ...] = (1, 2, 4)
    alpha: float = 0.9  # usable share of the memory limit (the paper's loss factor)
    runtime_mb: float = 300.0  # ASSUMPTION: python + torch resident set of a function
    gpu_share: tuple[float, ...] = (0.0,)  # fractions of one GPU; (0.0,) = CPU only
    gpu_memory_mb: int = 24576  # one card's memory (A10 / A10G: 24 GB)
    gpu_context_mb: float = 300.0  # ASSUMPTION: CUDA context + allocator slack on a slice
    gpu_host_mb: float = GPU_RUNTIME_MB  # host memory the CUDA runtime adds (measured)

    def __post_init__(self) -> None:
        for name in ("memory_mb", "replicas", "concurrency"):
            opts = getattr(self, name)
            if not opts or list(opts) != sorted(set(opts)) or opts[0] < 1:
                raise AutoscaleError(f"config space {name} {opts} must be strictly increasing "
                                     "positive integers", f"e.g. {name}=(1, 2, 4)")
        g = self.gpu_share
        if (not g or list(g) != sorted(set(g))
                or not all(math.isfinite(x) and 0.0 <= x <= 1.0 for x in g)):
            raise AutoscaleError(f"config space gpu_share {g} must be strictly increasing "
                                 "fractions of one GPU in [0, 1]",
                                 "e.g. gpu_share=(0, 0.25, 0.5, 1)")
        if not 0 < self.alpha <= 1 or self.runtime_mb < 0:
            raise AutoscaleError(f"alpha {self.alpha} must be in (0, 1] and runtime_mb "
                                 f"{self.runtime_mb} >= 0")
        if self.gpu_memory_mb < 1 or self.gpu_context_mb < 0 or self.gpu_host_mb < 0:
            raise AutoscaleError(f"gpu_memory_mb {self.gpu_memory_mb} must be >= 1, "
                                 f"gpu_context_mb {self.gpu_context_mb} and gpu_host_mb "
                                 f"{self.gpu_host_mb} >= 0")

    @property
    def has_gpu(self) -> bool:
        """Whether any option puts a function on a GPU slice."""
        return any(x > 0 for x in self.gpu_share)

    @property
    def size(self) -> int:
        return (len(self.memory_mb) * len(self.gpu_share) * len(self.replicas)
                * len(self.concurrency))

    @property
    def configs(self) -> list[FunctionConfig]:
        return [FunctionConfig(m, r, c, g) for m in self.memory_mb for g in self.gpu_share
                for r in self.replicas for c in self.concurrency]

    def fingerprint(self) -> str:
        """Stable id of the space: a checkpoint is only valid for the same one. A CPU-only
        space (``gpu_share == (0.0,)``) hashes without the GPU fields, i.e. exactly as
        before they existed, so existing checkpoints keep their id."""
        d = asdict(self)
        if not self.has_gpu:
            for key in ("gpu_share", "gpu_memory_mb", "gpu_context_mb", "gpu_host_mb"):
                del d[key]
        blob = json.dumps(d, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def vectors(self) -> torch.Tensor:
        """One row per config: log-scaled memory, replicas, concurrency in [0, 1], and
        the relative price of holding ``replicas`` instances of that memory (c_PhiC).
        A space with a GPU axis adds the share and share x replicas / the most replicas
        (the GPU part of the price); a CPU-only space keeps its 4 columns."""
        def scaled(v: int, opts: tuple[int, ...]) -> float:
            lo, hi = torch.tensor(float(opts[0])).log(), torch.tensor(float(opts[-1])).log()
            return 0.0 if hi == lo else float((torch.tensor(float(v)).log() - lo) / (hi - lo))

        rows = []
        top = self.memory_mb[-1] * self.replicas[-1]
        gpu = self.has_gpu
        for cfg in self.configs:
            row = [scaled(cfg.memory_mb, self.memory_mb),
                   scaled(cfg.replicas, self.replicas),
                   scaled(cfg.concurrency, self.concurrency),
                   cfg.memory_mb * cfg.replicas / top]
            if gpu:
                row += [cfg.gpu_share, cfg.gpu_share * cfg.replicas / self.replicas[-1]]
            rows.append(row)
        return torch.tensor(rows, dtype=torch.float32)

    def index_of(self, cfg: FunctionConfig) -> int:
        """The index of the option nearest ``cfg`` (each field rounded up to an option;
        a GPU share of 0 stays 0 when the space offers it)."""
        def up(v: float, opts: tuple[float, ...]) -> int:
            return next((i for i, o in enumerate(opts) if o >= v - 1e-9), len(opts) - 1)

        m, g, r, c = (up(cfg.memory_mb, self.memory_mb), up(cfg.gpu_share, self.gpu_share),
                      up(cfg.replicas, self.replicas), up(cfg.concurrency, self.concurrency))
        return ((m * len(self.gpu_share) + g) * len(self.replicas) + r) * len(
            self.concurrency) + c

    def valid_mask(self, param_bytes_N: torch.Tensor, peak_tokens_N: torch.Tensor,
                   bytes_per_token: int) -> torch.Tensor:
        """Bool [N, Phi]: which configs fit each of N functions (see the module doc)."""
        cfgs = self.configs
        mem_C = torch.tensor([c.memory_mb for c in cfgs], dtype=torch.float64)
        conc_C = torch.tensor([c.concurrency for c in cfgs], dtype=torch.float64)
        data_NC = (param_bytes_N.double()[:, None] / MB
                   + 2.0 * bytes_per_token * peak_tokens_N.double()[:, None] * conc_C[None]
                   / MB)
        ok_NC = self.alpha * mem_C[None] >= self.runtime_mb + data_NC
        if self.has_gpu:
            share_C = torch.tensor([c.gpu_share for c in cfgs], dtype=torch.float64)
            on_gpu_C = share_C > 0
            fits_NC = ((self.alpha * share_C[None] * self.gpu_memory_mb
                        >= self.gpu_context_mb + data_NC)
                       & (self.alpha * mem_C[None]
                          >= self.runtime_mb + self.gpu_host_mb + data_NC))
            ok_NC &= ~on_gpu_C[None] | fits_NC
        # Never leave a function without a choice: the largest memory options stay.
        empty_N = ~ok_NC.any(dim=1)
        if bool(empty_N.any()):
            biggest_C = mem_C == mem_C.max()
            fallback_C = biggest_C & (conc_C == conc_C.min())
            if self.has_gpu:  # the CPU-only option: it needs no slice to fit
                fallback_C &= torch.tensor([c.gpu_share == self.gpu_share[0] for c in cfgs])
            ok_NC[empty_N] = fallback_C
        return ok_NC

    def neighbours(self, memory: bool = False, gpu: bool = False) -> torch.Tensor:
        """Bool [C, C]: ``n[a, b]`` iff config b is one option step away from a in exactly
        one of replicas, concurrency (memory when ``memory``, GPU share when ``gpu``),
        the rest equal. Exploration moves along these edges. A memory step restarts the
        function cold, and so does a GPU-share step: a pod's GPU request cannot be
        resized in place (Kubernetes resizes only CPU and memory) and an MPS client's
        share is fixed when its CUDA context is created, so the platform starts new
        instances. Exploring either breaks the SLO for the whole pipeline (see
        agent.py), so both are off by default; the GPU axis is learnt from the teacher
        and the critic's soft action instead."""
        ng, nr, nc = len(self.gpu_share), len(self.replicas), len(self.concurrency)
        i_C = torch.arange(self.size)
        coords_C4 = torch.stack([i_C // (ng * nr * nc), (i_C // (nr * nc)) % ng,
                                 (i_C // nc) % nr, i_C % nc], dim=1)
        diff_CC4 = (coords_C4[:, None, :] - coords_C4[None, :, :]).abs()
        out = diff_CC4.sum(dim=-1) == 1
        if not memory:
            out &= diff_CC4[..., 0] == 0
        if not gpu:
            out &= diff_CC4[..., 1] == 0
        return out

    def without_concurrency(self) -> ConfigSpace:
        """The same space with concurrency fixed to 1 (the w/o-CC ablation)."""
        return dataclasses.replace(self, concurrency=(1,))
