"""Streaming statistics: memory stays bounded however long the run.

:class:`StreamStats` keeps count, sum, min and max exactly and a sparse log-binned
histogram for percentiles: bin i covers [lo·g^i, lo·g^(i+1)) with g = 1 + ``rel``, so a
percentile is within ``rel`` (0.2% by default) of the exact order statistic, and exact
when every sample is equal (it is clamped to [min, max]). Memory is one counter per
occupied bin (at most ~log(max/min)/rel of them), never one entry per sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StreamStats:
    rel: float = 0.002
    lo: float = 1e-9
    count: int = 0
    total: float = 0.0
    min: float = math.inf
    max: float = -math.inf
    _bins: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._log_g = math.log1p(self.rel)

    def add(self, x: float) -> None:
        self.count += 1
        self.total += x
        if x < self.min:
            self.min = x
        if x > self.max:
            self.max = x
        i = int(math.log(x / self.lo) / self._log_g) if x > self.lo else -1
        self._bins[i] = self._bins.get(i, 0) + 1

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    def quantile(self, q: float) -> float:
        """The q-quantile (0..1) by the nearest-rank rule; nan when empty."""
        if not self.count:
            return math.nan
        rank = max(1, math.ceil(q * self.count))
        seen = 0
        for i in sorted(self._bins):
            seen += self._bins[i]
            if seen >= rank:
                mid = self.lo * math.exp((i + 0.5) * self._log_g) if i >= 0 else self.lo
                return min(max(mid, self.min), self.max)
        return self.max

    def summary(self) -> dict[str, Any]:
        """JSON-ready: count, mean, p50/p90/p95/p99, min, max (None when empty)."""
        if not self.count:
            return {"count": 0, "mean": None, "p50": None, "p90": None, "p95": None,
                    "p99": None, "min": None, "max": None}
        return {"count": self.count, "mean": self.mean, "p50": self.quantile(0.5),
                "p90": self.quantile(0.9), "p95": self.quantile(0.95),
                "p99": self.quantile(0.99), "min": self.min, "max": self.max}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank q-quantile of a short list (one interval's samples); 0 when empty."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


@dataclass
class RequestStats:
    """Per-request outcomes over the whole run (streamed)."""

    latency: StreamStats = field(default_factory=StreamStats)
    ttft: StreamStats = field(default_factory=StreamStats)
    tpot: StreamStats = field(default_factory=StreamStats)
    queue: StreamStats = field(default_factory=StreamStats)
    arrived: int = 0
    completed: int = 0
    slo_violations: int = 0  # requests over any SLO
    slo_by_phase: dict[str, int] = field(default_factory=lambda: {"ttft": 0, "tpot": 0,
                                                                  "e2e": 0})
    prompt_tokens: int = 0
    output_tokens: int = 0


@dataclass
class IntervalStats:
    """Requests in the current interval; cleared at every snapshot."""

    arrivals: int = 0
    completions: int = 0
    violations: int = 0
    latencies: list[float] = field(default_factory=list)

    def reset(self) -> None:
        self.arrivals = self.completions = self.violations = 0
        self.latencies = []
