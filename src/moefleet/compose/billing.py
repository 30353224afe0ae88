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
  invocation and is not in this figure, unless the plan has a main function:
- ``InvocationBiller(..., main=MainPricing(...))`` (``serve --plan`` of a Remoe plan): the
  serving process *is* the main function (non-experts, KV cache, local experts), so its
  time is billed too. Each engine step's measured forward time (local experts and the wait
  on remote ones included) is split among the requests in the step by their share of its
  tokens; at finish a request's main-function seconds are priced as one invocation of the
  main function (its memory, the plan's GPU share, the per-request price, rounded to the
  platform's granularity) by the meter. Basis ``"invocations+main-time"``; the main part
  is labelled ``gpu``: ``"emulated"`` when the plan's GPU share is priced on CPU time.

Contract (what the worker relies on): every cost a biller returns from :meth:`step` or
:meth:`finish` is added to ``billed_cost_usd_total`` exactly once; :meth:`finish` pops the
request (a second call returns zero); :meth:`forget` drops an aborted request's share
(its invocations were still billed, and stay in the metrics).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from moefleet.platform import InvocationRecord, PlatformSpec
from moefleet.platform.billing import CostParts, Meter, price_invocation

if TYPE_CHECKING:
    from moefleet.engine import Engine, RequestOutput
    from moefleet.engine.scheduler import SchedulerOutput

BASIS_IN_PROCESS = "in-process-estimate"
BASIS_INVOCATIONS = "invocations"
BASIS_REMOE = "invocations+main-time"  # remote invocations + the main function's time
BASIS_MAIN_TIME = "main-time"  # the metrics basis of the main function's part
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
    main: float | None = None  # USD of the main function's time (Remoe plans only)
    remote: float | None = None  # USD of the remote invocations (Remoe plans only)
    gpu: str | None = None  # the main function's GPU: none | emulated | cuda:N

    @property
    def total(self) -> float:
        return self.compute + self.request + self.storage

    def to_dict(self) -> dict[str, float | int | str]:
        d: dict[str, float | int | str] = {
            "usd": self.total, "compute": self.compute, "requests": self.request,
            "storage": self.storage, "billed_seconds": self.billed_s,
            "platform": self.platform, "basis": self.basis}
        if self.basis in (BASIS_INVOCATIONS, BASIS_REMOE):
            d["invocations"] = self.invocations
        if self.main is not None:
            d.update(main_usd=self.main, remote_usd=self.remote or 0.0, gpu=self.gpu or "none")
        return d


ByFunction = dict[str, CostParts]


class Biller(Protocol):
    basis: str

    def basis_of(self, function: str) -> str: ...

    def attach(self, engine: Engine) -> None: ...

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
        cost, billed = price_invocation(self.spec, self.memory_mb, max(busy_s, 0.0))
        return RequestCost(cost.compute, cost.request, cost.storage, self.spec.name,
                           BASIS_IN_PROCESS, billed)


class InProcessBiller:
    """See the module docstring; the metrics move when a request finishes."""

    basis = BASIS_IN_PROCESS

    def __init__(self, pricer: InProcessPricer) -> None:
        self.pricer = pricer
        self._busy_s: dict[str, float] = {}

    def basis_of(self, function: str) -> str:
        return self.basis

    def attach(self, engine: Engine) -> None:
        """Nothing to learn from the engine's steps: the forward time comes with step()."""

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


class Attributed(Protocol):
    """What :class:`InvocationBiller` reads from whatever invokes functions for the engine
    (remote experts, the segment runner): records with ``{owner: share}``, owners being the
    sequence ids the runner set, and the caller's own store requests (cumulative)."""

    def drain(self) -> list[tuple[InvocationRecord, dict[str, float]]]: ...

    def store_requests(self) -> tuple[int, int]: ...


@dataclass(frozen=True)
class MainPricing:
    """The Remoe main function the serving process plays: its name (the metrics'
    ``function`` label), CPU memory, share of the platform GPU and that GPU's label
    (``none``, ``emulated``: its price applied to CPU time, or the CUDA device)."""

    function: str
    memory_mb: int
    gpu_share: float = 0.0
    gpu: str = "none"


@dataclass
class _Account:
    parts: CostParts = field(default_factory=CostParts)
    billed_s: float = 0.0
    invocations: int = 0
    main_s: float = 0.0  # the main function's seconds attributed to the request


class InvocationBiller:
    """See the module docstring. Also an engine ``StepHook``: before each step it learns
    which request each scheduled sequence belongs to (a request that finishes in the step
    is gone from the engine by the time its records are drained).

    ``audit`` keeps, per request, every ``(record, share)`` and the storage USD it was
    charged, so a test can re-price them independently (off in production: it grows with
    every request served)."""

    basis = BASIS_INVOCATIONS

    def __init__(self, sources: Sequence[Attributed], spec: PlatformSpec, *,
                 audit: bool = False, main: MainPricing | None = None) -> None:
        self.sources = list(sources)
        self.spec = spec
        self.main = main
        self.basis = BASIS_INVOCATIONS if main is None else BASIS_REMOE
        self.audit_main: dict[str, InvocationRecord] = {}  # with audit: the priced record
        self.unattributed_main_s = 0.0  # main-function time of aborted requests
        self.meter = Meter(spec)  # prices records; never accumulates (cost_of only)
        self._accounts: dict[str, _Account] = {}
        self._owner: dict[str, str] = {}  # sequence id (as the runner names it) -> request
        self._tokens: dict[str, int] = {}  # tokens of each request in the current step
        self._store_seen = [(0, 0) for _ in self.sources]
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
    def basis_of(self, function: str) -> str:
        if self.main is not None and function == self.main.function:
            return BASIS_MAIN_TIME + ("-gpu-emulated" if self.main.gpu == "emulated" else "")
        return BASIS_INVOCATIONS

    def register(self, rid: str) -> None:
        self._accounts[rid] = _Account()
        if self.audit is not None:
            self.audit[rid] = []

    def step(self, served: set[str], forward_s: float) -> ByFunction:
        billed: ByFunction = defaultdict(CostParts)
        for record, shares in (r for src in self.sources for r in src.drain()):
            cost, billed_s = self.meter.price(record)
            billed[record.function] += cost
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
        dp = dg = 0
        for i, src in enumerate(self.sources):
            puts, gets = src.store_requests()
            dp, dg = dp + puts - self._store_seen[i][0], dg + gets - self._store_seen[i][1]
            self._store_seen[i] = (puts, gets)
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
        if self.main is not None:
            self._split_main_time(forward_s)
        return dict(billed)

    def _split_main_time(self, forward_s: float) -> None:
        total = sum(self._tokens.values())
        if not total:
            self.unattributed_main_s += forward_s
            return
        for rid, n in self._tokens.items():
            acct = self._accounts.get(rid)
            if acct is None:
                self.unattributed_main_s += forward_s * n / total
            else:
                acct.main_s += forward_s * n / total

    def finish(self, rid: str) -> tuple[RequestCost, ByFunction]:
        acct = self._accounts.pop(rid, None) or _Account()
        p, main = acct.parts, self.main
        if main is None:
            return RequestCost(p.compute, p.request, p.storage, self.spec.name,
                               BASIS_INVOCATIONS, acct.billed_s, acct.invocations), {}
        # the request as one invocation of the main function, lasting its seconds there
        record = InvocationRecord(function=main.function, kind="main",
                                  memory_mb=main.memory_mb, start_s=0.0, end_s=acct.main_s,
                                  request_id=rid, gpu_share=main.gpu_share)
        own, main_billed_s = self.meter.price(record)
        if self.audit is not None:
            self.audit_main[rid] = record
        t = p + own
        return RequestCost(t.compute, t.request, t.storage, self.spec.name, BASIS_REMOE,
                           acct.billed_s + main_billed_s,
                           acct.invocations, main=own.total, remote=p.total,
                           gpu=main.gpu), {main.function: own}

    def forget(self, rid: str) -> None:
        acct = self._accounts.pop(rid, None)
        if acct is not None:
            self.unattributed += acct.parts
            self.unattributed_main_s += acct.main_s
        if self.audit is not None:
            self.audit.pop(rid, None)


def _scaled(c: CostParts, share: float) -> CostParts:
    return CostParts(c.compute * share, c.request * share, c.storage * share)
