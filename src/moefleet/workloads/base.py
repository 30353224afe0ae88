"""Shared vocabulary of arrival processes: :class:`Arrival`, :class:`Workload`, validators.

A workload is a deterministic function ``(duration_s, seed) -> list[Arrival]``; the same
list drives the discrete-event simulator and the real load generator.

Invariants every implementation keeps (the unit tests check them):

* arrivals lie in ``[0, duration_s)`` and their ``t_s`` is non-decreasing;
* the same ``(duration_s, seed)`` gives the same list, on every machine;
* prefix consistency: for ``d1 < d2`` and the same seed, ``arrivals(d1, seed)`` equals the
  arrivals of ``arrivals(d2, seed)`` with ``t_s < d1`` — extending a horizon never moves
  earlier arrivals;
* ``request_id`` is unique within one list.

Units: seconds for times and durations, requests per second for rates.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moefleet.errors import MoefleetError


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request arriving ``t_s`` seconds after the workload starts.

    ``prompt_tokens``/``output_tokens`` are set where the source knows them (Azure LLM
    trace); ``function`` is the source function hash (Azure Functions trace).
    """

    t_s: float
    request_id: str
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    function: str | None = None


class Workload(ABC):
    """An arrival process. Subclasses set ``name`` (their kind in :func:`load_workload`)."""

    name: str = "workload"

    @abstractmethod
    def arrivals(self, duration_s: float, seed: int) -> list[Arrival]:
        """Arrivals in ``[0, duration_s)``, sorted by ``t_s``, deterministic under ``seed``."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """JSON-serialisable parameters and summary facts (``kind`` is always present)."""

    def peak_rate_rps(self) -> float | None:
        """The highest mean arrival rate of the process (req/s), if known up front.

        Used to refuse a ``duration x rate`` that would generate more arrivals than
        :data:`moefleet.limits.MAX_ARRIVALS` before any is generated."""
        rates = [getattr(self, a) for a in ("rate_rps", "base_rps") if hasattr(self, a)]
        if not rates:
            return None
        factor = float(getattr(self, "factor", 1.0))
        return float(rates[0]) * max(1.0, factor)

    def check_budget(self, duration_s: float) -> None:
        """Raise ``LimitError`` if this process would make more than MAX_ARRIVALS arrivals
        in ``duration_s`` (four standard deviations of slack for a Poisson count)."""
        from moefleet.errors import LimitError
        from moefleet.limits import MAX_ARRIVALS

        rate = self.peak_rate_rps()
        if rate is None or not math.isfinite(duration_s):
            return
        mean = rate * duration_s
        if mean - 4 * math.sqrt(mean) > MAX_ARRIVALS:
            raise LimitError(
                f"workload {self.name} at {rate:g} req/s for {duration_s:g} s makes about "
                f"{mean:.3g} requests; the limit is {MAX_ARRIVALS:,}",
                "lower the rate or --duration (see README, 'Limits')")

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.describe().items() if k != "kind")
        return f"{type(self).__name__}({params})"


# ----------------------------------------------------------------------------- validators


def check_positive(name: str, value: float) -> float:
    """``value`` as a float if it is finite and > 0, else a :class:`MoefleetError`."""
    v = _as_float(name, value)
    if not (math.isfinite(v) and v > 0):
        raise MoefleetError(f"{name} must be a finite number > 0, got {value!r}",
                            f"pass a positive {name}")
    return v


def check_non_negative(name: str, value: float) -> float:
    """``value`` as a float if it is finite and >= 0, else a :class:`MoefleetError`."""
    v = _as_float(name, value)
    if not (math.isfinite(v) and v >= 0):
        raise MoefleetError(f"{name} must be a finite number >= 0, got {value!r}",
                            f"pass a non-negative {name}")
    return v


def check_duration(duration_s: float, *, allow_inf: bool = False) -> float:
    """A duration in seconds: >= 0; ``math.inf`` only where ``allow_inf`` (trace replays)."""
    v = _as_float("duration_s", duration_s)
    if math.isnan(v) or v < 0 or (math.isinf(v) and not allow_inf):
        what = ">= 0 (or math.inf for a whole trace)" if allow_inf else "finite and >= 0"
        raise MoefleetError(f"duration_s must be {what}, got {duration_s!r}",
                            "pass the length of the workload in seconds")
    return v


def check_seed(seed: int) -> int:
    """A seed is a non-negative int (numpy's requirement)."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise MoefleetError(f"seed must be a non-negative integer, got {seed!r}",
                            "pass e.g. seed=0")
    return int(seed)


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise MoefleetError(f"{name} must be a number, got {value!r}", f"pass a numeric {name}")
    return float(value)


# ----------------------------------------------------------------------------- generators

#: Draws per chunk while extending a renewal process. numpy's Generator yields the same
#: stream whether drawn in one call or in chunks, so the chunk size never changes results.
_CHUNK = 4096


def cumulative_until(
    draw: Callable[[np.random.Generator, int], np.ndarray],
    horizon: float,
    rng: np.random.Generator,
) -> np.ndarray:
    """Partial sums of i.i.d. draws ``draw(rng, n)``, keeping those ``< horizon``.

    This is a renewal process started at 0 (the first event is at the first draw).
    Draws must be non-negative with a positive mean, or this would not terminate.
    """
    parts: list[np.ndarray] = []
    last = 0.0
    while True:
        sums = last + np.cumsum(draw(rng, _CHUNK))
        if sums[-1] >= horizon:
            parts.append(sums[sums < horizon])
            break
        parts.append(sums)
        last = float(sums[-1])
    return np.concatenate(parts)


def to_arrivals(
    times_s: np.ndarray | Sequence[float],
    prefix: str,
    *,
    functions: Sequence[str | None] | None = None,
    prompt_tokens: Sequence[int] | np.ndarray | None = None,
    output_tokens: Sequence[int] | np.ndarray | None = None,
    ids: Sequence[int] | None = None,
) -> list[Arrival]:
    """Wrap already-sorted times as :class:`Arrival` objects with ids ``{prefix}-{i}``.

    ``ids`` overrides the running index ``i`` (e.g. the row number in a trace file).
    """
    times = np.asarray(times_s, dtype=np.float64).tolist()
    n = len(times)
    idx = range(n) if ids is None else ids
    rids = [f"{prefix}-{i}" for i in idx]
    none: list[None] = [None] * n
    prompts = none if prompt_tokens is None else np.asarray(prompt_tokens, np.int64).tolist()
    outputs = none if output_tokens is None else np.asarray(output_tokens, np.int64).tolist()
    funcs = none if functions is None else list(functions)
    if not len(rids) == len(prompts) == len(outputs) == len(funcs) == n:
        raise ValueError("to_arrivals: all columns must have one value per time")
    return [Arrival(t, r, p, o, f)
            for t, r, p, o, f in zip(times, rids, prompts, outputs, funcs, strict=True)]
