"""``moefleet profile-compute``: measure a model's compute profile (time vs tokens, threads)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from moefleet import limits as L
from moefleet.cli.common import (
    check_outputs,
    emit_json,
    err_console,
    out_console,
    progress,
    user_errors,
)
from moefleet.errors import MoefleetError

DEFAULT_MODEL = "minilm-moe-e8"


def parse_int_list(text: str, option: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; anything else is an error naming the bad item."""
    out: list[int] = []
    for item in text.split(","):
        item = item.strip()
        try:
            out.append(int(item))
        except ValueError:
            raise MoefleetError(
                f"{option} item {item!r} (in {text!r}) is not an integer",
                f"pass comma-separated integers, e.g. {option} 1,2",
            ) from None
    return out


def _finite(x: float) -> float | None:
    # Strict JSON has no NaN; an undefined R² (one thread count) is reported as null.
    return x if math.isfinite(x) else None


def summarize(profile: Any, out: Path, png: Path | None) -> dict[str, Any]:
    """The --json result: fitted laws and fit quality per function, plus provenance."""

    def one(label: str, law: Any) -> dict[str, Any]:
        return {
            "function": label,
            "param_bytes": law.param_bytes,
            "overhead_s": law.batch.overhead_s,
            "per_token_s": law.batch.per_token_s,
            "theta": [law.threads.theta1, law.threads.theta2, law.threads.theta3],
            "speedup_at_2": 1.0 / law.threads.speed_factor(2.0),
            "batch_r2": _finite(law.batch_r2),
            "threads_r2": _finite(law.threads_r2),
        }

    rows = [one(f"expert L{k}", v) for k, v in sorted(profile.experts.items())]
    rows += [one(f"segment {i}", s) for i, s in enumerate(profile.segments)]
    return {
        "model": profile.model,
        "hidden_size": profile.hidden_size,
        "bytes_per_token": profile.bytes_per_token,
        "functions": rows,
        "settings": profile.raw.get("settings", {}),
        "wall_s": profile.raw.get("wall_s"),
        "load_avg": profile.raw.get("load_avg"),
        "notes": profile.raw.get("notes", []),
        "machine": profile.machine,
        "out": str(out),
        "png": str(png) if png else None,
    }


def _table(summary: dict[str, Any]) -> Table:
    from moefleet.report.tables import Col, fit_table, sig3

    cols = [Col("function", numeric=False), Col("params (MB)"), Col("overhead (µs)"),
            Col("per token (µs)"), Col("speed-up at 2 threads (×)", drop=1),
            Col("R² batch", drop=3), Col("R² threads", drop=2)]
    rows = [[r["function"], sig3(r["param_bytes"] / 1e6), sig3(r["overhead_s"] * 1e6),
             sig3(r["per_token_s"] * 1e6), sig3(r["speedup_at_2"]),
             sig3(r["batch_r2"], none="n/a"), sig3(r["threads_r2"], none="n/a")]
            for r in summary["functions"]]
    return fit_table(f"compute profile of {summary['model']} (1 thread unless noted)", cols,
                     rows)


def profile_compute_cmd(
    model: Annotated[str, typer.Option("--model", "-m", help="Zoo name, dir or hub id.")] = (
        DEFAULT_MODEL
    ),
    out: Annotated[Path, typer.Option("--out", "-o", help="Profile JSON to write.")] = Path(
        "compute_profile.json"
    ),
    png: Annotated[
        Path | None, typer.Option(help="Also plot time vs batch size and threads here.")
    ] = None,
    threads: Annotated[
        str | None, typer.Option(help="Thread counts, e.g. 1,2 (default 1..CPUs).")
    ] = None,
    batch_sizes: Annotated[
        str | None,
        typer.Option(help="Tokens per call, e.g. 1,16,256 (default 1,4,16,64,256,1024)."),
    ] = None,
    repeats: Annotated[
        int | None, typer.Option(help="Timed repeats per cell (default 3; 5 if --thorough).")
    ] = None,
    thorough: Annotated[
        bool, typer.Option(help="Full grid: batch sizes 1,2,4..1024 at every thread count, "
                           "5 repeats.")
    ] = False,
    experts_per_layer: Annotated[
        int, typer.Option(help="Experts timed (and pooled) per MoE layer.")
    ] = 2,
    seed: Annotated[int, typer.Option(
        min=0, max=L.MAX_SEED, help="Seed for inputs and the expert sample.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable summary.")] = False,
    dtype: Annotated[str, typer.Option(
        help="auto (the checkpoint's on a GPU, the faster measured one on the CPU), "
             "bfloat16, float16 or float32")] = "float32",
) -> None:
    """Measure a model's compute profile: time vs tokens and threads, fitted laws.

    Times every expert kind and segment on this CPU, fits t1(n) = a + b·n (one thread)
    and T(v) = θ1·exp(−θ2·v) + θ3 (per token vs threads), and writes the profile JSON.

    Example: moefleet profile-compute -m minilm-moe-e8 --threads 1,2 -o prof.json --png prof.png
    """
    from moefleet.cli.models import load_with_progress
    from moefleet.profiles import measure as m

    with user_errors():
        check_outputs(("--out", out), ("--png", png))
        thread_list = parse_int_list(threads, "--threads") if threads is not None else None
        sizes = (parse_int_list(batch_sizes, "--batch-sizes") if batch_sizes is not None
                 else list(m.THOROUGH_BATCH_SIZES if thorough else m.DEFAULT_BATCH_SIZES))
        reps = repeats if repeats is not None else (
            m.THOROUGH_REPEATS if thorough else m.DEFAULT_REPEATS)
        m.check_grid(thread_list, sizes, reps)  # fail before loading the model
        from moefleet.models.dtypes import check_dtype_name

        check_dtype_name(dtype)
        adapter = load_with_progress(model, as_json, dtype)
        with progress() as bar:
            task = bar.add_task(f"timing {adapter.name}", total=None)

            def on_progress(done: int, total: int, desc: str) -> None:
                bar.update(task, completed=done, total=total, description=desc)

            profile = m.measure_profile(
                adapter, threads=thread_list, batch_sizes=sizes, repeats=reps,
                progress=on_progress, seed=seed, experts_per_layer=experts_per_layer,
                full_thread_grid=thorough,
            )
        profile.save(out)
        if png is not None:
            from moefleet.profiles.plot import plot_profile

            plot_profile(profile, png)
    summary = summarize(profile, out, png)
    if as_json:
        emit_json(summary)
        return
    con = out_console(False)
    con.print(_table(summary))
    for note in summary["notes"]:
        err_console.print(f"[bold yellow]warning:[/] {note}", highlight=False)
    con.print(f"measured in {summary['wall_s']} s (load average {summary['load_avg']}); "
              f"wrote {out}" + (f" and {png}" if png else ""))
