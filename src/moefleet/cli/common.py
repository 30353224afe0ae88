"""Shared CLI plumbing: one console, JSON output, and error reporting.

Conventions every command follows:
- ``--json`` prints a machine-readable result on stdout and nothing else there; rich
  output (tables, progress) goes to stderr in that mode.
- ``-o/--out`` names output files; writes are atomic and go to regular files only.
  Where a command's ``-o`` is data it prints (a plan, manifests, results JSON), ``-o -``
  prints it on stdout and the human-readable output goes to stderr; elsewhere ``-`` is
  refused.
- ``--seed`` wherever randomness enters.
- A :class:`~moefleet.errors.MoefleetError` becomes ``error: ...`` / ``hint: ...`` on
  stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
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
from rich.text import Text

from moefleet.errors import MoefleetError, validation_message
from moefleet.io import check_output_paths, dumps_json, is_stdout, write_text_atomic

console = Console(stderr=False)
err_console = Console(stderr=True)


def out_console(json_mode: bool) -> Console:
    """Where human-readable output goes: stderr when stdout carries JSON."""
    return err_console if json_mode else console


def emit_json(obj: Any) -> None:
    """Strict RFC 8259 JSON on stdout: NaN and infinities are printed as ``null``."""
    sys.stdout.write(dumps_json(obj) + "\n")
    sys.stdout.flush()


def fail(err: MoefleetError) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {err.message}", highlight=False, soft_wrap=True)
    if err.hint:
        err_console.print(f"[bold yellow]hint:[/] {err.hint}", highlight=False, soft_wrap=True)
    return typer.Exit(code=err.exit_code)


def boundary_error(err: BaseException) -> MoefleetError | None:
    """The user-facing form of an exception that crossed the CLI boundary, or None.

    Besides :class:`MoefleetError`, a few exception classes can only come from the user's
    inputs or environment when they reach a command's top level: a pydantic
    ``ValidationError`` (an option value a library model rejects), an ``OSError`` naming a
    file, ``MemoryError`` and ``UnicodeDecodeError``. Those get one line naming the
    problem; anything else is a bug and keeps its traceback."""
    from pydantic import ValidationError

    if isinstance(err, MoefleetError):
        return err
    if isinstance(err, ValidationError):
        return MoefleetError(validation_message(err, err.title),
                             "check the option that sets this field (see --help)")
    if isinstance(err, OSError) and err.filename is not None:
        return MoefleetError(f"{err.filename}: {err.strerror or err}",
                             "check the path and its permissions")
    if isinstance(err, MemoryError):
        return MoefleetError("out of memory: an input or option asks for more than fits",
                             "use smaller values (see README, 'Limits')")
    if isinstance(err, EOFError):
        return MoefleetError("an input file ended early (truncated or empty?)",
                             "re-create the file")
    if isinstance(err, UnicodeDecodeError):
        return MoefleetError(f"an input file is not UTF-8 text ({err.reason})",
                             "pass a text file")
    return None


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn user-caused errors (see :func:`boundary_error`) into a clean exit; let real
    bugs raise with a traceback."""
    try:
        yield
    except (MoefleetError, OSError, MemoryError, ValueError, EOFError) as err:
        clean = boundary_error(err)
        if clean is None:
            raise
        raise fail(clean) from None


def check_outputs(*targets: tuple[str, Path | str | None], stdout: tuple[str, ...] = (),
                  json_mode: bool = False) -> None:
    """Validate every output path before a command starts work (raises MoefleetError).
    The options named in ``stdout`` may be ``-``; with ``json_mode`` (``--json`` also
    prints on stdout) they may not."""
    if json_mode:
        for what, t in targets:
            if what in stdout and is_stdout(t):
                raise MoefleetError(f"{what} - and --json would both print on stdout",
                                    f"drop --json, or write {what} to a file")
    check_output_paths(*targets, stdout=stdout)


def write_data(out: Path | str, text: str) -> None:
    """``text`` on stdout for ``-``, else atomically into the file ``out``."""
    if is_stdout(out):
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        write_text_atomic(out, text)


class PlainProgress(Progress):
    """Progress for a non-terminal stderr (a log file, CI, a pipe): no live bar, but a
    plain ``description: done/total (elapsed)`` line when the description changes and at
    most every ``every_s`` seconds otherwise, so a long build is never silent."""

    def __init__(self, *columns: Any, every_s: float = 10.0, **kw: Any) -> None:
        kw["disable"] = True
        super().__init__(*columns, **kw)
        self._every_s = every_s
        self._last: dict[Any, tuple[float, str]] = {}
        self._done: set[Any] = set()

    def _say(self, task_id: Any, force: bool = False) -> None:
        task = self._tasks.get(task_id)
        if task is None:
            return
        now = time.monotonic()
        last_t, last_desc = self._last.get(task_id, (-1e18, ""))
        done = task.total is not None and task.completed >= task.total
        if done:  # the last line always says the work finished, even a short one
            if task_id in self._done:
                return
            self._done.add(task_id)
        elif not force and task.description == last_desc and now - last_t < self._every_s:
            return
        self._last[task_id] = (now, task.description)
        total = f"/{task.total:g}" if task.total is not None else ""
        elapsed = task.elapsed or 0.0
        plain = Text.from_markup(task.description).plain
        sys.stderr.write(f"{plain}: {task.completed:g}{total} ({elapsed:.0f} s)\n")
        sys.stderr.flush()

    def add_task(self, *args: Any, **kw: Any) -> Any:
        task_id = super().add_task(*args, **kw)
        self._say(task_id, force=True)
        return task_id

    def update(self, task_id: Any, *args: Any, **kw: Any) -> None:
        super().update(task_id, *args, **kw)
        self._say(task_id)

    def advance(self, task_id: Any, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._say(task_id)


def progress(transient: bool = True) -> Progress:
    """A progress bar on stderr (stdout stays clean for --json); plain lines when stderr
    is not a terminal."""
    columns = (
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    if not err_console.is_terminal:
        return PlainProgress(*columns, console=err_console, transient=transient)
    return Progress(*columns, console=err_console, transient=transient)
