"""Inter-arrival CV of trace windows, and the sMoE patterns slow / normal / bursty.

sMoE picks 1-hour windows of the Azure Functions trace by the coefficient of variation
(CV = std / mean) of their inter-arrival times: slow (CV < 1), normal (1 <= CV <= 3),
bursty (CV > 3). Windows with fewer than ``min_arrivals`` arrivals are labelled idle.

How the CV is estimated from per-minute counts (:func:`window_cv`)
------------------------------------------------------------------
The trace has no times inside a minute. We use the same model as the generator
(:class:`~moefleet.workloads.azure_functions.AzureFunctionsWorkload`): the ``c``
arrivals of a minute are i.i.d. uniform in it. Under that model the ``c + 1`` spacings of
a minute (edges included) are Dirichlet(1, ..., 1): mean ``1/(c+1)``, second moment
``2/((c+1)(c+2))`` minutes. The gaps of the window are the within-minute spacings plus,
between consecutive non-empty minutes ``a < b``, ``R_a + (b - a - 1) + L_b``. From these
we compute in closed form the *expected* mean gap and the *expected* population variance
of the gaps (``E[sum g^2]/n - E[(sum g)^2]/n^2``) and return
``sqrt(E[var]) / E[mean]``. Why this rather than sampling arrivals:

* deterministic and seed-free — a window's label never depends on a seed;
* O(minutes), not O(invocations) (the busiest sample function has ~1.9 M invocations);
* consistent with what the generator produces: for windows with many arrivals the CV of
  generated arrivals concentrates on this value (a unit test checks it).

Consequences worth knowing: a function firing once per minute gets CV ~ 0.41 (not 0, as
its true timer would), and a steady high-rate function gets CV close to 1 (either side),
where the slow/normal label is fragile: see ``margin`` in :func:`find_windows`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from moefleet.errors import MoefleetError
from moefleet.workloads.azure_functions import AzureFunctionsWorkload, load_azure_functions

Pattern = Literal["slow", "normal", "bursty", "idle"]
PATTERNS: tuple[Pattern, ...] = ("slow", "normal", "bursty", "idle")
SLOW_BELOW = 1.0
BURSTY_ABOVE = 3.0


@dataclass(frozen=True)
class WindowStats:
    """One window: ``start_minute`` is an offset into the counts passed in."""

    start_minute: int
    minutes: int
    arrivals: int
    cv: float
    pattern: Pattern


@dataclass(frozen=True)
class FunctionWindow:
    """A window of one function of the Azure sample (offsets as in AzureFunctionsWorkload)."""

    function: str
    rank: int
    trigger: str
    start_minute: int
    start_minute_label: int
    minutes: int
    arrivals: int
    cv: float
    pattern: Pattern

    def workload(self, path: str | os.PathLike[str] | None = None,
                 scale: float = 1.0) -> AzureFunctionsWorkload:
        """The workload replaying this window (generate it with ``duration_s = minutes*60``)."""
        return AzureFunctionsWorkload(self.function, path=path, scale=scale,
                                      start_minute=self.start_minute)


def _as_counts(counts_per_minute: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(counts_per_minute)
    if arr.ndim != 1:
        raise MoefleetError(f"counts_per_minute must be one-dimensional, got shape {arr.shape}",
                            "pass one count per minute")
    if arr.size and (arr.dtype.kind not in "iuf" or not np.all(np.isfinite(arr))
                     or np.any(arr < 0) or np.any(arr != np.round(arr))):
        raise MoefleetError("counts_per_minute must be non-negative integers",
                            "pass invocation counts, one per minute")
    return arr.astype(np.int64)


def window_cv(counts_per_minute: Sequence[int] | np.ndarray) -> float:
    """Inter-arrival CV of arrivals spread uniformly within each minute (see module doc).

    Returns NaN when the window has fewer than 2 arrivals (no gap). Scale-free: the same
    value in minutes or seconds.
    """
    c = _as_counts(counts_per_minute)
    total = int(c.sum())
    if total < 2:
        return math.nan
    n = total - 1  # number of gaps
    nz = np.flatnonzero(c)
    cn = c[nz].astype(np.float64)
    m1 = 1.0 / (cn + 1.0)  # E[spacing] in a minute with c arrivals
    m2 = 2.0 / ((cn + 1.0) * (cn + 2.0))  # E[spacing^2]
    sum_g2 = float(np.sum((cn - 1.0) * m2))  # within-minute gaps
    if len(nz) == 1:
        ci = cn[0]
        mean_sum = 1.0 - 2.0 / (ci + 1.0)
        sum_sq = 1.0 - 4.0 / (ci + 1.0) + 6.0 / ((ci + 1.0) * (ci + 2.0))
    else:
        k = np.diff(nz).astype(np.float64) - 1.0  # empty minutes between non-empty ones
        a1, a2, b1, b2 = m1[:-1], m2[:-1], m1[1:], m2[1:]
        sum_g2 += float(np.sum(a2 + b2 + k * k + 2.0 * k * (a1 + b1) + 2.0 * a1 * b1))
        span = float(nz[-1] + 1 - nz[0])
        f1, f2, l1, l2 = m1[0], m2[0], m1[-1], m2[-1]
        mean_sum = span - f1 - l1
        sum_sq = span * span - 2.0 * span * (f1 + l1) + f2 + l2 + 2.0 * f1 * l1
    var = sum_g2 / n - sum_sq / (n * n)
    return float(math.sqrt(max(var, 0.0)) / (mean_sum / n))


def pattern_of(cv: float, arrivals: int, min_arrivals: int = 3) -> Pattern:
    """sMoE label of a CV: slow (< 1), normal (1..3), bursty (> 3); idle if too few."""
    if arrivals < min_arrivals or math.isnan(cv):
        return "idle"
    if cv < SLOW_BELOW:
        return "slow"
    return "bursty" if cv > BURSTY_ABOVE else "normal"


def classify_windows(
    counts_per_minute: Sequence[int] | np.ndarray,
    window_minutes: int = 60,
    *,
    stride_minutes: int | None = None,
    min_arrivals: int = 3,
) -> list[WindowStats]:
    """CV and pattern of each full window of ``window_minutes`` minutes.

    Windows start at 0, ``stride``, ``2*stride`` ... (stride defaults to the window:
    tumbling windows); a trailing partial window is skipped.
    """
    c = _as_counts(counts_per_minute)
    if isinstance(min_arrivals, bool) or not isinstance(min_arrivals, int) or min_arrivals < 0:
        raise MoefleetError(f"min_arrivals must be a non-negative integer, got {min_arrivals!r}",
                            "pass e.g. min_arrivals=3")
    window = _check_minutes("window_minutes", window_minutes)
    stride = window if stride_minutes is None else _check_minutes("stride_minutes",
                                                                  stride_minutes)
    out: list[WindowStats] = []
    for start in range(0, len(c) - window + 1, stride):
        w = c[start:start + window]
        arrivals = int(w.sum())
        cv = window_cv(w)
        out.append(WindowStats(start, window, arrivals, cv,
                               pattern_of(cv, arrivals, min_arrivals)))
    return out


def find_windows(
    pattern: Pattern,
    *,
    path: str | os.PathLike[str] | None = None,
    window_minutes: int = 60,
    stride_minutes: int | None = None,
    min_arrivals: int = 60,
    margin: float = 0.1,
    limit: int | None = None,
) -> list[FunctionWindow]:
    """Windows of the Azure Functions sample showing ``pattern``, busiest window first.

    ``min_arrivals`` (default 60, one per minute on average for an hour) keeps windows too
    quiet to load a server out of slow/normal/bursty. ``margin`` (absolute CV) keeps only
    windows at least that far inside their band (slow: CV <= 1 - margin; normal:
    1 + margin <= CV <= 3 - margin; bursty: CV >= 3 + margin): steady busy functions sit
    at CV ~ 1 under the uniform-in-minute model, where the label is a coin toss.
    Ties order by rank then start. ``margin`` does not apply to ``idle``.
    """
    if pattern not in PATTERNS:
        raise MoefleetError(f"unknown pattern '{pattern}'",
                            f"use one of: {', '.join(PATTERNS)}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or limit < 0):
        raise MoefleetError(f"limit must be a non-negative integer, got {limit!r}",
                            "pass e.g. limit=5, or None for all")
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not (
        0 <= margin < 1
    ):
        raise MoefleetError(f"margin must be a number in [0, 1), got {margin!r}",
                            "pass e.g. margin=0.1, or 0 for the bare sMoE bands")
    trace = load_azure_functions(path)
    found: list[FunctionWindow] = []
    for rank, row in enumerate(trace.order):
        for w in classify_windows(trace.counts[row], window_minutes,
                                  stride_minutes=stride_minutes, min_arrivals=min_arrivals):
            if w.pattern == pattern and _inside(w.cv, pattern, margin):
                found.append(FunctionWindow(
                    trace.functions[row], rank, trace.triggers[row], w.start_minute,
                    trace.minute_labels[w.start_minute], w.minutes, w.arrivals, w.cv,
                    w.pattern))
    found.sort(key=lambda f: (-f.arrivals, f.rank, f.start_minute))
    return found if limit is None else found[:limit]


def _inside(cv: float, pattern: Pattern, margin: float) -> bool:
    if pattern == "slow":
        return cv <= SLOW_BELOW - margin
    if pattern == "normal":
        return SLOW_BELOW + margin <= cv <= BURSTY_ABOVE - margin
    if pattern == "bursty":
        return cv >= BURSTY_ABOVE + margin
    return True


def _check_minutes(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise MoefleetError(f"{name} must be a positive integer, got {value!r}",
                            f"pass {name} in minutes, e.g. 60")
    return int(value)
