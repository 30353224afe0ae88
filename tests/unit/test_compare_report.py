"""``moefleet report DIR``: the HTML table matches results.json row for row, the file is
self-contained, and (where a headless Chromium exists) it opens with no console error."""

from __future__ import annotations

import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moefleet.cli import app
from moefleet.compare.html import COLUMNS, cell_text

runner = CliRunner()


class _Rows(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[dict[str, str], list[str]]] = []
        self._cell: list[str] | None = None
        self._in_body = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "tbody":
            self._in_body = True
        elif tag == "tr" and self._in_body:
            self.rows.append(({k: v or "" for k, v in attrs}, []))
        elif tag == "td" and self._in_body:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "tbody":
            self._in_body = False
        elif tag == "td" and self._cell is not None:
            self.rows[-1][1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cmp") / "run"
    res = runner.invoke(app, ["compare", "--model", "tiny-moe-lm", "--traffic",
                              "poisson:rate=0.5", "--duration", "30", "--quick",
                              "--platform", "alibaba-fc-gpu,aws-lambda", "-o", str(out)],
                        catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return out


def test_report_table_rows_equal_the_json(folder: Path) -> None:
    res = runner.invoke(app, ["report", str(folder)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    page = (folder / "report.html").read_text()
    data = json.loads((folder / "results.json").read_text())
    parsed = _Rows()
    parsed.feed(page)
    assert len(parsed.rows) == len(data["rows"]) >= 39  # two platforms, one server
    for (attrs, cells), row in zip(parsed.rows, data["rows"], strict=True):
        assert attrs["data-policy"] == row["policy"]
        assert attrs["data-platform"] == row["platform"]
        assert cells == [cell_text(row, k) for k, _ in COLUMNS]
    # self-contained: plots inline, nothing fetched
    assert page.count("data:image/") == 2
    assert "http://" not in page and "https://" not in page
    assert data["recommendation"] in page.replace("&#x27;", "'")


def test_report_bad_folder(tmp_path: Path) -> None:
    res = runner.invoke(app, ["report", str(tmp_path)])
    assert res.exit_code != 0 and "has no results.json" in res.output
    (tmp_path / "results.json").write_text("{}")
    res = runner.invoke(app, ["report", str(tmp_path)])
    assert res.exit_code != 0 and "is not a compare results file" in res.output


@pytest.mark.skipif(shutil.which("chromium") is None, reason="no headless chromium here")
def test_report_opens_in_chromium_without_console_errors(folder: Path) -> None:
    runner.invoke(app, ["report", str(folder)], catch_exceptions=False)
    shot = folder / "shot.png"
    proc = subprocess.run(
        ["chromium", "--headless=new", "--no-sandbox", "--disable-gpu",
         "--enable-logging=stderr", "--v=0", "--window-size=1280,1600",
         f"--screenshot={shot}", (folder / "report.html").as_uri()],
        capture_output=True, text=True, timeout=120, check=False)
    console = [ln for ln in proc.stderr.splitlines() if ":CONSOLE" in ln]
    assert not console, console
    assert shot.stat().st_size > 10_000
