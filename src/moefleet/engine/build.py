"""What sizes an engine (device, sequence and token limits: checked before a model loads)
and a summary of a finished run. Engines are built by :mod:`moefleet.compose`."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from moefleet.engine.request import EngineError, RequestOutput

MAX_NUM_SEQS = 1024  # bounds what a user number can allocate (rows of one step)


def resolve_device(device: str) -> torch.device:
    """``auto`` (CUDA where torch sees a GPU, else the CPU), ``cpu``, ``cuda`` or
    ``cuda:N``; CUDA only where torch sees a GPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise EngineError(f"device {device!r} requested but torch sees no CUDA GPU here",
                              "use --device cpu")
        return torch.device(device)
    raise EngineError(f"unknown device {device!r}", "use auto, cpu, cuda or cuda:N")


def check_engine_args(device: str, max_num_seqs: int, max_num_batched_tokens: int = 2048
                      ) -> torch.device:
    """Validate what sizes an engine before any model is loaded; returns the device."""
    if not 1 <= max_num_seqs <= MAX_NUM_SEQS:
        raise EngineError(f"max_num_seqs must be in [1, {MAX_NUM_SEQS}], got {max_num_seqs}",
                          "running sequences share one step; 64 is a good default")
    if not 1 <= max_num_batched_tokens <= 65_536:
        raise EngineError(f"max_num_batched_tokens must be in [1, 65536], got "
                          f"{max_num_batched_tokens}", "2048 is a good default")
    return resolve_device(device)


@dataclass(frozen=True)
class RunSummary:
    """Latency and throughput of finished requests (seconds; medians and p90)."""

    requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    e2e_p50_s: float

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        d = dict(self.__dict__)
        d["output_tokens_per_s"] = self.output_tokens_per_s
        return d


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1]


def summarize(outputs: list[RequestOutput], wall_s: float) -> RunSummary:
    times = [o.times for o in outputs if o.times is not None]
    ttft = [t.ttft_s for t in times if t.ttft_s is not None]
    tpot = [t.tpot_s for t in times if t.tpot_s is not None]
    e2e = [t.e2e_s for t in times if t.e2e_s is not None]
    return RunSummary(len(outputs), sum(o.num_prompt_tokens for o in outputs),
                      sum(len(o.new_token_ids) for o in outputs), wall_s,
                      _pct(ttft, 50), _pct(ttft, 90), _pct(tpot, 50), _pct(tpot, 90),
                      _pct(e2e, 50))
