"""The training loop of ``tiny-moe-lm``: deterministic, resumable, CPU-first.

Shape legend: B batch, T sequence length, L tokens in the training stream, V vocabulary.

Determinism: all randomness comes from explicit generators seeded by the recipe seed
(weight init) and by ``(seed, epoch)`` (data order); step ``s`` always trains on the
same batch whatever happened before, and the learning rate is a function of ``s``. A run
resumed from a checkpoint (model + optimizer state at step ``s``) therefore ends with the
same weights as an uninterrupted run, given the same thread count (part of the recipe)
and the same machine (kernels differ between CPU instruction sets).

Checkpoints are written atomically (temp file + rename) every ``checkpoint_every`` steps,
so an interrupted build loses at most that many steps.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moefleet.io import atomic_path
from moefleet.models.tinylm.bf16 import bf16_autocast, bf16_is_slow
from moefleet.models.tinylm.losses import balance_loss, cross_entropy
from moefleet.models.tinylm.model import ModelConfig, TinyMoELM
from moefleet.models.tinylm.recipe import TrainSpec
from moefleet.torch_io import load_torch_data

_log = logging.getLogger(__name__)

# step_done(step, total, loss) is called after every optimizer step (and after the
# checkpoint of that step, if any); raising from it interrupts training.
StepFn = Callable[[int, int, float], None]

_CHECKPOINT = "train_state.pt"


class BatchSampler:
    """Batch ``s`` = ``B`` windows of ``T + 1`` tokens, taken from a fixed tiling of the
    stream into non-overlapping windows, in an order reshuffled every epoch.

    Window ``g = s * B + b`` is window ``perm_e[g mod W]`` of epoch ``e = g // W``, where
    ``perm_e`` is a permutation drawn from a generator seeded by ``(seed, e)``: a pure
    function of ``(seed, s)``, so no sampler state needs checkpointing.
    """

    def __init__(self, stream_L: torch.Tensor, batch: int, seq_len: int, seed: int) -> None:
        self.windows = (stream_L.numel() - 1) // seq_len
        if self.windows < 1:
            raise ValueError(f"stream of {stream_L.numel()} tokens is shorter than one window")
        self.stream_L, self.batch, self.seq_len, self.seed = stream_L, batch, seq_len, seed
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.windows, generator=gen)}
        return self._perms[epoch]

    def batch_at(self, step: int) -> torch.Tensor:
        """ids_B(T+1) for optimizer step ``step`` (0-based)."""
        rows = []
        for g in range(step * self.batch, (step + 1) * self.batch):
            start = int(self._perm(g // self.windows)[g % self.windows]) * self.seq_len
            rows.append(self.stream_L[start : start + self.seq_len + 1])
        return torch.stack(rows)


def lr_at(step: int, spec: TrainSpec) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from ``lr`` to ``lr*min_lr_ratio``."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    span = max(1, spec.steps - spec.warmup)
    progress = min(1.0, (step - spec.warmup) / span)
    floor = spec.lr * spec.min_lr_ratio
    return floor + (spec.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: TinyMoELM, spec: TrainSpec) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (norm gains stay undecayed)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    keep = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": spec.weight_decay},
        {"params": keep, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def bf16_mode(precision: str) -> str | None:
    """How a ``precision`` recipe runs its bf16 products here: ``"native"`` autocast,
    ``"emulated"`` in float32 between bf16 roundings on a CPU whose bf16 matmuls are
    :data:`~moefleet.models.tinylm.bf16.SLOW_BF16` times slower than float32 or more
    (measured; on an AVX2 CPU without bf16 units native autocast trained at 32 s a step,
    600 steps over 5 hours), or None for an fp32 recipe. An emulated build is logged."""
    if precision != "bf16":
        return None
    if not bf16_is_slow():
        return "native"
    _log.info("bf16 autocast emulated in float32 (this CPU has no fast bf16 matmuls; "
              "same rounding points, float32 accumulation order differs)")
    return "emulated"


def train_step(
    model: TinyMoELM,
    opt: torch.optim.Optimizer,
    ids_BT1: torch.Tensor,
    spec: TrainSpec,
    lr: float,
    emulate_bf16: bool = False,
) -> tuple[float, float]:
    """One optimizer step on a batch of windows; returns (next-token loss, balance loss).
    ``emulate_bf16``: a bf16 recipe's autocast runs emulated (:mod:`.bf16`)."""
    for group in opt.param_groups:
        group["lr"] = lr
    with bf16_autocast(spec.precision == "bf16", emulate_bf16):
        logits_BTV, stats = model(ids_BT1[:, :-1])
    ce = cross_entropy(logits_BTV.reshape(-1, logits_BTV.shape[-1]), ids_BT1[:, 1:].reshape(-1))
    aux = balance_loss([s.aux_loss for s in stats])
    (ce + spec.aux_coef * aux).backward()
    if spec.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(ce.detach()), float(aux.detach())


@dataclass
class TrainResult:
    model: TinyMoELM
    steps: int
    resumed_from: int
    wall_s: float
    cpu_s: float
    tokens_per_s: float
    # (step, next-token loss, balance loss), one row every ``log_every`` steps.
    curve: list[tuple[int, float, float]] = field(default_factory=list)
    # How bf16 products ran (:func:`bf16_mode`): "native", "emulated", or None (fp32).
    bf16: str | None = None


def _save_checkpoint(path: Path, step: int, model: TinyMoELM, opt: Any, curve: list) -> None:
    with atomic_path(path) as tmp:
        torch.save(
            {"step": step, "model": model.state_dict(), "opt": opt.state_dict(), "curve": curve},
            tmp,
        )


def train(
    cfg: ModelConfig,
    spec: TrainSpec,
    stream_L: torch.Tensor,
    seed: int,
    checkpoint_dir: Path,
    step_done: StepFn | None = None,
    log_every: int = 10,
    init_state: dict[str, torch.Tensor] | None = None,
) -> TrainResult:
    """Train from scratch (or from ``init_state``, e.g. an upcycled model's weights), or
    resume from ``checkpoint_dir`` if it holds a checkpoint.

    The caller owns ``checkpoint_dir`` (one per recipe); it must not be shared between
    different recipes, since a checkpoint is trusted to belong to this run.
    """
    bf16 = bf16_mode(spec.precision)
    model = TinyMoELM(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    if init_state is not None:
        model.load_state_dict(init_state, strict=True)
    opt = make_optimizer(model, spec)
    sampler = BatchSampler(stream_L, spec.batch, spec.seq_len, seed)
    ckpt = checkpoint_dir / _CHECKPOINT
    start, curve = 0, []
    if ckpt.is_file():
        state = load_torch_data(ckpt, "training checkpoint", "delete it to train from the start")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start, curve = int(state["step"]), [tuple(row) for row in state["curve"]]
    model.train()
    t0, c0 = time.perf_counter(), time.process_time()
    for step in range(start, spec.steps):
        ce, aux = train_step(model, opt, sampler.batch_at(step), spec, lr_at(step, spec),
                             emulate_bf16=bf16 == "emulated")
        if not math.isfinite(ce):
            raise FloatingPointError(f"training diverged at step {step + 1} (loss {ce})")
        if (step + 1) % log_every == 0 or step + 1 == spec.steps:
            curve.append((step + 1, ce, aux))
        if (step + 1) % spec.checkpoint_every == 0 and step + 1 < spec.steps:
            _save_checkpoint(ckpt, step + 1, model, opt, curve)
        if step_done is not None:
            step_done(step + 1, spec.steps, ce)
    wall = time.perf_counter() - t0
    tokens = (spec.steps - start) * spec.batch * spec.seq_len
    return TrainResult(
        model=model.eval(),
        steps=spec.steps,
        resumed_from=start,
        wall_s=wall,
        cpu_s=time.process_time() - c0,
        tokens_per_s=tokens / wall if wall > 0 else 0.0,
        curve=curve,
        bf16=bf16,
    )
