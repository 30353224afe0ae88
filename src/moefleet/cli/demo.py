"""``moefleet demo``: the main job on the embedded default.

Today: build the default model (cached), profile it on wikitext2 and print the routing
summary. Later stages (plan, deploy, serve, bill) extend this command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moefleet.cli.common import emit_json, out_console, user_errors


def demo_cmd(
    model: Annotated[str, typer.Option("--model", "-m")] = "",
    quick: Annotated[bool, typer.Option(help="Fewer tokens, for a ~1-minute run.")] = False,
    out_dir: Annotated[Path, typer.Option("--out", "-o", help="Where results go.")] = Path(
        "out/demo"
    ),
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Profile the default MoE model and show how its routers use the experts.

    Example: moefleet demo --quick
    """
    from moefleet.cli.profile import DEFAULT_MODEL, run_profile
    from moefleet.models import zoo
    from moefleet.report.routing import routing_png, routing_summary, routing_table
    from moefleet.traces import write_trace

    chosen = model or (DEFAULT_MODEL if zoo.has_entry(DEFAULT_MODEL) else "tiny-mixtral-random")
    tokens = 1024 if quick else 8192
    con = out_console(as_json)
    with user_errors():
        con.print(f"[bold]moefleet demo[/]: model {chosen}, {tokens} tokens of wikitext2")
        trace = run_profile(chosen, "wikitext2", tokens, 256, 8, True, as_json)
        trace_path = write_trace(trace, out_dir / "trace.parquet")
        summary = routing_summary(trace)
        png = routing_png(summary, out_dir / "popularity.png")
    if as_json:
        emit_json({**summary, "trace": str(trace_path), "png": str(png)})
        return
    con.print(routing_table(summary))
    con.print(f"trace: {trace_path}\nheatmap: {png}")
