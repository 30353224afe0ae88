"""``moefleet report DIR``: one self-contained HTML file from ``compare -o DIR``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moefleet.cli.common import emit_json, out_console, user_errors


def report_cmd(
    folder: Annotated[Path, typer.Argument(help="The -o folder of a compare run.")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="HTML file (default: "
                                             "FOLDER/report.html).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report's path as "
                                          "JSON.")] = False,
) -> None:
    """Write one HTML file: the sortable table, the plots inline, the inputs and the
    command to reproduce every row.

    Example: moefleet compare ... -o out/ && moefleet report out/
    """
    from moefleet.compare.html import write_report

    with user_errors():
        path = write_report(folder, out)
    if as_json:
        emit_json({"report": str(path)})
        return
    out_console(False).print(f"wrote {path}")
