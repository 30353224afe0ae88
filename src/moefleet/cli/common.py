"""Shared CLI plumbing: one console, JSON output, and error reporting.

Conventions every command follows:
- ``--json`` prints a machine-readable result on stdout and nothing else there; rich
  output (tables, progress) goes to stderr in that mode.
- ``-o/--out`` names output files; writes are atomic.
- ``--seed`` wherever randomness enters.
- A :class:`~moefleet.errors.MoefleetError` becomes ``error: ...`` / ``hint: ...`` on
  stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from moefleet.errors import MoefleetError

console = Console(stderr=False)
err_console = Console(stderr=True)


def out_console(json_mode: bool) -> Console:
    """Where human-readable output goes: stderr when stdout carries JSON."""
    return err_console if json_mode else console


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def fail(err: MoefleetError) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {err.message}", highlight=False, soft_wrap=True)
    if err.hint:
        err_console.print(f"[bold yellow]hint:[/] {err.hint}", highlight=False, soft_wrap=True)
    return typer.Exit(code=err.exit_code)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn MoefleetError into a clean exit; let real bugs raise with a traceback."""
    try:
        yield
    except MoefleetError as err:
        raise fail(err) from None


def progress(transient: bool = True) -> Progress:
    """A progress bar on stderr (stdout stays clean for --json)."""
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err_console,
        transient=transient,
    )
