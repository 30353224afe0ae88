"""SALC, BrownoutServe's SLO-aware latency control (its Alg. 2), as a pure controller.

:class:`SALC` is a :class:`~moefleet.control.Controller` like the scaling controllers:
``SALC.decide(window, state) -> (decisions, state)`` reads a :class:`LatencyWindow` (the
time and recent TTFT / TPOT samples) and decides the brownout threshold of each step
kind; its state is the thresholds (:class:`SALCPairState`, frozen). It never reads a
clock (the window carries the time) and never mutates its input, so the engine's step
hook (``experts.brownout_hook.SALCHook``, which only feeds windows and applies the
decision) and the fake-clock tests drive the same code.

Rule, evaluated at most once per ``interval_s`` (the first snapshot always checks):

    p90 = P90 of the latencies recorded in (now - window_s, now]
    p90 > slo                 -> threshold *= shrink      (more tokens to united experts)
    p90 < warning * slo       -> threshold += increment   (capped at 1: zero brownout)
    otherwise, or no samples  -> unchanged

Prefill and decode are controlled separately (:class:`SALC`): the prefill rule
watches TTFT against the TTFT SLO, the decode rule TPOT against the TPOT SLO, and
an engine step uses the threshold of its kind. Defaults are the paper's (warning 0.8,
increment 0.1, shrink 0.8; SLOs 0.25 s / 0.15 s).

P90 is the nearest-rank percentile (the ceil(0.9 n)-th smallest), which is one of the
samples, so "above the SLO" always means some token really was that slow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

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


def _check_kind(kind: str) -> str:
    if kind not in ("prefill", "decode"):
        raise BrownoutError(f"step kind {kind!r} is unknown", "use 'prefill' or 'decode'")
    return kind


@dataclass(frozen=True)
class LatencyWindow:
    """What SALC observes at ``now``: the (finish time, latency) of recent first tokens
    (``ttft``) and of recent later tokens (``tpot``, the inter-token gaps), seconds.
    Older samples may be included; each rule keeps only those inside its window."""

    now: float
    ttft: Sequence[tuple[float, float]] = ()
    tpot: Sequence[tuple[float, float]] = ()


@dataclass(frozen=True)
class SALCPairState:
    """SALC's state: each step kind's threshold and when its rule last checked."""

    prefill: SALCState = SALCState()
    decode: SALCState = SALCState()


class SALCDecisions(NamedTuple):
    """One decision per step kind (unpacks as ``(prefill, decode)``)."""

    prefill: SALCDecision
    decode: SALCDecision

    def threshold(self, kind: Literal["prefill", "decode"]) -> float:
        """The threshold a step of ``kind`` runs with."""
        return (self.prefill if _check_kind(kind) == "prefill" else self.decode).threshold


class SALC:
    """The two rules of BrownoutServe as one controller: prefill on TTFT, decode on TPOT.

    ``decide(window, state)`` is pure; :meth:`threshold_for` picks the threshold an engine
    step of a given kind runs with from a state.
    """

    name = "salc"

    def __init__(self, slo_ttft_s: float, slo_tpot_s: float, **common: float) -> None:
        self.prefill = SALCConfig(slo_s=slo_ttft_s, **common)
        self.decode = SALCConfig(slo_s=slo_tpot_s, **common)

    def initial_state(self) -> SALCPairState:
        """Both thresholds at 1 (zero brownout), never checked."""
        return SALCPairState()

    def decide(self, window: LatencyWindow, state: SALCPairState
               ) -> tuple[SALCDecisions, SALCPairState]:
        d_pre, s_pre = salc_step(self.prefill, LatencySnapshot(window.now, window.ttft),
                                 state.prefill)
        d_dec, s_dec = salc_step(self.decode, LatencySnapshot(window.now, window.tpot),
                                 state.decode)
        return SALCDecisions(d_pre, d_dec), SALCPairState(s_pre, s_dec)

    @staticmethod
    def threshold_for(kind: Literal["prefill", "decode"], state: SALCPairState) -> float:
        """The threshold a step of ``kind`` runs with in ``state``."""
        return (state.prefill if _check_kind(kind) == "prefill" else state.decode).threshold
