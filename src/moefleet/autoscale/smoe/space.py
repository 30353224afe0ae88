"""The per-function configuration space sMoE chooses from, and its memory filter.

A configuration phi = (memory MB, replicas, concurrency); vCPUs follow memory by the
platform's rule (OpenFaaS/k8s-style, as in the paper's evaluation where a memory limit
sets the CPU share proportionally). The space is the Cartesian product of the option
lists, in a fixed order (memory-major), so an action is an index into ``configs``.

Memory filter (the paper's constraint 2, our reading for pod-style scaling, where a call
goes whole to one replica): a configuration is valid for a function iff
``alpha * memory >= runtime + parameters + 2 * bytes_per_token * peak_tokens * concurrency``
(an instance holds ``concurrency`` calls at once, each with its input and output
tokens). ``runtime_mb`` (Python + torch resident set) is an ASSUMPTION. At least one
configuration is always valid (the largest memory is kept when nothing fits, so the
policy never has an empty choice); the caller sees that case via ``any_fits``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import torch

from moefleet.autoscale.base import AutoscaleError, FunctionConfig

MB = 1024 * 1024


@dataclass(frozen=True)
class ConfigSpace:
    """Option lists (each strictly increasing, positive) and the filter's constants."""

    memory_mb: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
    replicas: tuple[int, ...] = (1, 2, 4, 8)
    concurrency: tuple[int, ...] = (1, 2, 4)
    alpha: float = 0.9  # usable share of the memory limit (the paper's loss factor)
    runtime_mb: float = 300.0  # ASSUMPTION: python + torch resident set of a function

    def __post_init__(self) -> None:
        for name in ("memory_mb", "replicas", "concurrency"):
            opts = getattr(self, name)
            if not opts or list(opts) != sorted(set(opts)) or opts[0] < 1:
                raise AutoscaleError(f"config space {name} {opts} must be strictly increasing "
                                     "positive integers", f"e.g. {name}=(1, 2, 4)")
        if not 0 < self.alpha <= 1 or self.runtime_mb < 0:
            raise AutoscaleError(f"alpha {self.alpha} must be in (0, 1] and runtime_mb "
                                 f"{self.runtime_mb} >= 0")

    @property
    def size(self) -> int:
        return len(self.memory_mb) * len(self.replicas) * len(self.concurrency)

    @property
    def configs(self) -> list[FunctionConfig]:
        return [FunctionConfig(m, r, c) for m in self.memory_mb for r in self.replicas
                for c in self.concurrency]

    def fingerprint(self) -> str:
        """Stable id of the space: a checkpoint is only valid for the same one."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def vectors(self) -> torch.Tensor:
        """One row per config: log-scaled memory, replicas, concurrency in [0, 1], and
        the relative price of holding ``replicas`` instances of that memory (c_PhiC)."""
        def scaled(v: int, opts: tuple[int, ...]) -> float:
            lo, hi = torch.tensor(float(opts[0])).log(), torch.tensor(float(opts[-1])).log()
            return 0.0 if hi == lo else float((torch.tensor(float(v)).log() - lo) / (hi - lo))

        rows = []
        top = self.memory_mb[-1] * self.replicas[-1]
        for cfg in self.configs:
            rows.append([scaled(cfg.memory_mb, self.memory_mb),
                         scaled(cfg.replicas, self.replicas),
                         scaled(cfg.concurrency, self.concurrency),
                         cfg.memory_mb * cfg.replicas / top])
        return torch.tensor(rows, dtype=torch.float32)

    def index_of(self, cfg: FunctionConfig) -> int:
        """The index of the option nearest ``cfg`` (each field rounded up to an option)."""
        def up(v: int, opts: tuple[int, ...]) -> int:
            return next((i for i, o in enumerate(opts) if o >= v), len(opts) - 1)

        m, r, c = (up(cfg.memory_mb, self.memory_mb), up(cfg.replicas, self.replicas),
                   up(cfg.concurrency, self.concurrency))
        return (m * len(self.replicas) + r) * len(self.concurrency) + c

    def valid_mask(self, param_bytes_N: torch.Tensor, peak_tokens_N: torch.Tensor,
                   bytes_per_token: int) -> torch.Tensor:
        """Bool [N, Phi]: which configs fit each of N functions (see the module doc)."""
        cfgs = self.configs
        mem_C = torch.tensor([c.memory_mb for c in cfgs], dtype=torch.float64)
        conc_C = torch.tensor([c.concurrency for c in cfgs], dtype=torch.float64)
        need_NC = (self.runtime_mb + param_bytes_N.double()[:, None] / MB
                   + 2.0 * bytes_per_token * peak_tokens_N.double()[:, None] * conc_C[None]
                   / MB)
        ok_NC = self.alpha * mem_C[None] >= need_NC
        # Never leave a function without a choice: the largest memory options stay.
        empty_N = ~ok_NC.any(dim=1)
        if bool(empty_N.any()):
            biggest_C = mem_C == mem_C.max()
            ok_NC[empty_N] = biggest_C & (conc_C == conc_C.min())
        return ok_NC

    def neighbours(self, memory: bool = False) -> torch.Tensor:
        """Bool [C, C]: ``n[a, b]`` iff config b is one option step away from a in exactly
        one of replicas, concurrency (and memory when ``memory``), same memory otherwise.
        Exploration moves along these edges; a memory step restarts the function cold,
        so exploring it breaks the SLO for the whole pipeline (see agent.py)."""
        nr, nc = len(self.replicas), len(self.concurrency)
        coords = [(i // (nr * nc), (i // nc) % nr, i % nc) for i in range(self.size)]
        out = torch.zeros(self.size, self.size, dtype=torch.bool)
        for a, ca in enumerate(coords):
            for b, cb in enumerate(coords):
                step = sum(abs(x - y) for x, y in zip(ca, cb, strict=True)) == 1
                out[a, b] = step and (memory or ca[0] == cb[0])
        return out

    def without_concurrency(self) -> ConfigSpace:
        """The same space with concurrency fixed to 1 (the w/o-CC ablation)."""
        return ConfigSpace(self.memory_mb, self.replicas, (1,), self.alpha, self.runtime_mb)
