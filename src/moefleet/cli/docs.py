"""The click command behind the ``moefleet`` typer app, for the generated CLI reference.

``mkdocs-click`` (docs/reference/cli.md) documents a :class:`click.Command`; typer builds
one from the app with :func:`typer.main.get_command`, so the reference is generated from
the same object the console script runs and never drifts from the code. mkdocs-click was
chosen over mkdocs-typer because it needs only click (which typer already depends on) and
renders nested groups (``plan bo``, ``models build``) with their options as tables.
"""

from __future__ import annotations

import click
import typer.main

from moefleet.cli import app

cli: click.Command = typer.main.get_command(app)
