"""Replay of the Azure Functions 2019 per-minute invocation counts.

Source: ``azure_functions_2019_sample500/invocations.csv`` (500 functions sampled from
Shahrad et al., "Serverless in the Wild", ATC 2020; see the folder's PROVENANCE.txt).
Columns: ``HashOwner,HashApp,HashFunction,Trigger`` then one column per minute, headed by
the minute of the day (480..959 in the sample: an 8-hour window).

The trace only gives counts per minute, so the ``c`` invocations of a minute are placed
independently and uniformly at random inside it (seeded). The generated arrivals
reproduce the per-minute counts exactly (``scale = 1``).

Minutes are addressed by *offset* into the sample's minute columns (0 = first column);
``describe()`` also reports the trace's own minute label.
"""

from __future__ import annotations

import csv
import functools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moefleet.errors import DataError, MoefleetError, UnknownNameError
from moefleet.workloads._data import file_key, find_trace_file, portable
from moefleet.workloads.base import (
    Arrival,
    Workload,
    check_duration,
    check_positive,
    check_seed,
    to_arrivals,
)

FOLDER = "azure_functions_2019_sample500"
FILENAME = "invocations.csv"
ID_COLUMNS = ("HashOwner", "HashApp", "HashFunction", "Trigger")
SECONDS_PER_MINUTE = 60.0

FunctionSelector = str | int


@dataclass(frozen=True, eq=False)
class AzureFunctionsTrace:
    """The parsed invocation table. ``counts[f, m]`` = invocations of row f in minute m.

    ``order`` lists row indices busiest first (total invocations, ties by row order);
    rank r means row ``order[r]``.
    """

    path: Path
    owners: tuple[str, ...]
    apps: tuple[str, ...]
    functions: tuple[str, ...]
    triggers: tuple[str, ...]
    minute_labels: tuple[int, ...]
    counts: np.ndarray  # int64 [F, M], read-only
    order: np.ndarray  # int64 [F], row indices by total invocations, descending

    @property
    def n_functions(self) -> int:
        return len(self.functions)

    @property
    def n_minutes(self) -> int:
        return len(self.minute_labels)

    def rank_of(self, row: int) -> int:
        """Rank (0 = busiest) of table row ``row``."""
        return int(np.flatnonzero(self.order == row)[0])

    def resolve(self, selector: FunctionSelector) -> int:
        """Row index of a function given by rank (int) or by HashFunction (str).

        A string may be a unique prefix of the hash (at least 6 characters).
        """
        if isinstance(selector, bool) or not isinstance(selector, int | np.integer | str):
            raise MoefleetError(f"function must be a rank (int) or a hash (str), got {selector!r}",
                                "pass e.g. function=0 for the busiest function")
        if not isinstance(selector, str):
            rank = int(selector)
            if not 0 <= rank < self.n_functions:
                raise MoefleetError(
                    f"function rank {rank} out of range: the sample has {self.n_functions} "
                    f"functions", f"use a rank in 0..{self.n_functions - 1} (0 = busiest)")
            return int(self.order[rank])
        hits = [i for i, h in enumerate(self.functions)
                if h == selector or (len(selector) >= 6 and h.startswith(selector))]
        if len(hits) == 1:
            return hits[0]
        if not hits:
            raise UnknownNameError(f"unknown function hash '{selector}' in {self.path}",
                                   "pass a HashFunction value from invocations.csv, or a rank")
        raise MoefleetError(f"function hash prefix '{selector}' matches {len(hits)} functions",
                            "pass more characters of the hash")


def load_azure_functions(path: str | os.PathLike[str] | None = None) -> AzureFunctionsTrace:
    """Parse ``invocations.csv`` (cached while the file is unchanged).

    Raises :class:`DataError` for a missing file, missing id columns, non-integer or
    negative counts, or ragged rows.
    """
    file = find_trace_file(FOLDER, FILENAME, path)
    return _load_cached(file_key(file))


@functools.lru_cache(maxsize=4)
def _load_cached(key: tuple[str, int, int]) -> AzureFunctionsTrace:
    file = Path(key[0])
    with open(file, newline="", encoding="utf-8") as fh:
        rows = csv.reader(fh)
        header = next(rows, None)
        if header is None:
            raise DataError(f"{file} is empty", "point path= at the Azure Functions 2019 sample")
        missing = [c for c in ID_COLUMNS if c not in header[:4]]
        if missing or len(header) < 5:
            raise DataError(f"{file}: expected columns {','.join(ID_COLUMNS)} then per-minute "
                            f"counts; missing {missing or 'minute columns'}",
                            "use the 2019 invocations_per_function file format")
        try:
            labels = tuple(int(h) for h in header[4:])
        except ValueError as exc:
            raise DataError(f"{file}: minute column headers must be integers ({exc})",
                            "use the 2019 invocations_per_function file format") from exc
        ids: list[list[str]] = []
        counts: list[list[int]] = []
        for line, row in enumerate(rows, start=2):
            if len(row) != len(header):
                raise DataError(f"{file}:{line}: {len(row)} fields, header has {len(header)}",
                                "repair or re-fetch the file")
            try:
                values = [int(v) for v in row[4:]]
            except ValueError as exc:
                raise DataError(f"{file}:{line}: counts must be integers ({exc})",
                                "repair or re-fetch the file") from exc
            if min(values) < 0:
                raise DataError(f"{file}:{line}: negative invocation count",
                                "repair or re-fetch the file")
            ids.append(row[:4])
            counts.append(values)
    if not counts:
        raise DataError(f"{file} has no function rows", "point path= at a non-empty sample")
    table = np.asarray(counts, dtype=np.int64)
    table.setflags(write=False)
    order = np.argsort(-table.sum(axis=1), kind="stable")
    order.setflags(write=False)
    owners, apps, functions, triggers = (tuple(col) for col in zip(*ids, strict=True))
    return AzureFunctionsTrace(file, owners, apps, functions, triggers, labels, table, order)


def spread_per_minute(counts_per_minute: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Sorted arrival times (s): the ``c`` arrivals of minute ``j`` uniform in ``[60j, 60j+60)``.

    Draws exactly ``sum(counts)`` uniforms, minute by minute, so a prefix of the minutes
    gives a prefix of the times.
    """
    counts = np.asarray(counts_per_minute, dtype=np.int64)
    minute = np.repeat(np.arange(len(counts), dtype=np.float64), counts)
    t = (minute + rng.random(len(minute))) * SECONDS_PER_MINUTE
    # minute + u may round up to minute + 1 when u is within an ulp of 1: clamp.
    t = np.minimum(t, np.nextafter((minute + 1.0) * SECONDS_PER_MINUTE, 0.0))
    return np.sort(t, kind="stable")


def scale_counts(counts: np.ndarray, scale: float, rng: np.random.Generator) -> np.ndarray:
    """``counts * scale`` rounded stochastically (floor, +1 with the fractional part's
    probability), so the expected count is exact; identity (no draws) for ``scale == 1``."""
    if scale == 1.0:
        return np.asarray(counts, dtype=np.int64)
    x = np.asarray(counts, dtype=np.float64) * scale
    base = np.floor(x)
    return (base + (rng.random(len(x)) < (x - base))).astype(np.int64)


class AzureFunctionsWorkload(Workload):
    """Arrivals of one or several Azure functions (summed), replayed from per-minute counts.

    ``function``: a rank (int, 0 = busiest in the sample), a HashFunction (str, or a
    unique prefix of >= 6 characters), or a sequence of those to aggregate.
    ``scale``: multiplies every per-minute count (stochastic rounding, see
    :func:`scale_counts`). ``start_minute``: offset of the first replayed minute into the
    sample (0-based; None = 0). The replay ends where the sample ends, even if
    ``duration_s`` is longer (see ``trace_duration_s``); ``duration_s = math.inf`` replays
    everything from ``start_minute``.
    Each function gets its own seeded streams, so aggregation and prefix consistency hold.
    """

    name = "azure-fn"

    def __init__(
        self,
        function: FunctionSelector | Sequence[FunctionSelector] = 0,
        path: str | os.PathLike[str] | None = None,
        scale: float = 1.0,
        start_minute: int | None = None,
    ) -> None:
        self.trace = load_azure_functions(path)
        selectors = [function] if isinstance(function, str | int | np.integer) else function
        if not selectors:
            raise MoefleetError("no function selected", "pass function=<rank or hash>")
        self.rows = tuple(self.trace.resolve(s) for s in selectors)
        if len(set(self.rows)) != len(self.rows):
            raise MoefleetError(f"function selection {list(selectors)!r} names a function twice",
                                "list each function once")
        self.scale = check_positive("scale", scale)
        start = 0 if start_minute is None else start_minute
        if isinstance(start, bool) or not isinstance(start, int | np.integer) or not (
            0 <= start < self.trace.n_minutes
        ):
            raise MoefleetError(
                f"start_minute must be an integer offset in 0..{self.trace.n_minutes - 1}, "
                f"got {start_minute!r}",
                f"minutes count from the sample's first column (trace minute "
                f"{self.trace.minute_labels[0]})")
        self.start_minute = int(start)

    @property
    def trace_duration_s(self) -> float:
        """Seconds of trace available from ``start_minute`` to the end of the sample."""
        return (self.trace.n_minutes - self.start_minute) * SECONDS_PER_MINUTE

    def counts_per_minute(self) -> np.ndarray:
        """Summed per-minute counts of the selected functions from ``start_minute`` on."""
        return self.trace.counts[list(self.rows), self.start_minute:].sum(axis=0)

    def arrivals(self, duration_s: float, seed: int) -> list[Arrival]:
        duration = min(check_duration(duration_s, allow_inf=True), self.trace_duration_s)
        children = np.random.SeedSequence(check_seed(seed)).spawn(2 * len(self.rows))
        n_min = math.ceil(duration / SECONDS_PER_MINUTE)
        stop = self.start_minute + n_min
        times: list[np.ndarray] = []
        labels: list[np.ndarray] = []
        for i, row in enumerate(self.rows):
            counts = self.trace.counts[row, self.start_minute:stop]
            counts = scale_counts(counts, self.scale, np.random.default_rng(children[2 * i]))
            t = spread_per_minute(counts, np.random.default_rng(children[2 * i + 1]))
            times.append(t[t < duration])
            labels.append(np.full(len(times[-1]), i, dtype=np.int64))
        all_t = np.concatenate(times)
        all_f = np.concatenate(labels)
        order = np.argsort(all_t, kind="stable")
        hashes = [self.trace.functions[r] for r in self.rows]
        return to_arrivals(all_t[order], self.name, functions=[hashes[k] for k in all_f[order]])

    def describe(self) -> dict[str, Any]:
        tr = self.trace
        total = int(self.counts_per_minute().sum())
        return {
            "kind": self.name,
            "functions": [tr.functions[r] for r in self.rows],
            "ranks": [tr.rank_of(r) for r in self.rows],
            "triggers": [tr.triggers[r] for r in self.rows],
            "scale": self.scale,
            "start_minute": self.start_minute,
            "start_minute_label": tr.minute_labels[self.start_minute],
            "trace_duration_s": self.trace_duration_s,
            "invocations": total,
            "mean_rate_rps": total * self.scale / self.trace_duration_s,
            "path": portable(tr.path),
        }
