"""Calibrate the simulator to the sMoE online run's local backend, on its warm-up only.

The online experiment (:mod:`moefleet.experiments.smoe_online`) replays a workload on a
real deployment and asks the simulator to predict the same run. The simulator gets only
what the run knew before the replay: overheads measured on the serial warm-up requests
(:func:`calibrate_local`), never on the replay itself. :class:`OnlineSetup` is how both
runs warm up and replay; :func:`simulate_online` is the simulator on the local backend's
terms, used here to fit and there to predict.

Units: seconds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from moefleet.autoscale.errors import AutoscaleError
from moefleet.autoscale.smoe.harness import Scenario
from moefleet.control import APPLY_DELAY_S, ScalingController
from moefleet.plan.plan import DeploymentPlan
from moefleet.workloads.base import Arrival


@dataclass(frozen=True)
class OnlineSetup:
    """How the window is replayed: time compressed by ``compress`` (window seconds per
    run second), arrivals kept with probability ``keep`` (seeded); ``warmup`` serial
    requests first; ``workers`` local worker processes."""

    compress: float = 4.0
    keep: float = 1 / 12
    warmup: int = 8
    workers: int = 2
    prompt_tokens: int = 64
    seed: int = 0
    poll_s: float = 0.05
    warmup_gap_s: float = 2.0  # simulated spacing of the serial warm-up requests

    def __post_init__(self) -> None:
        if not (math.isfinite(self.compress) and 1 <= self.compress <= 100):
            raise AutoscaleError(f"compress must be in [1, 100], got {self.compress!r}",
                                 "e.g. 4 plays a 10-minute window in 150 s")
        if not 0 < self.keep <= 1:
            raise AutoscaleError(f"keep must be in (0, 1], got {self.keep!r}",
                                 "e.g. 0.1 keeps one arrival in ten")
        if not (2 <= self.warmup <= 100 and 1 <= self.workers <= 64
                and 1 <= self.prompt_tokens <= 4096):
            raise AutoscaleError(f"warmup {self.warmup} (2..100), workers {self.workers} "
                                 f"(1..64) or prompt_tokens {self.prompt_tokens} out of range")


def simulate_online(sc: Scenario, plan: DeploymentPlan, profile: Any, trace: Any, vocab: int,
                    policy: ScalingController | None, arrivals: list[Arrival], duration_s: float,
                    setup: OnlineSetup, cal: Any = None, caller_s: float = 0.0
                    ) -> tuple[Any, list[Any]]:
    """(the simulated result, its invocation records): the online run's arrivals through
    the simulator on the local backend's terms (replica pods, the workers as node slots,
    fast local pipes), with ``cal``'s overheads and ``caller_s`` per call when given."""
    from moefleet.sim import Calibration, SimConfig, Simulator, apply_calibration
    from moefleet.sim.routing import TraceRowRouter

    # Local pipes and a local-directory store are fast: their cost is in the overheads.
    local = Calibration(function_bandwidth_bytes_per_s=1e12, storage_access_s=0.0,
                        storage_bandwidth_bytes_per_s=1e12)
    spec, cfg = apply_calibration(sc.spec, SimConfig(
        scaling="replicas", keep_alive_s=1e9, prompt_tokens=setup.prompt_tokens,
        slo_s=sc.slo_s, interval_s=sc.interval_s, apply_delay_s=APPLY_DELAY_S,
        node_slots=setup.workers, keep_records=True, keep_requests=True,
        result_bytes_per_token=4 * vocab, caller_overhead_s=caller_s),
        local)  # the last segment returns fp32 logits
    if cal is not None:
        spec, cfg = apply_calibration(spec, cfg, cal)
    sim = Simulator(plan, profile, spec, router=TraceRowRouter(trace), config=cfg,
                    controller=policy, seed=setup.seed, decoder=False)
    res = sim.run(arrivals, duration_s)
    return res, list(sim.meter.records) if sim.meter is not None else []


def warm_arrivals(warmup_ids: Sequence[str], setup: OnlineSetup,
                  tokens: dict[str, int]) -> list[Arrival]:
    """The serial warm-up requests, ``warmup_gap_s`` apart, at their real token counts."""
    return [Arrival(i * setup.warmup_gap_s, rid, tokens.get(rid, setup.prompt_tokens))
            for i, rid in enumerate(warmup_ids)]


def with_call_overhead(profile: Any, overhead_1cpu_s: dict[str, float]) -> Any:
    """``profile`` with each kind's per-call overhead (seconds at one vCPU) added to its
    batch law's fixed term, so it scales with the CPU share as the compute does (the
    local backend stretches a call's whole CPU time, (de)serialisation included)."""
    from dataclasses import replace

    def add(fp: Any, kind: str) -> Any:
        extra = overhead_1cpu_s.get(kind, 0.0)
        return replace(fp, batch=replace(fp.batch, overhead_s=fp.batch.overhead_s + extra))

    return replace(profile, segments=[add(f, "segment") for f in profile.segments],
                   experts={k: add(f, "expert") for k, f in profile.experts.items()})


def calibrate_local(sc: Scenario, plan: DeploymentPlan, profile: Any, trace: Any, vocab: int,
                    warm: Sequence[tuple[str, float, list[Any]]], setup: OnlineSetup,
                    tokens: dict[str, int], *, round_trip_on_slot: bool = False
                    ) -> tuple[Any, Any, float]:
    """(calibration, profile, caller seconds per call) from the warm-up requests only.

    Per kind, the handler time the profile does not explain
    (:func:`moefleet.calibration.sim.calibrate`) is measured at the warm-up's CPU share
    ``v`` and moved into the profile as ``gap * v`` seconds per call at one vCPU
    (:func:`with_call_overhead`); cold start is the measured INIT; then the per-call round
    trip outside the handler is bisected until the simulated mean latency of the warm
    requests (all but the first, cold one) equals the measured one: as
    ``caller_overhead_s`` (the caller's own work: holds no worker), or with
    ``round_trip_on_slot`` as ``warm_start_s`` (paid inside the worker's slot)."""
    from dataclasses import replace

    from moefleet.calibration.sim import MeasuredRun, calibrate

    arr = warm_arrivals([rid for rid, _, _ in warm], setup, tokens)
    dur = arr[-1].t_s + setup.warmup_gap_s
    bare, _ = simulate_online(sc, plan, profile, trace, vocab, None, arr, dur, setup)
    cal = calibrate(MeasuredRun([lat for _, lat, _ in warm], [r for *_, rs in warm for r in rs]),
                    bare, serial=False)
    share = {f.role: min(1.0, sc.spec.vcpus(f.memory_mb)) for f in plan.placement().functions}
    gaps = cal.call_overhead_s if isinstance(cal.call_overhead_s, dict) else {}
    # The simulator computes (profile law) only in a segment's ``pre`` call, one per block
    # and request; its ``post`` calls would get none: put all segment calls' gap there.
    recs = [r for _, _, rs in warm for r in rs]
    pre_share = {"segment": sum(r.kind == "segment" for r in recs)
                 / (len(warm) * len(profile.segments))}
    prof = with_call_overhead(profile, {k: g * share.get(k, 1.0) * pre_share.get(k, 1.0)
                                        for k, g in gaps.items()})
    cal = replace(cal, call_overhead_s=0.0, warm_start_s=0.0)
    target = statistics.fmean(lat for _, lat, _ in warm[1:])
    ids = {rid for rid, _, _ in warm[1:]}
    lo, hi = 0.0, 0.05
    for _ in range(16):
        mid = (lo + hi) / 2
        res, _ = (simulate_online(sc, plan, prof, trace, vocab, None, arr, dur, setup,
                       replace(cal, warm_start_s=mid)) if round_trip_on_slot else
                  simulate_online(sc, plan, prof, trace, vocab, None, arr, dur, setup, cal, mid))
        got = statistics.fmean(r["latency_s"] for r in res.request_log if r["request_id"] in ids)
        lo, hi = (mid, hi) if got < target else (lo, mid)
    rt = (lo + hi) / 2
    return (replace(cal, warm_start_s=rt), prof, 0.0) if round_trip_on_slot else (cal, prof, rt)
