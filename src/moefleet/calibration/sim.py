"""Calibrate the simulator to a real backend: the overheads no compute profile sees.

A real backend adds costs of its own: the invoke round trip to a warm worker, worker
start-up, per-call (de)serialisation and framework overhead, its actual transfer speeds.
:func:`calibrate` estimates them from a real run (:class:`MeasuredRun`) and the
simulator's overhead-free prediction of the same requests, as a
:class:`moefleet.sim.config.Calibration` (the simulator's own data type: it applies one
with :func:`moefleet.sim.config.apply_calibration`).

Units: seconds, bytes/s.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from moefleet.platform.billing import InvocationRecord
from moefleet.sim.config import Calibration, SimError
from moefleet.sim.result import SimResult


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
