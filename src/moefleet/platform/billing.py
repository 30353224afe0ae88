"""Billing: invocation records in, billed cost out (per function, expert, layer, request).

Units: times in seconds, sizes in bytes, memory in MB, money in USD.

A FaaS bill has three parts, all from the ``PlatformSpec``:
- compute: (memory GB x per_gb_s + vCPUs x per_vcpu_s + GPU share x per_gpu_s) x billed s,
  where billed s = the handler time (plus INIT where the platform bills it) rounded up to
  the billing granularity, at least the minimum billed duration;
- request: per_request per invocation;
- storage: price_per_put / price_per_get per object-store request the invocation made.
Storage transfer within a region and storage GB-months are not billed here (free, or
outside one run's scope). Rented machines (``cluster``/``server``) use :func:`bill_cluster`.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from moefleet.platform.errors import PlatformError
from moefleet.platform.specs import MB_PER_GB, PlatformSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class InvocationRecord:
    """One function invocation as the platform would meter it.

    ``start_s``/``end_s`` bracket the handler (seconds on any common clock); ``init_s`` is
    the INIT (cold-start) time before ``start_s``, 0 for a warm start. ``vcpus=None`` means
    the platform's default for ``memory_mb``. ``layer``/``expert`` are None for functions
    that are not per-layer / per-expert; ``request_id`` is None for shared work.
    """

    function: str
    kind: str  # "segment" | "expert" | "head" | "tail" | "main" | ... (free-form label)
    memory_mb: int
    start_s: float
    end_s: float
    layer: int | None = None
    expert: int | None = None
    request_id: str | None = None
    vcpus: float | None = None
    gpu_share: float = 0.0
    init_s: float = 0.0
    cold: bool = False
    bytes_in: int = 0
    bytes_out: int = 0
    storage_puts: int = 0
    storage_gets: int = 0
    # An attempt that crashed or timed out: the platform bills it like any other (its
    # duration up to the failure, a timed-out one its full timeout), then it was retried.
    failed: bool = False

    def __post_init__(self) -> None:
        for name in ("start_s", "end_s", "init_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise PlatformError(
                    f"{self.function}: {name} must be a finite number of seconds, got {value!r}"
                )
        if self.end_s < self.start_s:
            raise PlatformError(
                f"{self.function}: end_s={self.end_s} is before start_s={self.start_s}",
                "durations must be >= 0 s",
            )
        if self.init_s < 0:
            raise PlatformError(f"{self.function}: init_s must be >= 0, got {self.init_s}")
        for name in ("bytes_in", "bytes_out", "storage_puts", "storage_gets"):
            count = getattr(self, name)
            if count < 0:
                raise PlatformError(f"{self.function}: {name} must be >= 0, got {count}")

    @property
    def duration_s(self) -> float:
        """Handler time in seconds (INIT excluded)."""
        return self.end_s - self.start_s


@dataclass(frozen=True, slots=True)
class CostParts:
    """USD split into compute, per-request and storage-request parts."""

    compute: float = 0.0
    request: float = 0.0
    storage: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.request + self.storage

    def __add__(self, other: CostParts) -> CostParts:
        return CostParts(
            self.compute + other.compute,
            self.request + other.request,
            self.storage + other.storage,
        )

    def to_dict(self) -> dict[str, float]:
        return {
            "compute": self.compute,
            "request": self.request,
            "storage": self.storage,
            "total": self.total,
        }


@dataclass(frozen=True)
class Bill:
    """Billed cost of a set of invocations. Every breakdown sums to ``total`` over the
    records it covers (by_layer/by_expert/by_request skip records without that key)."""

    platform: str
    total: CostParts
    by_function: dict[str, CostParts]
    by_kind: dict[str, CostParts]
    by_layer: dict[int, CostParts]
    by_expert: dict[tuple[int, int], CostParts]
    by_request: dict[str, CostParts]
    invocations: int
    cold_starts: int
    billed_s: float  # sum of billed durations, seconds
    gb_s: float  # sum of memory GB x billed seconds
    failed_attempts: int = 0  # records with failed=True (included in every total)
    failed: CostParts = CostParts()  # their billed cost

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; expert keys become ``"layer:expert"``."""

        def parts(d: dict[Any, CostParts]) -> dict[str, dict[str, float]]:
            return {str(k): v.to_dict() for k, v in sorted(d.items())}

        return {
            "platform": self.platform,
            "total": self.total.to_dict(),
            "by_function": parts(self.by_function),
            "by_kind": parts(self.by_kind),
            "by_layer": parts(self.by_layer),
            "by_expert": {
                f"{layer}:{expert}": v.to_dict()
                for (layer, expert), v in sorted(self.by_expert.items())
            },
            "by_request": parts(self.by_request),
            "invocations": self.invocations,
            "cold_starts": self.cold_starts,
            "billed_s": self.billed_s,
            "gb_s": self.gb_s,
            "failed_attempts": self.failed_attempts,
            "failed": self.failed.to_dict(),
        }


def price_invocation(
    spec: PlatformSpec,
    memory_mb: int,
    duration_s: float,
    *,
    init_s: float = 0.0,
    vcpus: float | None = None,
    gpu_share: float = 0.0,
    storage_puts: int = 0,
    storage_gets: int = 0,
) -> tuple[CostParts, float]:
    """The platform meter's price of one invocation, and its billed seconds.

    compute = (GB x per GB-s + vCPUs x per vCPU-s + GPU share x per GPU-s) x billed s, with
    billed s from the one duration rule (``Billing.billed_s``: rounded up, at least the
    minimum, INIT where billed); request = one request fee; storage = its PUT/GET fees.
    The meter, the engine's billers and (by linearity, with the rate per second
    precomputed) the simulator all price this way.
    """
    billed = spec.invocation_billed_s(duration_s, init_s)
    compute = spec.compute_cost(memory_mb, billed, vcpus, gpu_share)
    request = spec.request_cost(1)
    storage = spec.storage_request_cost(storage_puts, storage_gets)
    return CostParts(compute, request, storage), billed


@dataclass(frozen=True, slots=True)
class _Priced:
    record: InvocationRecord
    cost: CostParts
    billed_s: float


class Meter:
    """Collects invocation records for one FaaS platform and prices them.

    Records are validated and priced when added (a bad memory size fails at ``add``, not
    later at ``bill``). Thread-safe: backends may add from worker threads.
    """

    def __init__(self, spec: PlatformSpec, records: Iterable[InvocationRecord] = ()) -> None:
        if not spec.is_faas:
            raise PlatformError(
                f"platform '{spec.name}' is a {spec.kind}, not per-invocation billed",
                "use bill_cluster(spec, busy_intervals=..., wall_s=...) for rented machines",
            )
        self.spec = spec
        self._lock = threading.Lock()
        self._priced: list[_Priced] = []
        self._extra_storage: dict[str, CostParts] = defaultdict(CostParts)
        self.extend(records)

    def cost_of(self, record: InvocationRecord) -> CostParts:
        """Billed cost of one record (does not add it)."""
        return self._price(record).cost

    def price(self, record: InvocationRecord) -> tuple[CostParts, float]:
        """Billed cost and billed seconds of one record (does not add it)."""
        priced = self._price(record)
        return priced.cost, priced.billed_s

    def _price(self, r: InvocationRecord) -> _Priced:
        cost, billed = price_invocation(
            self.spec, r.memory_mb, r.duration_s, init_s=r.init_s, vcpus=r.vcpus,
            gpu_share=r.gpu_share, storage_puts=r.storage_puts, storage_gets=r.storage_gets)
        return _Priced(r, cost, billed)

    def add(self, record: InvocationRecord) -> CostParts:
        """Add one record; returns its billed cost."""
        priced = self._price(record)
        with self._lock:
            self._priced.append(priced)
        return priced.cost

    def extend(self, records: Iterable[InvocationRecord]) -> None:
        for r in records:
            self.add(r)

    def add_storage(self, puts: int, gets: int, function: str = "<client>") -> CostParts:
        """Object-store requests made outside any function (e.g. the client uploading
        inputs); billed under ``by_function[function]``."""
        cost = CostParts(storage=self.spec.storage_request_cost(puts, gets))
        with self._lock:
            self._extra_storage[function] = self._extra_storage[function] + cost
        return cost

    @property
    def records(self) -> list[InvocationRecord]:
        with self._lock:
            return [p.record for p in self._priced]

    def __len__(self) -> int:
        with self._lock:
            return len(self._priced)

    def clear(self) -> None:
        with self._lock:
            self._priced.clear()
            self._extra_storage.clear()

    def bill(self) -> Bill:
        """Aggregate everything added so far."""
        with self._lock:
            priced = list(self._priced)
            extra = dict(self._extra_storage)
        total = CostParts()
        by_function: dict[str, CostParts] = defaultdict(CostParts)
        by_kind: dict[str, CostParts] = defaultdict(CostParts)
        by_layer: dict[int, CostParts] = defaultdict(CostParts)
        by_expert: dict[tuple[int, int], CostParts] = defaultdict(CostParts)
        by_request: dict[str, CostParts] = defaultdict(CostParts)
        billed_s = gb_s = 0.0
        for p in priced:
            r, c = p.record, p.cost
            total += c
            by_function[r.function] += c
            by_kind[r.kind] += c
            if r.layer is not None:
                by_layer[r.layer] += c
                if r.expert is not None:
                    by_expert[(r.layer, r.expert)] += c
            if r.request_id is not None:
                by_request[r.request_id] += c
            billed_s += p.billed_s
            gb_s += r.memory_mb / MB_PER_GB * p.billed_s
        for fn, c in extra.items():
            total += c
            by_function[fn] += c
        return Bill(
            platform=self.spec.name,
            total=total,
            by_function=dict(by_function),
            by_kind=dict(by_kind),
            by_layer=dict(by_layer),
            by_expert=dict(by_expert),
            by_request=dict(by_request),
            invocations=len(priced),
            cold_starts=sum(1 for p in priced if p.record.cold),
            billed_s=billed_s,
            gb_s=gb_s,
            failed_attempts=sum(1 for p in priced if p.record.failed),
            failed=sum((p.cost for p in priced if p.record.failed), CostParts()),
        )


@dataclass(frozen=True)
class ClusterBill:
    """Rented machines: ``billed_s`` is wall time rounded up per the spec (idle included
    when the spec says so); ``cost`` = billed hours x price per hour x nodes."""

    platform: str
    nodes: int
    wall_s: float
    busy_s: float
    billed_s: float
    cost: float

    @property
    def billed_hours(self) -> float:
        return self.billed_s / 3600.0

    @property
    def utilisation(self) -> float:
        """Busy share of the wall time (0 when nothing ran)."""
        return self.busy_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "platform": self.platform,
            "nodes": self.nodes,
            "wall_s": self.wall_s,
            "busy_s": self.busy_s,
            "billed_s": self.billed_s,
            "billed_hours": self.billed_hours,
            "utilisation": self.utilisation,
            "cost": self.cost,
        }


def bill_cluster(
    spec: PlatformSpec,
    busy_intervals: Sequence[tuple[float, float]] | None = None,
    wall_s: float | None = None,
    nodes: int = 1,
) -> ClusterBill:
    """Bill ``nodes`` rented machines of ``spec`` (kind cluster/server).

    ``busy_intervals`` are (start_s, end_s) spans of work; the rental runs from the first
    start to the last end unless ``wall_s`` (the whole rental, >= that span) is given.
    With ``idle_billed`` (the usual case) the whole rental is billed; otherwise only the
    union of busy time. Either argument alone is enough.
    """
    hourly = spec.hourly
    if hourly is None:
        raise PlatformError(
            f"platform '{spec.name}' is {spec.kind}, billed per invocation",
            "use Meter(spec) for FaaS platforms",
        )
    if busy_intervals is None and wall_s is None:
        raise PlatformError("bill_cluster needs busy_intervals or wall_s")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise PlatformError(f"nodes must be a positive whole number, got {nodes!r}")
    intervals = [(float(a), float(b)) for a, b in (busy_intervals or [])]
    for a, b in intervals:
        if not (math.isfinite(a) and math.isfinite(b)) or b < a:
            raise PlatformError(f"busy interval ({a}, {b}) must have finite start <= end")
    busy = _union_length(intervals)
    span = (max(b for _, b in intervals) - min(a for a, _ in intervals)) if intervals else 0.0
    if wall_s is None:
        wall = span
    else:
        if not math.isfinite(wall_s) or wall_s < 0:
            raise PlatformError(f"wall_s must be >= 0 seconds, got {wall_s!r}")
        if wall_s < span - 1e-9:
            raise PlatformError(
                f"wall_s={wall_s:g} is shorter than the busy span {span:g} s",
                "wall_s is the whole rental; leave it unset to use the busy span",
            )
        wall = float(wall_s)
    billed = spec.hourly_billed_s(wall if hourly.idle_billed else busy)
    cost = billed / 3600.0 * hourly.price_per_hour * nodes
    return ClusterBill(spec.name, nodes, wall, busy, billed, cost)


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals (overlaps counted once)."""
    total = 0.0
    cur_a = cur_b = None
    for a, b in sorted(intervals):
        if cur_b is None or a > cur_b:
            if cur_a is not None and cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_a is not None and cur_b is not None:
        total += cur_b - cur_a
    return total
