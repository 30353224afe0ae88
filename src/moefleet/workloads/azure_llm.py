"""Replay of the Azure LLM inference trace 2023 (Splitwise, Patel et al., ISCA 2024).

Files ``azure_llm_inference_2023/AzureLLMInferenceTrace_{conv,code}.csv`` with columns
``TIMESTAMP,ContextTokens,GeneratedTokens`` (about one hour each; conv 19,366 requests,
code 8,819). Arrival times are relative to the first request and divided by ``speedup``;
each arrival carries its prompt (context) and output (generated) token counts. Request
ids are ``azure-llm-<trace>-<row>`` with the 0-based data row, stable under truncation.
"""

from __future__ import annotations

import csv
import functools
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from moefleet.errors import DataError, MoefleetError
from moefleet.workloads._data import file_key, find_trace_file, portable
from moefleet.workloads.base import (
    Arrival,
    Workload,
    check_duration,
    check_positive,
    check_seed,
    to_arrivals,
)

FOLDER = "azure_llm_inference_2023"
TRACES = ("conv", "code")
COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True, eq=False)
class AzureLLMTrace:
    """Parsed trace: ``t_s`` seconds since the first request (non-decreasing), tokens."""

    path: Path
    t_s: np.ndarray  # float64 [N]
    prompt_tokens: np.ndarray  # int64 [N]
    output_tokens: np.ndarray  # int64 [N]
    start: str  # TIMESTAMP of the first request


def _seconds(stamp: str) -> tuple[float, float]:
    """(whole seconds since the epoch, fraction) of 'YYYY-MM-DD HH:MM:SS[.fffffff]'.

    Parsed by hand because the trace carries 7 fractional digits (100 ns), one more than
    ``datetime`` keeps.
    """
    whole, _, frac = stamp.partition(".")
    base = datetime.fromisoformat(whole).replace(tzinfo=UTC).timestamp()
    if frac and not frac.isdigit():
        raise ValueError(f"bad fractional seconds in {stamp!r}")
    return base, float("0." + frac) if frac else 0.0


def load_azure_llm(
    trace: str = "conv", path: str | os.PathLike[str] | None = None
) -> AzureLLMTrace:
    """Parse one trace (cached while the file is unchanged); rows must be in time order.

    Raises :class:`DataError` for a missing file, missing columns, unparsable values,
    negative token counts or timestamps that go backwards.
    """
    if trace not in TRACES:
        raise MoefleetError(f"unknown Azure LLM trace '{trace}'",
                            f"use trace= one of: {', '.join(TRACES)}")
    file = find_trace_file(FOLDER, f"AzureLLMInferenceTrace_{trace}.csv", path)
    return _load_cached(file_key(file))


@functools.lru_cache(maxsize=4)
def _load_cached(key: tuple[str, int, int]) -> AzureLLMTrace:
    file = Path(key[0])
    whole: list[float] = []
    frac: list[float] = []
    prompt: list[int] = []
    output: list[int] = []
    first = ""
    with open(file, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise DataError(f"{file}: missing columns {', '.join(missing)}",
                            f"the trace needs columns {','.join(COLUMNS)}")
        for line, row in enumerate(reader, start=2):
            try:
                w, f = _seconds(row["TIMESTAMP"])
                p, o = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (TypeError, ValueError) as exc:
                raise DataError(f"{file}:{line}: cannot parse row ({exc})",
                                "repair or re-fetch the trace file") from exc
            if p < 0 or o < 0:
                raise DataError(f"{file}:{line}: negative token count",
                                "repair or re-fetch the trace file")
            if not whole:
                first = row["TIMESTAMP"]
            whole.append(w)
            frac.append(f)
            prompt.append(p)
            output.append(o)
    if not whole:
        raise DataError(f"{file} has no requests", "point path= at a non-empty trace")
    # Subtract whole seconds and fractions separately to keep sub-microsecond precision.
    t = (np.asarray(whole) - whole[0]) + (np.asarray(frac) - frac[0])
    back = np.flatnonzero(np.diff(t) < 0)
    if back.size:
        raise DataError(f"{file}:{int(back[0]) + 3}: timestamp earlier than the previous row",
                        "sort the trace by TIMESTAMP")
    arrays = [t, np.asarray(prompt, dtype=np.int64), np.asarray(output, dtype=np.int64)]
    for a in arrays:
        a.setflags(write=False)
    return AzureLLMTrace(file, arrays[0], arrays[1], arrays[2], first)


class AzureLLMWorkload(Workload):
    """Requests of the Azure LLM 2023 ``conv`` or ``code`` trace with their token counts.

    ``speedup`` > 1 compresses time (2.0 replays the hour in 30 minutes). ``duration_s``
    truncates (``math.inf`` = whole trace); the seed is accepted for the common interface
    and does not change anything: the replay is deterministic.
    """

    name = "azure-llm"

    def __init__(self, trace: str = "conv", path: str | os.PathLike[str] | None = None,
                 speedup: float = 1.0) -> None:
        self.trace_name = trace
        self.trace = load_azure_llm(trace, path)
        self.speedup = check_positive("speedup", speedup)

    @property
    def trace_duration_s(self) -> float:
        """Time of the last request after speedup, seconds."""
        return float(self.trace.t_s[-1]) / self.speedup

    def arrivals(self, duration_s: float, seed: int) -> list[Arrival]:
        duration = check_duration(duration_s, allow_inf=True)
        check_seed(seed)
        t = self.trace.t_s / self.speedup
        n = int(np.searchsorted(t, duration, side="left"))  # t < duration
        return to_arrivals(t[:n], f"{self.name}-{self.trace_name}",
                           prompt_tokens=self.trace.prompt_tokens[:n],
                           output_tokens=self.trace.output_tokens[:n])

    def describe(self) -> dict[str, Any]:
        n = len(self.trace.t_s)
        return {
            "kind": self.name,
            "trace": self.trace_name,
            "speedup": self.speedup,
            "requests": n,
            "trace_duration_s": self.trace_duration_s,
            "mean_rate_rps": (n - 1) / self.trace_duration_s if self.trace_duration_s else None,
            "start_timestamp": self.trace.start,
            "path": portable(self.trace.path),
        }
