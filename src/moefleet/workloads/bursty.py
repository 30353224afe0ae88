"""Renewal arrivals with a chosen inter-arrival coefficient of variation (CV).

Inter-arrival times are gamma distributed with shape ``k = 1/cv**2`` and scale
``cv**2 / rate_rps``, so their mean is ``1/rate_rps`` and their CV (std / mean) is ``cv``:

* ``cv = 1`` gives shape 1, the exponential distribution: a Poisson process;
* ``cv < 1`` is smoother than Poisson (``cv = 0`` is the deterministic limit: one request
  every ``1/rate_rps`` seconds, first at ``1/rate_rps``);
* ``cv > 1`` is bursty: many tiny gaps (clusters) separated by long silences. The sMoE
  paper calls inter-arrival CV > 3 "bursty", 1..3 "normal", < 1 "slow".

The process starts at 0 with a fresh gap (an ordinary renewal process), so the first
arrival is the first gap. Times are partial sums of the gaps: a longer horizon with the
same seed extends the list without moving earlier arrivals.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moefleet.workloads.base import (
    Arrival,
    Workload,
    check_duration,
    check_non_negative,
    check_positive,
    check_seed,
    cumulative_until,
    to_arrivals,
)


class BurstyWorkload(Workload):
    """Gamma renewal process: mean rate ``rate_rps`` (req/s), inter-arrival CV ``cv``."""

    name = "bursty"

    def __init__(self, rate_rps: float, cv: float) -> None:
        self.rate_rps = check_positive("rate_rps", rate_rps)
        self.cv = check_non_negative("cv", cv)

    @property
    def gamma_shape(self) -> float:
        """Shape ``k = 1/cv**2`` of the gamma inter-arrival law (inf for ``cv = 0``)."""
        return float("inf") if self.cv == 0 else 1.0 / self.cv**2

    def arrivals(self, duration_s: float, seed: int) -> list[Arrival]:
        duration = check_duration(duration_s)
        rng = np.random.default_rng(check_seed(seed))
        mean_gap = 1.0 / self.rate_rps
        if self.cv == 0:
            times = cumulative_until(lambda g, n: np.full(n, mean_gap), duration, rng)
        else:
            shape = self.gamma_shape
            scale = mean_gap / shape
            times = cumulative_until(
                lambda g, n: g.standard_gamma(shape, n) * scale, duration, rng
            )
        return to_arrivals(times, self.name)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.name, "rate_rps": self.rate_rps, "cv": self.cv,
                "gamma_shape": self.gamma_shape}
