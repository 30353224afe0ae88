"""Homogeneous Poisson arrivals: exponential inter-arrival times with mean ``1/rate_rps``."""

from __future__ import annotations

from typing import Any

import numpy as np

from moefleet.workloads.base import (
    Arrival,
    Workload,
    check_duration,
    check_positive,
    check_seed,
    cumulative_until,
    to_arrivals,
)


class PoissonWorkload(Workload):
    """Poisson process with ``rate_rps`` requests per second (inter-arrival CV = 1).

    Generated as partial sums of exponential gaps, so a longer horizon with the same seed
    extends the list without moving earlier arrivals.
    """

    name = "poisson"

    def __init__(self, rate_rps: float) -> None:
        self.rate_rps = check_positive("rate_rps", rate_rps)

    def arrivals(self, duration_s: float, seed: int) -> list[Arrival]:
        duration = check_duration(duration_s)
        rng = np.random.default_rng(check_seed(seed))
        scale = 1.0 / self.rate_rps
        times = cumulative_until(lambda g, n: g.exponential(scale, n), duration, rng)
        return to_arrivals(times, self.name)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.name, "rate_rps": self.rate_rps, "cv": 1.0}
