"""Billed cost of served requests: one :class:`Biller` per server, two implementations.

- :class:`InProcessBiller` (no deployment plan): nothing is invoked remotely, so the cost
  is an estimate. Each engine step's measured forward time is split equally among the
  requests the step served, and each request is billed as one invocation of a function
  named ``main`` of ``memory_mb`` on the platform (rounded up to its billing granularity,
  plus its request price). Basis ``"in-process-estimate"``.
- :class:`InvocationBiller` (``serve --plan``): the experts run in the plan's functions;
  every invocation record is priced as the platform's meter prices it and split among the
  requests whose tokens it carried, by their share of its tokens. The engine process's
  own object-store requests are split by the step's token shares. Basis
  ``"invocations"``. The serving process's own compute (attention, router) is not an
  invocation and is not in this figure.

Contract (what the worker relies on): every cost a biller returns from :meth:`step` or
:meth:`finish` is added to ``billed_cost_usd_total`` exactly once; :meth:`finish` pops the
request (a second call returns zero); :meth:`forget` drops an aborted request's share
(its invocations were still billed, and stay in the metrics).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from moefleet.platform import InvocationRecord, PlatformSpec
from moefleet.platform.billing import CostParts, Meter

if TYPE_CHECKING:
    from moefleet.engine import Engine, RequestOutput
    from moefleet.engine.scheduler import SchedulerOutput

BASIS_IN_PROCESS = "in-process-estimate"
BASIS_INVOCATIONS = "invocations"
FUNCTION_MAIN = "main"
FUNCTION_ENGINE = "<engine>"  # object-store requests the serving process made itself


@dataclass(frozen=True)
class RequestCost:
    compute: float
    request: float
    storage: float
    platform: str
    basis: str
    billed_s: float
    invocations: int = 0  # invocation records attributed (any share) to the request

    @property
    def total(self) -> float:
        return self.compute + self.request + self.storage

    def to_dict(self) -> dict[str, float | int | str]:
        d: dict[str, float | int | str] = {
            "usd": self.total, "compute": self.compute, "requests": self.request,
            "storage": self.storage, "billed_seconds": self.billed_s,
            "platform": self.platform, "basis": self.basis}
        if self.basis == BASIS_INVOCATIONS:
            d["invocations"] = self.invocations
        return d


ByFunction = dict[str, CostParts]


class Biller(Protocol):
    basis: str

    def register(self, rid: str) -> None: ...

    def step(self, served: set[str], forward_s: float) -> ByFunction: ...

    def finish(self, rid: str) -> tuple[RequestCost, ByFunction]: ...

    def forget(self, rid: str) -> None: ...


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


class InProcessBiller:
    """See the module docstring; the metrics move when a request finishes."""

    basis = BASIS_IN_PROCESS

    def __init__(self, pricer: InProcessPricer) -> None:
        self.pricer = pricer
        self._busy_s: dict[str, float] = {}

    def register(self, rid: str) -> None:
        self._busy_s[rid] = 0.0

    def step(self, served: set[str], forward_s: float) -> ByFunction:
        mine = served & self._busy_s.keys()
        share = forward_s / len(mine) if mine else 0.0
        for rid in mine:
            self._busy_s[rid] += share
        return {}

    def finish(self, rid: str) -> tuple[RequestCost, ByFunction]:
        cost = self.pricer.price(self._busy_s.pop(rid, 0.0))
        return cost, {FUNCTION_MAIN: CostParts(cost.compute, cost.request, cost.storage)}

    def forget(self, rid: str) -> None:
        self._busy_s.pop(rid, None)


class AttributedExperts(Protocol):
    """What :class:`InvocationBiller` reads from an ExpertFn that invokes functions
    (``RemoteExperts``): records with ``{owner: share}``, owners being the sequence ids the
    runner set, and the caller's own store requests (cumulative)."""

    def drain(self) -> list[tuple[InvocationRecord, dict[str, float]]]: ...

    def store_requests(self) -> tuple[int, int]: ...


@dataclass
class _Account:
    parts: CostParts = field(default_factory=CostParts)
    billed_s: float = 0.0
    invocations: int = 0


class InvocationBiller:
    """See the module docstring. Also an engine ``StepHook``: before each step it learns
    which request each scheduled sequence belongs to (a request that finishes in the step
    is gone from the engine by the time its records are drained).

    ``audit`` keeps, per request, every ``(record, share)`` and the storage USD it was
    charged, so a test can re-price them independently (off in production: it grows with
    every request served)."""

    basis = BASIS_INVOCATIONS

    def __init__(self, experts: AttributedExperts, spec: PlatformSpec, *,
                 audit: bool = False) -> None:
        self.experts = experts
        self.spec = spec
        self.meter = Meter(spec)  # prices records; never accumulates (cost_of only)
        self._accounts: dict[str, _Account] = {}
        self._owner: dict[str, str] = {}  # sequence id (as the runner names it) -> request
        self._tokens: dict[str, int] = {}  # tokens of each request in the current step
        self._store_seen = (0, 0)
        self.audit: dict[str, list[tuple[InvocationRecord, float]]] | None = (
            {} if audit else None)
        self.audit_storage: dict[str, float] = defaultdict(float)
        self.unattributed = CostParts()  # records no open request owned (aborted, warm-up)
        self._engine_seqs: dict[int, Any] = {}

    # -- StepHook -------------------------------------------------------------------------
    def before_step(self, out: SchedulerOutput, now: float) -> None:
        seqs = self._engine_seqs
        self._owner, self._tokens = {}, defaultdict(int)
        for row in out.rows:
            rid = seqs[row.seq_id].request_id
            self._owner[str(row.seq_id)] = rid
            self._tokens[rid] += len(row.token_ids)

    def after_step(self, outputs: list[RequestOutput], now: float) -> None:
        pass

    def attach(self, engine: Engine) -> None:
        """Install as ``engine``'s hook (call once, before serving)."""
        self._engine_seqs = engine.scheduler.seqs
        engine.hooks.append(self)

    # -- Biller ---------------------------------------------------------------------------
    def register(self, rid: str) -> None:
        self._accounts[rid] = _Account()
        if self.audit is not None:
            self.audit[rid] = []

    def step(self, served: set[str], forward_s: float) -> ByFunction:
        billed: ByFunction = defaultdict(CostParts)
        for record, shares in self.experts.drain():
            cost = self.meter.cost_of(record)
            billed[record.function] += cost
            billed_s = self.spec.invocation_billed_s(record.duration_s, record.init_s)
            for owner, share in shares.items():
                acct = self._accounts.get(self._owner.get(owner, ""))
                part = _scaled(cost, share)
                if acct is None:
                    self.unattributed += part
                    continue
                acct.parts += part
                acct.billed_s += billed_s * share
                acct.invocations += 1
                if self.audit is not None:
                    self.audit[self._owner[owner]].append((record, share))
        puts, gets = self.experts.store_requests()
        dp, dg = puts - self._store_seen[0], gets - self._store_seen[1]
        self._store_seen = (puts, gets)
        if dp or dg:
            usd = self.spec.storage_request_cost(dp, dg)
            billed[FUNCTION_ENGINE] += CostParts(storage=usd)
            total = sum(self._tokens.values())
            for rid, n in self._tokens.items():
                acct = self._accounts.get(rid)
                if acct is None or not total:
                    continue
                acct.parts += CostParts(storage=usd * n / total)
                self.audit_storage[rid] += usd * n / total
        return dict(billed)

    def finish(self, rid: str) -> tuple[RequestCost, ByFunction]:
        acct = self._accounts.pop(rid, None) or _Account()
        p = acct.parts
        return RequestCost(p.compute, p.request, p.storage, self.spec.name,
                           BASIS_INVOCATIONS, acct.billed_s, acct.invocations), {}

    def forget(self, rid: str) -> None:
        acct = self._accounts.pop(rid, None)
        if acct is not None:
            self.unattributed += acct.parts
        if self.audit is not None:
            self.audit.pop(rid, None)


def _scaled(c: CostParts, share: float) -> CostParts:
    return CostParts(c.compute * share, c.request * share, c.storage * share)
