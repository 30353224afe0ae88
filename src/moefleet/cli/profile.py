"""``moefleet profile``: record a routing trace."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from moefleet import limits as L
from moefleet.cli.common import check_outputs, emit_json, out_console, progress, user_errors
from moefleet.errors import MoefleetError

DEFAULT_MODEL = "minilm-moe-e8"


def run_profile(
    model: str,
    dataset: str,
    max_tokens: int,
    max_length: int,
    batch_size: int,
    attention_ids: bool,
    json_mode: bool,
    dtype: str | None = None,
):  # -> Trace
    from moefleet.cli.models import load_with_progress
    from moefleet.data import load_prompts, split_dataset
    from moefleet.traces import profile

    if max_tokens <= 0:
        raise MoefleetError(
            f"--max-tokens must be positive, got {max_tokens}", "pass e.g. --max-tokens 2048"
        )
    name, split = split_dataset(dataset)
    prompts = load_prompts(name, split=split)
    adapter = load_with_progress(model, json_mode, dtype)
    with progress() as bar:
        task = bar.add_task(f"profiling {adapter.name} on {dataset}", total=max_tokens)

        def on_progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        return profile(
            adapter,
            [p.request_id for p in prompts],
            [p.text for p in prompts],
            max_tokens=max_tokens,
            max_length=max_length,
            batch_size=batch_size,
            attention_ids=attention_ids,
            dataset=dataset,
            progress=on_progress,
        )


def profile_cmd(
    model: Annotated[str, typer.Option("--model", "-m", help="Zoo name, dir or hub id.")] = (
        DEFAULT_MODEL
    ),
    dataset: Annotated[
        str, typer.Option("--dataset", "-d", help="Dataset name[:split] or a .txt/.jsonl/.json.")
    ] = "wikitext2",
    max_tokens: Annotated[int, typer.Option(
        max=L.MAX_TOKENS, help="Tokens to record.")] = 2048,
    max_length: Annotated[int, typer.Option(
        min=1, max=L.MAX_PROMPT_TOKENS, help="Truncate each prompt to this.")] = 256,
    batch_size: Annotated[int, typer.Option(min=1, max=4096, help="Prompts per forward pass.")] = 8,
    attention_ids: Annotated[
        bool, typer.Option(help="Record attention ids (needs eager attention).")
    ] = True,
    out: Annotated[Path, typer.Option("--out", "-o", help="Parquet trace to write.")] = Path(
        "trace.parquet"
    ),
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable summary.")] = False,
    dtype: Annotated[str, typer.Option(
        help="auto (the checkpoint's on a GPU, the faster measured one on the CPU), "
             "bfloat16, float16 or float32")] = "float32",
) -> None:
    """Record which experts every token goes to (Parquet trace) and summarise it.

    Example: moefleet profile --model minilm-moe-e8 --dataset wikitext2:train
    --max-tokens 4096 --out trace.parquet
    """
    from moefleet.report.routing import routing_summary, routing_table
    from moefleet.traces import write_trace

    with user_errors():
        check_outputs(("--out", out))
        from moefleet.models.dtypes import check_dtype_name

        check_dtype_name(dtype)  # before the model loads
        trace = run_profile(
            model, dataset, max_tokens, max_length, batch_size, attention_ids, as_json, dtype
        )
        write_trace(trace, out)
    summary: dict[str, Any] = routing_summary(trace)
    summary["out"] = str(out)
    if as_json:
        emit_json(summary)
        return
    con = out_console(False)
    con.print(routing_table(summary))
    con.print(f"wrote {trace.table.num_rows} rows to {out}")
