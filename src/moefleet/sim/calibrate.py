"""Calibration: make the simulator describe a real backend (measured overheads in).

The compute profile gives the model's compute; a real backend adds its own costs that
no profile sees: the invoke round trip to a warm worker, worker start-up, per-call
(de)serialisation and framework overhead, and its actual transfer speeds.
:class:`Calibration` holds those measurements; :func:`apply_calibration` returns a
platform spec and a :class:`SimConfig` that use them; :func:`calibrate` estimates them
from a real run (:class:`MeasuredRun`) and the simulator's overhead-free prediction of
the same requests.

Units: seconds, bytes/s.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from moefleet.platform.billing import InvocationRecord
from moefleet.platform.spec_blocks import Network, Storage
from moefleet.platform.specs import PlatformSpec
from moefleet.sim.config import SimConfig, SimError
from moefleet.sim.result import SimResult


@dataclass(frozen=True)
class Calibration:
    """Measured overheads of a backend; None keeps the platform spec's value."""

    warm_start_s: float | None = None
    cold_start_s: float | None = None
    call_overhead_s: float | Mapping[str, float] = 0.0
    compute_scale: float | Mapping[str, float] = 1.0
    function_bandwidth_bytes_per_s: float | None = None
    storage_access_s: float | None = None
    storage_bandwidth_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        ov = self.call_overhead_s
        values = [(n, getattr(self, n)) for n in ("warm_start_s", "cold_start_s",
                                                  "storage_access_s")]
        values += [(f"call_overhead_s[{k}]", v) for k, v in ov.items()] if isinstance(
            ov, Mapping) else [("call_overhead_s", ov)]
        for name, v in values:
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise SimError(f"calibration {name} must be >= 0, got {v!r}")
        for name in ("function_bandwidth_bytes_per_s", "storage_bandwidth_bytes_per_s"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise SimError(f"calibration {name} must be > 0, got {v!r}")


def apply_calibration(spec: PlatformSpec, config: SimConfig,
                      cal: Calibration) -> tuple[PlatformSpec, SimConfig]:
    """The spec and config that simulate the calibrated backend (prices unchanged; the
    calibration's call overhead replaces the config's)."""
    update: dict[str, object] = {}
    if cal.function_bandwidth_bytes_per_s is not None:
        update["network"] = Network(
            function_bandwidth_bytes_per_s=float(cal.function_bandwidth_bytes_per_s))
    if spec.storage is not None and (cal.storage_access_s is not None
                                     or cal.storage_bandwidth_bytes_per_s is not None):
        store: Storage = spec.storage
        update["storage"] = store.model_copy(update={
            k: float(v) for k, v in (("access_latency_s", cal.storage_access_s),
                                     ("bandwidth_bytes_per_s",
                                      cal.storage_bandwidth_bytes_per_s)) if v is not None})
    new_spec = spec.model_copy(update=update) if update else spec
    new_cfg = replace(
        config,
        warm_start_s=cal.warm_start_s if cal.warm_start_s is not None else config.warm_start_s,
        cold_start_s=cal.cold_start_s if cal.cold_start_s is not None else config.cold_start_s,
        call_overhead_s=cal.call_overhead_s, compute_scale=cal.compute_scale)
    return new_spec, new_cfg


@dataclass(frozen=True)
class MeasuredRun:
    """What a real backend reported for some requests: the end-to-end latency of each
    (seconds, at the caller) and the invocation records they caused."""

    latencies_s: Sequence[float]
    records: Sequence[InvocationRecord]


def calibrate(measured: MeasuredRun, predicted: SimResult, *, serial: bool) -> Calibration:
    """The overheads that make the simulator reproduce ``measured``.

    ``predicted`` is the simulator's run of the same requests with no overheads
    (``call_overhead_s=0``; start delays do not matter here): the gap between measured
    and predicted handler seconds per invocation, for each kind of function, is
    ``call_overhead_s[kind]``; the mean
    measured INIT of cold calls is ``cold_start_s``. Where a kind's measured handler time
    is *below* the prediction (the profile was measured under heavier load than the run),
    no overhead can close the gap: that kind's compute is scaled by measured / predicted
    instead (``compute_scale``) and its overhead is 0. When the backend ran every call of
    a request one after another (``serial``: one worker), what the latencies hold
    beyond handler and INIT time, per invocation, is ``warm_start_s`` (the invoke round
    trip, payload transfer and the caller's own work); otherwise it stays unset.
    """
    recs = list(measured.records)
    if not recs:
        raise SimError("no invocation records to calibrate from",
                       "run a few requests on the backend first")
    handler = sum(r.duration_s for r in recs)
    init = sum(r.init_s for r in recs)
    cold = [r.init_s for r in recs if r.cold]
    overhead: dict[str, float] = {}
    scale: dict[str, float] = {}
    for kind in sorted({r.kind for r in recs}):
        mine = [r.duration_s for r in recs if r.kind == kind]
        want = predicted.handler_s_by_kind.get(kind, 0.0)
        gap = sum(mine) - want
        overhead[kind] = max(0.0, gap / len(mine))
        scale[kind] = sum(mine) / want if gap < 0 and sum(mine) > 0 else 1.0
    warm = None
    if serial:
        warm = max(0.0, (sum(measured.latencies_s) - handler - init) / len(recs))
    return Calibration(warm_start_s=warm, cold_start_s=statistics.fmean(cold) if cold else None,
                       call_overhead_s=overhead, compute_scale=scale)
