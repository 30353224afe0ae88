"""SALC, BrownoutServe's SLO-aware latency control (its Alg. 2), as pure controllers.

A controller is a pure function ``(snapshot, state) -> (decision, state)``, like the
autoscaling policies: it never reads a clock (the snapshot carries the time) and never
mutates its state (states are frozen values), so the engine, the simulator and the
fake-clock tests drive the same code.

Rule, evaluated at most once per ``interval_s`` (the first snapshot always checks):

    p90 = P90 of the latencies recorded in (now - window_s, now]
    p90 > slo                 -> threshold *= shrink      (more tokens to united experts)
    p90 < warning * slo       -> threshold += increment   (capped at 1: zero brownout)
    otherwise, or no samples  -> unchanged

Prefill and decode are controlled separately (:class:`SALC`): the prefill controller
watches TTFT against the TTFT SLO, the decode controller TPOT against the TPOT SLO, and
an engine step uses the threshold of its kind. Defaults are the paper's (warning 0.8,
increment 0.1, shrink 0.8; SLOs 0.25 s / 0.15 s).

P90 is the nearest-rank percentile (the ceil(0.9 n)-th smallest), which is one of the
samples, so "above the SLO" always means some token really was that slow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from moefleet.brownout.groups import BrownoutError, check_threshold

Action = Literal["shrink", "grow", "hold", "wait", "no-data"]


@dataclass(frozen=True)
class SALCConfig:
    slo_s: float
    warning: float = 0.8
    increment: float = 0.1
    shrink: float = 0.8
    window_s: float = 5.0
    interval_s: float = 1.0
    min_threshold: float = 0.0

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, value: float, fix: str) -> None:
            if not ok:
                raise BrownoutError(f"SALC {name}={value!r} is out of range", fix)

        finite = all(math.isfinite(v) for v in (self.slo_s, self.warning, self.increment,
                                                  self.shrink, self.window_s, self.interval_s))
        need(finite and self.slo_s > 0, "slo", self.slo_s, "use a latency SLO > 0 seconds")
        need(0 < self.warning <= 1, "warning", self.warning, "use a factor in (0, 1]")
        need(0 < self.increment <= 1, "increment", self.increment, "use a value in (0, 1]")
        need(0 < self.shrink < 1, "shrink", self.shrink, "use a ratio in (0, 1)")
        need(self.window_s > 0, "window", self.window_s, "use a window > 0 seconds")
        need(self.interval_s >= 0, "interval", self.interval_s, "use an interval >= 0 s")
        need(0 <= self.min_threshold <= 1, "min_threshold", self.min_threshold, "use [0, 1]")


@dataclass(frozen=True)
class LatencySnapshot:
    """``now`` and the (finish time, latency) of recent tokens, seconds; older samples
    may be included, the controller keeps only those inside its window."""

    now: float
    samples: Sequence[tuple[float, float]]


@dataclass(frozen=True)
class SALCState:
    threshold: float = 1.0
    last_check: float | None = None


@dataclass(frozen=True)
class SALCDecision:
    threshold: float
    p90_s: float | None
    samples: int
    action: Action


def p90(latencies: Sequence[float]) -> float:
    """Nearest-rank 90th percentile of a non-empty sequence."""
    ordered = sorted(latencies)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def salc_step(cfg: SALCConfig, snap: LatencySnapshot, state: SALCState
              ) -> tuple[SALCDecision, SALCState]:
    """One evaluation of the rule in the module docstring."""
    if state.last_check is not None and snap.now - state.last_check < cfg.interval_s:
        return SALCDecision(state.threshold, None, 0, "wait"), state
    recent = [lat for t, lat in snap.samples if snap.now - cfg.window_s < t <= snap.now]
    checked = replace(state, last_check=snap.now)
    if not recent:
        return SALCDecision(state.threshold, None, 0, "no-data"), checked
    tail = p90(recent)
    threshold, action = state.threshold, "hold"
    if tail > cfg.slo_s:
        threshold, action = max(cfg.min_threshold, threshold * cfg.shrink), "shrink"
    elif tail < cfg.warning * cfg.slo_s and threshold < 1.0:
        threshold, action = min(1.0, threshold + cfg.increment), "grow"
    threshold = check_threshold(threshold)
    decision = SALCDecision(threshold, tail, len(recent), action)  # type: ignore[arg-type]
    return decision, replace(checked, threshold=threshold)


@dataclass(frozen=True)
class SALCPairState:
    prefill: SALCState = SALCState()
    decode: SALCState = SALCState()


class SALC:
    """The two controllers of BrownoutServe: prefill on TTFT, decode on TPOT.

    ``step(ttft_snapshot, tpot_snapshot, state)`` is pure; :meth:`threshold_for` picks
    the threshold an engine step of a given kind runs with.
    """

    def __init__(self, slo_ttft_s: float, slo_tpot_s: float, **common: float) -> None:
        self.prefill = SALCConfig(slo_s=slo_ttft_s, **common)
        self.decode = SALCConfig(slo_s=slo_tpot_s, **common)

    def step(self, ttft: LatencySnapshot, tpot: LatencySnapshot, state: SALCPairState
             ) -> tuple[tuple[SALCDecision, SALCDecision], SALCPairState]:
        d_pre, s_pre = salc_step(self.prefill, ttft, state.prefill)
        d_dec, s_dec = salc_step(self.decode, tpot, state.decode)
        return (d_pre, d_dec), SALCPairState(s_pre, s_dec)

    @staticmethod
    def threshold_for(kind: Literal["prefill", "decode"], state: SALCPairState) -> float:
        if kind not in ("prefill", "decode"):
            raise BrownoutError(f"step kind {kind!r} is unknown", "use 'prefill' or 'decode'")
        return state.prefill.threshold if kind == "prefill" else state.decode.threshold
