"""The shared result-table helper: 3 significant digits, columns dropped by rank, numbers
never cut (moefleet.report.tables)."""

from __future__ import annotations

import math

from rich.console import Console

from moefleet.report.tables import Col, fit_table, sig3


def test_sig3() -> None:
    assert [sig3(x) for x in (4.014e-4, 1.0, 3.14159, 0.0125, 1485.3, 7.42, 0)] == [
        "4.01e-04", "1.00", "3.14", "0.0125", "1,485", "7.42", "0"]
    assert sig3(None) == "-" and sig3(math.nan) == "-" and sig3(None, none="n/a") == "n/a"
    assert sig3(2_500_000.0) == "2.50e+06" and sig3(12) == "12" and sig3(-0.5) == "-0.500"


def _render(width: int, t) -> list[str]:
    con = Console(width=width, record=True)
    con.print(t)
    return con.export_text().splitlines()


def test_narrow_terminal_drops_ranked_columns_and_keeps_numbers_whole() -> None:
    cols = [Col("plan", numeric=False), Col("MoE cost, model (USD)"), Col("× oracle"),
            Col("latency (s)", drop=2), Col("tokens/s, run", drop=1)]
    rows = [["unadjusted predictions", sig3(4.014e-4), sig3(1.0), sig3(3.14), sig3(1485.3)],
            ["LambdaML", sig3(1.442e-3), sig3(3.59), sig3(6.76), sig3(1564.0)]]
    wide = _render(120, fit_table("t", cols, rows, width=120))
    assert "tokens/s, run" in "\n".join(wide) and "1,485" in "\n".join(wide)
    narrow = _render(40, fit_table("t", cols, rows, width=40))
    text = "\n".join(narrow)
    assert all(len(ln) <= 40 for ln in narrow), text
    assert "…" not in text and "4.01e-04" in text and "0.00144" in text
    assert "1,485" not in text and "not shown at this width" in text  # dropped, said so
    # the highest rank goes first: latency (2) before tokens/s (1)
    mid = "\n".join(_render(52, fit_table("t", cols, rows, width=52)))
    assert "1,485" in mid and "3.14" not in mid


def test_rows_must_match_columns() -> None:
    import pytest

    with pytest.raises(ValueError):
        fit_table(None, [Col("a")], [["1", "2"]])
