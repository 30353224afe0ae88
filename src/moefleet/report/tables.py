"""Result tables that fit the terminal without cutting a number.

Rich shrinks a table that is wider than the console by wrapping or ellipsising cells, so
a cost such as ``4.014e-04`` printed in an 80-column terminal became ``4.014e-…``. Every
result table of the CLI is built here instead, with three rules:

- numbers are formatted to 3 significant digits (:func:`sig3`) and the unit lives in the
  header (``cost (USD)``), so cells stay short;
- a numeric column is never narrower than its longest cell (``min_width``), so a number
  never wraps or ellipsises; headers and text cells may wrap onto more lines;
- when the columns' minimum widths cannot fit the console, the columns with the highest
  ``drop`` rank are left out (``drop=0`` columns always stay), and the caption says which
  and that ``--json`` has everything.

Invariant (tested at COLUMNS=80 in ``tests/docs/test_cli_width.py``): a table returned by
:func:`fit_table` renders no line longer than the console and no number cut with "…".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

# Rich draws a border and one space of padding on each side of every cell.
_PER_COLUMN, _EDGE = 3, 1


def sig3(x: float | int | None, *, none: str = "-") -> str:
    """``x`` to 3 significant digits: plain notation from 0.001 up to 1e6 (``3.14``,
    ``1.00``, ``0.0125``; from 100 up the whole number, ``1,485``), scientific outside it
    (``4.01e-04``); ``None`` and NaN as ``none``."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    a = abs(x)
    if a == 0:
        return "0"
    if a >= 1e6 or a < 1e-3:
        return f"{x:.2e}"
    if a >= 100:
        return f"{round(x):,}"
    if isinstance(x, int):
        return str(x)
    return f"{x:#.3g}".rstrip(".")  # '#' keeps trailing zeros: 1.00, not 1


@dataclass(frozen=True)
class Col:
    """One column: header (with its unit), whether it holds numbers, and its drop rank
    (0 = always shown; on a narrow terminal the highest ranks go first)."""

    header: str
    numeric: bool = True
    drop: int = 0


def _min_width(col: Col, cells: Sequence[str]) -> int:
    words = [w for w in col.header.split() if w] or [""]
    head = max(len(w) for w in words)
    if col.numeric:
        return max([head, *(len(c) for c in cells)])
    longest_word = max([1, *(len(w) for c in cells for w in c.split())])
    return max(head, min(longest_word, 24))


def fit_table(title: str | None, cols: Sequence[Col], rows: Sequence[Sequence[str]],
              *, width: int | None = None, caption: str | None = None) -> Table:
    """A rich table of ``rows`` (already formatted strings, one per column) that fits
    ``width`` (default: the console's) by leaving out the highest-ranked columns."""
    if any(len(r) != len(cols) for r in rows):
        raise ValueError("every row needs one cell per column")
    width = width or Console().width
    keep = list(range(len(cols)))
    mins = [_min_width(c, [r[i] for r in rows]) for i, c in enumerate(cols)]

    def total(idx: list[int]) -> int:
        return sum(mins[i] + _PER_COLUMN for i in idx) + _EDGE

    dropped: list[str] = []
    while total(keep) > width:
        rank, i = max((cols[i].drop, i) for i in keep)
        if rank == 0:
            break  # nothing left to drop: rich wraps the text columns
        keep.remove(i)
        dropped.append(cols[i].header)
    notes = [caption] if caption else []
    if dropped:
        notes.append(f"not shown at this width: {', '.join(reversed(dropped))} (see --json)")
    widths = _shrink([_natural(cols[i], [r[i] for r in rows]) for i in keep],
                     [mins[i] for i in keep], width - total([]) - _PER_COLUMN * len(keep))
    t = Table(title=title, caption="; ".join(notes) or None)
    for w, i in zip(widths, keep, strict=True):
        # Explicit widths: rich does not have to shrink anything, so a numeric column
        # keeps its longest cell whole; headers and text fold onto more lines instead.
        c = cols[i]
        t.add_column(c.header, justify="right" if c.numeric else "left", overflow="fold",
                     width=w)
    for r in rows:
        t.add_row(*(r[i] for i in keep))
    return t


def _natural(col: Col, cells: Sequence[str]) -> int:
    return max([len(col.header), *(len(c) for c in cells)])


def _shrink(natural: list[int], mins: list[int], room: int) -> list[int]:
    """Column widths summing to at most ``room`` (if the minimums allow): the widest
    columns give up their slack first."""
    widths = list(natural)
    while sum(widths) > room:
        slack = [(w - m, j) for j, (w, m) in enumerate(zip(widths, mins, strict=True))]
        most, j = max(slack)
        if most <= 0:
            break
        widths[j] -= 1
    return widths
