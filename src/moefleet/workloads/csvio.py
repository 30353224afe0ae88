"""Arrival lists as CSV: ``t_s,request_id,prompt_tokens,output_tokens,function``.

Empty cells mean None. Times are written with ``repr`` so a write/read round trip is
exact. Writes are atomic (temp file + rename). Reading checks the required columns
(``t_s``, ``request_id``; the others are optional), that times are finite and >= 0,
that ids are unique, and that times are non-decreasing — unless ``sort=True``, which
sorts by time (stably) instead of failing.
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Iterable
from pathlib import Path

from moefleet.errors import DataError
from moefleet.io import read_text_input, write_text_atomic
from moefleet.limits import MAX_ARRIVALS, MAX_PROMPT_TOKENS
from moefleet.workloads.base import Arrival

COLUMNS = ("t_s", "request_id", "prompt_tokens", "output_tokens", "function")
REQUIRED = ("t_s", "request_id")


def write_arrivals_csv(path: str | os.PathLike[str], arrivals: Iterable[Arrival]) -> None:
    """Write ``arrivals`` (in the given order) to ``path`` atomically."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    for a in arrivals:
        w.writerow([repr(float(a.t_s)), a.request_id, _cell(a.prompt_tokens),
                    _cell(a.output_tokens), _cell(a.function)])
    write_text_atomic(path, buf.getvalue())


def read_arrivals_csv(path: str | os.PathLike[str], *, sort: bool = False) -> list[Arrival]:
    """Arrivals from a CSV written by :func:`write_arrivals_csv` (or any with its columns).

    Raises :class:`DataError` naming the file and line for a missing file or column, an
    unparsable or negative value, a duplicate request id, or (without ``sort``) a time
    earlier than the previous row's.
    """
    file = Path(path)
    if not file.is_file():
        raise DataError(f"arrivals file not found: {file}", "check the path")
    text = read_text_input(file, "arrivals file", "an arrivals CSV (t_s,request_id,...)")
    out: list[Arrival] = []
    seen: set[str] = set()
    with io.StringIO(text, newline="") as fh:
        reader = csv.DictReader(fh)
        cols = reader.fieldnames or []
        missing = [c for c in REQUIRED if c not in cols]
        if missing:
            raise DataError(f"{file}: missing column(s) {', '.join(missing)}",
                            f"an arrivals CSV needs columns {', '.join(REQUIRED)}")
        for line, row in enumerate(reader, start=2):
            t = _float(row["t_s"], file, line)
            rid = row["request_id"] or ""
            if not rid:
                raise DataError(f"{file}:{line}: empty request_id", "give every row an id")
            if rid in seen:
                raise DataError(f"{file}:{line}: duplicate request_id '{rid}'",
                                "request ids must be unique")
            seen.add(rid)
            if not sort and out and t < out[-1].t_s:
                raise DataError(
                    f"{file}:{line}: t_s={t} is earlier than the previous row's {out[-1].t_s}",
                    "sort the file by t_s, or read it with sort=True")
            if len(out) >= MAX_ARRIVALS:
                raise DataError(f"{file}: more than {MAX_ARRIVALS} arrivals",
                                "see README, 'Limits'")
            out.append(Arrival(
                t_s=t, request_id=rid,
                prompt_tokens=_int(row.get("prompt_tokens"), "prompt_tokens", file, line),
                output_tokens=_int(row.get("output_tokens"), "output_tokens", file, line),
                function=row.get("function") or None,
            ))
    if sort:
        out.sort(key=lambda a: a.t_s)
    return out


def _cell(v: int | str | None) -> str:
    return "" if v is None else str(v)


def _float(text: str | None, file: Path, line: int) -> float:
    try:
        t = float(text or "")
    except ValueError:
        raise DataError(f"{file}:{line}: t_s={text!r} is not a number",
                        "t_s is seconds from the workload start") from None
    if not math.isfinite(t) or t < 0:
        raise DataError(f"{file}:{line}: t_s={text!r} must be finite and >= 0",
                        "t_s is seconds from the workload start")
    return t


def _int(text: str | None, col: str, file: Path, line: int) -> int | None:
    if text is None or text == "":
        return None
    try:
        v = int(text)
    except ValueError:
        raise DataError(f"{file}:{line}: {col}={text!r} is not an integer",
                        f"{col} is a token count or empty") from None
    if v < 0:
        raise DataError(f"{file}:{line}: {col}={v} is negative", f"{col} is a token count")
    if v > MAX_PROMPT_TOKENS:
        raise DataError(f"{file}:{line}: {col}={v} exceeds the limit {MAX_PROMPT_TOKENS}",
                        "see README, 'Limits'")
    return v
