"""A FaaSConf-like controller: one independent agent per function (multi-agent, no
shared state, no view of the pipeline's topology).

FaaSConf learns a policy per function of a serverless workflow. This is a SIMPLIFIED
stand-in for the sMoE comparison: every function's agent gets an equal share of the
end-to-end SLO as its latency budget (SLO / the pipeline's function hops) and climbs a
fixed ladder of configurations by its own tail latency and utilisation - up one rung
when its P95 exceeds the budget or calls queue, down one when its P95 is under half the
budget and utilisation is low. It keeps FaaSConf's structure (per-function agents,
local observations, joint memory/replica/concurrency knobs) without its learned Q
functions.
"""

from __future__ import annotations

from collections.abc import Sequence

from moefleet.autoscale.errors import AutoscaleError
from moefleet.control import (
    Decisions,
    FunctionConfig,
    MetricsSnapshot,
    PolicyState,
    ScalingController,
)


def default_ladder(memory_mb: Sequence[int], replicas: Sequence[int]) -> list[FunctionConfig]:
    """Rungs from cheapest to largest: memory first (faster calls), then replicas."""
    rungs = [FunctionConfig(m, replicas[0], 1) for m in memory_mb]
    rungs += [FunctionConfig(memory_mb[-1], r, 1) for r in replicas[1:]]
    return rungs


class FaaSConfLikePolicy(ScalingController):
    """Per-function agents on a configuration ladder (see the module doc)."""

    name = "faasconf"

    def __init__(self, slo_s: float, hops: int, ladder: Sequence[FunctionConfig],
                 low_utilisation: float = 0.3) -> None:
        if slo_s <= 0 or hops < 1 or not ladder:
            raise AutoscaleError(f"FaaSConf-like needs slo_s > 0, hops >= 1 and a ladder "
                                 f"(got {slo_s}, {hops}, {len(ladder)} rungs)")
        self.budget_s = slo_s / hops
        self.ladder = list(ladder)
        self.low = low_utilisation

    def _rung(self, cfg: FunctionConfig) -> int:
        best = 0
        for i, r in enumerate(self.ladder):
            if r.memory_mb <= cfg.memory_mb and r.replicas <= cfg.replicas:
                best = i
        return best

    def decide(self, snapshot: MetricsSnapshot, state: PolicyState) -> tuple[Decisions,
                                                                             PolicyState]:
        out: Decisions = {}
        for name, m in snapshot.functions.items():
            i = self._rung(m.config)
            if m.calls == 0 and m.queued == 0:
                continue
            if m.p95_latency_s > self.budget_s or m.queued > 0:
                j = min(i + 1, len(self.ladder) - 1)
            elif m.p95_latency_s < 0.5 * self.budget_s and m.utilisation < self.low:
                j = max(i - 1, 0)
            else:
                j = i
            if self.ladder[j] != m.config:
                out[name] = self.ladder[j]
        return out, state
