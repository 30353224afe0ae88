"""Fitting the two laws of a compute profile to measured times.

- :func:`fit_batch_law`: ``t1(n) = a + b·n`` (seconds) by weighted linear least squares
  on the one-thread medians.
- :func:`fit_thread_law`: Remoe's ``T(v) = θ1·exp(−θ2·v) + θ3`` (seconds per token) by
  nonlinear least squares on per-token times at a large batch.

Both minimise *relative* residuals ``(model − t) / t``: timing noise grows roughly in
proportion to the time, and equal relative weights keep the small batches (which pin the
overhead ``a``) from being drowned out by the large ones. R² is reported on the plain,
unweighted times (the usual meaning), residuals in seconds.

Invariants of what comes out (the ones ``ComputeProfile`` checks on load): ``a ≥ 0``,
``b > 0``, ``θ1, θ2, θ3 ≥ 0`` and ``T(1) > 0``, so every fitted time is positive and
non-increasing in the thread count. Only numpy is needed; when scipy is installed the
thread law is refined with ``scipy.optimize.curve_fit`` (bounded trust-region).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike

from moefleet.errors import DataError
from moefleet.profiles.model import BatchLaw, ThreadLaw

# With only two thread counts Remoe's three parameters are underdetermined; Amdahl's law
# T(v) = α + β/v (two parameters) is fitted instead and Remoe's form is fitted to it on
# v = 1..AMDAHL_MAX_V, the vCPU range planners ask about (AWS Lambda: up to 6 vCPUs).
AMDAHL_MAX_V = 6
# Where the θ2 search stops: exp(−20) ≈ 2e-9, i.e. all speed-up gained by the 2nd thread.
MAX_THETA2 = 20.0
# Per-token slope used when time does not grow with tokens at all (a degenerate fit).
MIN_PER_TOKEN_S = 1e-12


@dataclass(frozen=True)
class BatchFit:
    law: BatchLaw
    r2: float
    residuals_s: list[float]  # measured − fitted, one per point, seconds
    degenerate: bool = False  # time did not grow with tokens; slope floored


@dataclass(frozen=True)
class ThreadFit:
    law: ThreadLaw
    r2: float
    residuals_s: list[float]  # measured − fitted per-token time, seconds
    method: str = ""
    notes: list[str] = field(default_factory=list)


def r_squared(y: ArrayLike, y_hat: ArrayLike) -> float:
    """Coefficient of determination; NaN when ``y`` has no spread (it is undefined)."""
    ya, fa = np.asarray(y, dtype=float), np.asarray(y_hat, dtype=float)
    ss_tot = float(np.sum((ya - ya.mean()) ** 2))
    if len(ya) < 2 or ss_tot <= 0.0:
        return float("nan")
    return 1.0 - float(np.sum((ya - fa) ** 2)) / ss_tot


def _points(x: ArrayLike, y: ArrayLike, what: str) -> tuple[np.ndarray, np.ndarray]:
    xa, ya = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if xa.shape != ya.shape or xa.ndim != 1 or len(xa) == 0:
        raise DataError(
            f"{what}: need equally long, non-empty x and y (got {xa.shape} and {ya.shape})",
            "pass one measured time per point",
        )
    if not (np.all(np.isfinite(xa)) and np.all(np.isfinite(ya))) or np.any(ya <= 0):
        raise DataError(
            f"{what}: times must be finite and positive, got {ya.tolist()}",
            "re-measure; a zero or NaN time means the timer or the function failed",
        )
    return xa, ya


def fit_batch_law(tokens: ArrayLike, times_s: ArrayLike) -> BatchFit:
    """Fit ``t1(n) = a + b·n`` to (tokens, seconds) with ``a ≥ 0, b > 0``.

    One distinct token count cannot separate overhead from slope: then ``a = 0`` and
    ``b = mean(t / n)``. A negative intercept is clamped to 0 (refit through the origin);
    a non-positive slope (noise swamped the per-token cost) is floored at
    ``MIN_PER_TOKEN_S`` and flagged ``degenerate``.
    """
    n, t = _points(tokens, times_s, "batch law")
    if np.any(n <= 0):
        raise DataError(f"batch law: token counts must be positive, got {n.tolist()}",
                        "measure batches of at least one token")
    w = 1.0 / t  # relative residuals: (a + b·n − t) / t
    degenerate = False
    if len(np.unique(n)) < 2:
        a, b = 0.0, float(np.mean(t / n))
    else:
        coef, *_ = np.linalg.lstsq(np.stack([w, n * w], axis=1), np.ones_like(t), rcond=None)
        a, b = float(coef[0]), float(coef[1])
        if a < 0.0:  # overhead can't be negative: best fit through the origin instead
            a, b = 0.0, float(np.sum(n * w) / np.sum((n * w) ** 2))
        if b <= 0.0:
            a, b, degenerate = float(np.sum(w) / np.sum(w**2)), MIN_PER_TOKEN_S, True
    fitted = a + b * n
    law = BatchLaw(overhead_s=a, per_token_s=b)
    return BatchFit(law, r_squared(t, fitted), (t - fitted).tolist(), degenerate)


def _nnls2(a_m2: np.ndarray, y_m: np.ndarray) -> tuple[np.ndarray, float]:
    """Least squares with both coefficients ≥ 0 for a two-column design (active sets)."""
    candidates: list[np.ndarray] = []
    coef, *_ = np.linalg.lstsq(a_m2, y_m, rcond=None)
    if np.all(coef >= 0):
        candidates.append(coef)
    for j in (0, 1):
        col = a_m2[:, j]
        denom = float(col @ col)
        x = np.zeros(2)
        x[j] = max(0.0, float(col @ y_m) / denom) if denom > 0 else 0.0
        candidates.append(x)
    best = min(candidates, key=lambda c: float(np.sum((a_m2 @ c - y_m) ** 2)))
    return best, float(np.sum((a_m2 @ best - y_m) ** 2))


def _solve_linear(
    theta2: float, v: np.ndarray, y: np.ndarray, w: np.ndarray
) -> tuple[np.ndarray, float]:
    """Best (θ1, θ3) ≥ 0 for fixed θ2, minimising weighted relative residuals."""
    design = np.stack([np.exp(-theta2 * v), np.ones_like(v)], axis=1) * (w / y)[:, None]
    return _nnls2(design, w)


def _curve_fit_refine(
    v: np.ndarray, y: np.ndarray, w: np.ndarray, p0: list[float]
) -> list[float] | None:
    try:
        from scipy.optimize import curve_fit
    except ImportError:  # scipy is an optional extra; the grid result stands
        return None

    def model(x: np.ndarray, t1: float, t2: float, t3: float) -> np.ndarray:
        return np.asarray(t1 * np.exp(-t2 * x) + t3)

    start = [max(p0[0], 1e-9), min(max(p0[1], 1e-6), MAX_THETA2), max(p0[2], 1e-9)]
    try:
        with warnings.catch_warnings():
            # Flat data leave the covariance undefined; we use the optimum, not its errors.
            warnings.simplefilter("ignore")
            popt, _ = curve_fit(model, v, y, p0=start, sigma=y / w, maxfev=5000,
                                bounds=([0, 0, 0], [np.inf, MAX_THETA2, np.inf]))
    except (RuntimeError, ValueError):  # no convergence: keep the grid optimum
        return None
    return [float(p) for p in popt]


def _rel_sse(params: Sequence[float], v: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    fitted = params[0] * np.exp(-params[1] * v) + params[2]
    return float(np.sum((w * (fitted - y) / y) ** 2))


def _fit_remoe(
    v: np.ndarray, ys: np.ndarray, w: np.ndarray | None = None
) -> tuple[list[float], str]:
    """Grid over θ2 with (θ1, θ3) by non-negative least squares, then curve_fit."""
    w = np.ones_like(ys) if w is None else w
    grid = np.concatenate([[0.0], np.geomspace(1e-3, MAX_THETA2, 400)])
    sses = [_solve_linear(float(g), v, ys, w)[1] for g in grid]
    g_best = float(grid[int(np.argmin(sses))])
    coef, _ = _solve_linear(g_best, v, ys, w)
    params = [float(coef[0]), g_best, float(coef[1])]
    refined = _curve_fit_refine(v, ys, w, params)
    if refined is not None and _rel_sse(refined, v, ys, w) <= _rel_sse(params, v, ys, w):
        return refined, "nonlinear least squares (scipy curve_fit)"
    return params, "nonlinear least squares (grid)"


def fit_thread_law(vcpus: ArrayLike, per_token_s: ArrayLike) -> ThreadFit:
    """Fit ``T(v) = θ1·exp(−θ2·v) + θ3`` with all θ ≥ 0 (non-increasing in v).

    - one distinct v: the constant law ``θ1 = θ2 = 0, θ3 = mean`` (R² undefined, NaN);
    - two: Amdahl's law ``α + β/v`` (α, β ≥ 0) through the two points, then Remoe's form
      fitted to that curve on v = 1..``AMDAHL_MAX_V`` (three θ cannot be fitted to two
      points; Amdahl extrapolates like real thread scaling, with a serial floor). If the
      second point is slower the law is flat: more vCPUs can always run fewer threads;
    - three or more: θ2 searched on a grid with θ1, θ3 solved by non-negative least
      squares for each (variable projection), then refined by ``curve_fit`` if present.
    """
    v, y = _points(vcpus, per_token_s, "thread law")
    if np.any(v <= 0):
        raise DataError(f"thread law: thread counts must be positive, got {v.tolist()}",
                        "measure with at least one thread")
    scale = float(np.max(y))
    ys = y / scale  # fit in units of the slowest point: keeps the optimiser well scaled
    notes: list[str] = []
    distinct = len(np.unique(v))
    if distinct == 1:
        params, method = [0.0, 0.0, float(np.mean(ys))], "constant (one thread count)"
    elif distinct == 2:
        design = np.stack([np.ones_like(v), 1.0 / v], axis=1) / ys[:, None]
        (alpha, beta), _ = _nnls2(design, np.ones_like(ys))
        v_ext = np.unique(np.concatenate([v, np.arange(1.0, AMDAHL_MAX_V + 1)]))
        # The measured points weigh 30× the extrapolated ones: the law must go (almost)
        # through what was measured and only take its shape beyond from Amdahl.
        weight = np.where(np.isin(v_ext, v), 30.0, 1.0)
        params, method = _fit_remoe(v_ext, alpha + beta / v_ext, weight)
        method = f"two thread counts: Amdahl's law to v={AMDAHL_MAX_V}, then {method}"
    else:
        params, method = _fit_remoe(v, ys)
    if params[0] * math.exp(-params[1]) <= 1e-9 * (params[0] + params[2]) or params[1] == 0.0:
        # A flat law: fold θ1·exp(0) into θ3 so a constant law always reads θ1 = θ2 = 0.
        params = [0.0, 0.0, params[2] + (params[0] if params[1] == 0.0 else 0.0)]
        if distinct > 1:
            notes.append("no speed-up with more threads: constant law")
    law = ThreadLaw(theta1=params[0] * scale, theta2=params[1], theta3=params[2] * scale)
    if not law.per_token_s(1.0) > 0 or not all(math.isfinite(p) for p in params):
        raise DataError(f"thread law fit failed on {y.tolist()}", "re-measure with more repeats")
    fitted = np.array([law.per_token_s(float(x)) for x in v])
    r2 = r_squared(y, fitted) if distinct > 1 else float("nan")
    return ThreadFit(law, r2, (y - fitted).tolist(), method, notes)
