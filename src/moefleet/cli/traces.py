"""``moefleet traces show``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moefleet.cli.common import check_outputs, emit_json, out_console, user_errors

app = typer.Typer(help="Inspect routing traces.", no_args_is_help=True)


@app.command("show")
def show_cmd(
    trace: Annotated[Path, typer.Argument(help="A trace written by `moefleet profile`.")],
    png: Annotated[
        Path | None, typer.Option("--png", help="Also write a heatmap PNG here.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable summary.")] = False,
) -> None:
    """Per-layer expert popularity of a trace (terminal table, optional PNG).

    Example: moefleet traces show trace.parquet --png popularity.png
    """
    from moefleet.report.routing import routing_png, routing_summary, routing_table
    from moefleet.traces import read_trace

    with user_errors():
        check_outputs(("--png", png))
        summary = routing_summary(read_trace(trace))
        if png is not None:
            routing_png(summary, png)
    if as_json:
        emit_json(summary)
        return
    con = out_console(False)
    con.print(routing_table(summary))
    if png is not None:
        con.print(f"wrote {png}")
