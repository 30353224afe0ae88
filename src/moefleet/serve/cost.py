"""Billed cost of requests served in process: the platform's price applied to measured
durations.

Without a deployment plan nothing is invoked remotely, so the cost is an estimate: each
engine step's measured forward time is split equally among the requests the step served,
and each request is billed as one invocation of a function named ``main`` of
``memory_mb`` on the platform (rounded up to its billing granularity, plus its request
price). Every figure carries ``basis`` = ``"in-process-estimate"`` to say so.
"""

from __future__ import annotations

from dataclasses import dataclass

from moefleet.platform import PlatformSpec

BASIS_IN_PROCESS = "in-process-estimate"
FUNCTION_MAIN = "main"


@dataclass(frozen=True)
class RequestCost:
    compute: float
    request: float
    storage: float
    platform: str
    basis: str
    billed_s: float

    @property
    def total(self) -> float:
        return self.compute + self.request + self.storage

    def to_dict(self) -> dict[str, float | str]:
        return {"usd": self.total, "compute": self.compute, "requests": self.request,
                "storage": self.storage, "billed_seconds": self.billed_s,
                "platform": self.platform, "basis": self.basis}


class InProcessPricer:
    """Prices a request's share of measured forward time on ``spec`` at ``memory_mb``."""

    def __init__(self, spec: PlatformSpec, memory_mb: int) -> None:
        self.spec = spec
        self.memory_mb = spec.check_memory(memory_mb) if spec.is_faas else memory_mb

    def price(self, busy_s: float) -> RequestCost:
        billed = self.spec.invocation_billed_s(max(busy_s, 0.0))
        compute = self.spec.compute_cost(self.memory_mb, billed)
        return RequestCost(compute, self.spec.request_cost(1), 0.0, self.spec.name,
                           BASIS_IN_PROCESS, billed)
