"""One row of the comparison table and how its figures are computed from per-request
latencies.

Invariants: a row either has figures (``absent`` is None, cost and latencies set) or
says why the policy could not run on this scenario (``absent``: the reason, figures
None). Cost per 1M output tokens is the run's whole bill over the output tokens its
requests produced. SLO attainment is the share of requests whose TTFT and TPOT are both
within their SLOs (a request with one output token has no TPOT and is judged on TTFT).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

FIDELITY = ("simulated", "emulated", "measured")


@dataclass
class Row:
    policy: str
    family: str
    platform: str
    fidelity: str = "simulated"
    absent: str | None = None
    cost_usd: float | None = None
    output_tokens: int = 0
    requests: int = 0
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_p95_s: float | None = None
    ttft_warm_p95_s: float | None = None  # Remoe rows: from the main's start (no cold wait)
    slo_attainment: float | None = None
    cold_starts: int | None = None
    gpu_s: float | None = None
    accuracy_cost: str = "none"
    bill: dict[str, float] = field(default_factory=dict)  # term -> USD
    notes: list[str] = field(default_factory=list)
    command: str = ""
    measured: dict[str, Any] | None = None

    @property
    def cost_per_1m(self) -> float | None:
        if self.cost_usd is None or self.output_tokens <= 0:
            return None
        return self.cost_usd / self.output_tokens * 1e6

    @property
    def meets_slo(self) -> bool:
        return self.slo_attainment is not None and self.slo_attainment >= SLO_TARGET

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["cost_per_1m_usd"] = self.cost_per_1m
        out["meets_slo"] = self.meets_slo
        return out


SLO_TARGET = 0.9  # a policy "meets the SLO" when >= 90% of its requests are within both


def fill_latency(row: Row, ttft_s: np.ndarray, tpot_s: np.ndarray, outputs: np.ndarray,
                 slo_ttft_s: float, slo_tpot_s: float) -> Row:
    """Percentiles and SLO attainment from one value per request (``tpot_s`` is ignored
    where a request produced one token)."""
    ttft = np.asarray(ttft_s, np.float64)
    tpot = np.asarray(tpot_s, np.float64)
    out = np.asarray(outputs)
    row.requests = len(ttft)
    if not len(ttft):
        row.slo_attainment = None
        return row
    row.ttft_p50_s = float(np.percentile(ttft, 50))
    row.ttft_p95_s = float(np.percentile(ttft, 95))
    multi = out > 1
    if multi.any():
        row.tpot_p50_s = float(np.percentile(tpot[multi], 50))
        row.tpot_p95_s = float(np.percentile(tpot[multi], 95))
    ok = (ttft <= slo_ttft_s) & (~multi | (tpot <= slo_tpot_s))
    row.slo_attainment = float(ok.mean())
    return row


def absent(policy: str, family: str, platform: str, why: str, command: str = "") -> Row:
    return Row(policy, family, platform, absent=why, command=command)
