"""Traffic for ``compare``: arrivals with prompt and output lengths, one list shared by
every policy.

Specs (``--traffic``):

    azure-llm:conv | azure-llm:code     Azure LLM inference 2023 (Splitwise), lengths included
    azure-fn-2019:slow|normal|bursty    the busiest Azure Functions 2019 window of that
                                        pattern (sMoE's CV bands), ``--duration`` long
    azure-fn-2021:slow|normal|bursty    the Azure Functions 2021 sample (its invocation
                                        starts), classified by the same CV bands
    poisson:rate=R                      Poisson arrivals at R requests/s

``rate_scale`` multiplies the arrival rate: Azure LLM replays time faster (``speedup``),
Azure Functions multiplies per-minute counts (stochastic rounding), Poisson scales R.
Where the source has no lengths (functions traces, Poisson) each request draws its
prompt and output lengths from the Azure LLM conv trace's rows (seeded), so every
traffic has realistic lengths. Invariants: arrivals sorted by time, all in
``[0, duration)``, every arrival has prompt >= 1 and output >= 1 tokens.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moefleet.errors import DataError, MoefleetError
from moefleet.workloads.base import Arrival

KINDS = ("azure-llm:conv", "azure-llm:code", "azure-fn-2019:<pattern>",
         "azure-fn-2021:<pattern>", "poisson:rate=R")
MAX_PROMPT = 4096  # longer prompts are clipped (the shapes' context windows)
MAX_OUTPUT = 1024
MAX_RATE_SCALE = 1000.0  # a trace replayed 1,000x faster is already far past any platform
MAX_ARRIVALS = 2_000_000  # requests in one run: bounds the memory a rate can ask for
FALLBACK_PROMPT, FALLBACK_OUTPUT = 1020, 129  # conv medians, where the trace is missing


@dataclass(frozen=True)
class Traffic:
    spec: str
    arrivals: list[Arrival]
    duration_s: float
    described: dict[str, Any] = field(default_factory=dict)

    @property
    def times(self) -> np.ndarray:
        return np.array([a.t_s for a in self.arrivals], np.float64)

    @property
    def prompts(self) -> np.ndarray:
        return np.array([a.prompt_tokens or 1 for a in self.arrivals], np.int64)

    @property
    def outputs(self) -> np.ndarray:
        return np.array([a.output_tokens or 1 for a in self.arrivals], np.int64)


def _bad(spec: str, why: str = "") -> MoefleetError:
    return MoefleetError(f"unknown traffic '{spec}'{': ' + why if why else ''}",
                         f"use one of: {', '.join(KINDS)}")


def _conv_lengths() -> tuple[np.ndarray, np.ndarray]:
    from moefleet.workloads.azure_llm import load_azure_llm

    tr = load_azure_llm("conv")
    return np.asarray(tr.prompt_tokens), np.asarray(tr.output_tokens)


def _with_lengths(times: np.ndarray, prefix: str, seed: int,
                  prompts: np.ndarray | None = None,
                  outputs: np.ndarray | None = None) -> list[Arrival]:
    if prompts is None or outputs is None:
        try:
            p_all, o_all = _conv_lengths()
        except DataError:  # no shared data here: the conv trace's medians, fixed
            p_all, o_all = np.array([FALLBACK_PROMPT]), np.array([FALLBACK_OUTPUT])
        rows = np.random.default_rng(seed + 7).integers(0, len(p_all), len(times))
        prompts, outputs = p_all[rows], o_all[rows]
    p = np.clip(np.asarray(prompts, np.int64), 1, MAX_PROMPT)
    o = np.clip(np.asarray(outputs, np.int64), 1, MAX_OUTPUT)
    return [Arrival(float(t), f"{prefix}-{i}", int(a), int(b))
            for i, (t, a, b) in enumerate(zip(times, p, o, strict=True))]


def _pattern(spec: str, value: str) -> str:
    if value not in ("slow", "normal", "bursty"):
        raise _bad(spec, f"pattern '{value}' is not slow, normal or bursty")
    return value


def load_traffic(spec: str, duration_s: float, *, rate_scale: float = 1.0, seed: int = 0,
                 interval_s: float = 10.0) -> Traffic:
    """The arrivals of ``spec`` over ``[0, duration_s)``; see the module docstring."""
    if not (math.isfinite(rate_scale) and 0 < rate_scale <= MAX_RATE_SCALE):
        raise MoefleetError(f"--rate-scale must be in (0, {MAX_RATE_SCALE:g}], got "
                            f"{rate_scale!r}", "e.g. --rate-scale 2")
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise MoefleetError(f"--duration must be > 0 seconds, got {duration_s!r}",
                            "e.g. --duration 600")
    kind, _, value = spec.partition(":")
    kind, value = kind.strip(), value.strip()
    if kind in ("azure-llm", "azure-llm-2023"):
        return _azure_llm(spec, value, duration_s, rate_scale)
    if kind in ("azure-fn-2019", "azure-fn"):
        return _azure_fn_2019(spec, _pattern(spec, value), duration_s, rate_scale, seed,
                              interval_s)
    if kind == "azure-fn-2021":
        return _azure_fn_2021(spec, _pattern(spec, value), duration_s, rate_scale, seed,
                              interval_s)
    if kind == "poisson":
        key, _, rate = value.partition("=")
        try:
            r = float(rate)
        except ValueError:
            raise _bad(spec, "give the rate as poisson:rate=R") from None
        if key != "rate" or not (math.isfinite(r) and r > 0):
            raise _bad(spec, "give a rate > 0 as poisson:rate=R")
        r *= rate_scale
        if r * duration_s > MAX_ARRIVALS:  # bound the arrivals before drawing them
            raise MoefleetError(f"traffic '{spec}' x --rate-scale {rate_scale:g} over "
                                f"{duration_s:g} s is {r * duration_s:.3g} requests, over "
                                f"{MAX_ARRIVALS:,}", "lower the rate, --rate-scale or --duration")
        rng = np.random.default_rng(seed)
        n = int(rng.poisson(r * duration_s))
        times = np.sort(rng.uniform(0.0, duration_s, n))
        return Traffic(spec, _with_lengths(times, "poisson", seed), duration_s,
                       {"kind": "poisson", "rate_rps": r, "lengths": "azure-llm conv rows"})
    raise _bad(spec)


def _azure_llm(spec: str, trace: str, duration_s: float, rate_scale: float) -> Traffic:
    from moefleet.workloads.azure_llm import AzureLLMWorkload

    if trace not in ("conv", "code"):
        raise _bad(spec, f"trace '{trace}' is not conv or code")
    wl = AzureLLMWorkload(trace, speedup=rate_scale)
    if wl.trace_duration_s < duration_s:
        raise MoefleetError(
            f"traffic '{spec}' covers {wl.trace_duration_s:.0f} s at rate scale "
            f"{rate_scale:g}, shorter than --duration {duration_s:g} s",
            f"pass --duration {int(wl.trace_duration_s)} or less")
    got = wl.arrivals(duration_s, 0)
    times = np.array([a.t_s for a in got])
    arr = _with_lengths(times, f"azure-llm-{trace}", 0,
                        np.array([a.prompt_tokens for a in got]),
                        np.array([a.output_tokens for a in got]))
    return Traffic(spec, arr, duration_s, {**wl.describe(), "lengths": "the trace's own"})


def _check_window(spec: str, span_s: float, duration_s: float, interval_s: float) -> None:
    if span_s < interval_s:
        raise MoefleetError(f"traffic '{spec}': the trace window is {span_s:.0f} s, shorter "
                            f"than the {interval_s:g} s control interval",
                            "use a longer window or a shorter --interval")
    if span_s < duration_s:
        raise MoefleetError(f"traffic '{spec}': the trace window is {span_s:.0f} s, shorter "
                            f"than --duration {duration_s:g} s",
                            f"pass --duration {int(span_s)} or less")


def _azure_fn_2019(spec: str, pattern: str, duration_s: float, rate_scale: float, seed: int,
                   interval_s: float) -> Traffic:
    from moefleet.workloads.windows import find_windows

    minutes = max(1, math.ceil(duration_s / 60.0))
    found = find_windows(pattern, window_minutes=minutes,  # type: ignore[arg-type]
                         min_arrivals=max(3, minutes), limit=1)
    if not found:
        raise MoefleetError(f"traffic '{spec}': no {minutes}-minute Azure Functions 2019 "
                            f"window is {pattern}", "try another pattern or --duration")
    w = found[0]
    _check_window(spec, w.minutes * 60.0, duration_s, interval_s)
    got = w.workload(scale=rate_scale).arrivals(duration_s, seed)
    times = np.array([a.t_s for a in got])
    return Traffic(spec, _with_lengths(times, "azure-fn-2019", seed), duration_s,
                   {"kind": "azure-fn-2019", "pattern": w.pattern, "cv": w.cv,
                    "function": w.function, "start_minute": w.start_minute,
                    "window_arrivals": w.arrivals, "scale": rate_scale,
                    "lengths": "azure-llm conv rows"})


def _azure_fn_2021(spec: str, pattern: str, duration_s: float, rate_scale: float, seed: int,
                   interval_s: float) -> Traffic:
    from moefleet.workloads._data import find_trace_file
    from moefleet.workloads.windows import pattern_of, window_cv

    path = find_trace_file("azure_functions_2021_sample", "Azure2021_200.csv", None)
    with open(path, newline="") as fh:
        starts = sorted(float(r["end_timestamp"]) - float(r["duration"])
                        for r in csv.DictReader(fh))
    t = np.asarray(starts) - starts[0]
    span = float(t[-1])
    _check_window(spec, span, duration_s, interval_s)
    t = t[t < duration_s]
    per_min = np.bincount((t // 60).astype(int), minlength=max(1, math.ceil(duration_s / 60)))
    cv = window_cv(per_min)
    found = pattern_of(cv, len(t))
    if found != pattern:
        raise MoefleetError(f"traffic '{spec}': the Azure Functions 2021 sample's first "
                            f"{duration_s:g} s are {found} (CV {cv:.2f}), not {pattern}",
                            f"use azure-fn-2021:{found}")
    rng = np.random.default_rng(seed)
    whole = math.floor(rate_scale)
    reps = [t] * whole
    if rate_scale > whole:  # the fractional part: a random subset of the arrivals again
        reps.append(t[rng.random(len(t)) < rate_scale - whole])
    times = np.sort(np.concatenate(reps)) if reps else t[:0]
    return Traffic(spec, _with_lengths(times, "azure-fn-2021", seed), duration_s,
                   {"kind": "azure-fn-2021", "pattern": found, "cv": cv,
                    "scale": rate_scale, "lengths": "azure-llm conv rows"})
