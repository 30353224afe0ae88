"""The CLI reference page, generated from the ``moefleet`` typer app.

``docs/hooks.py`` puts :func:`cli_markdown` into ``docs/reference/cli.md`` at build time,
so the reference is made from the same object the console script runs and never drifts
from the code. The generator is typer's own (``typer.cli.get_docs_for_click``, the code
behind ``typer MODULE utils docs``): mkdocs-click, tried first, reads options with
``isinstance(param, click.Option)`` and so renders none of them for typer 0.29, whose
commands are built on the click it vendors (``typer._click``); mkdocs-typer2 runs the
same typer generator in a subprocess and renders nothing, silently, when it fails.
"""

from __future__ import annotations

import re

import typer
import typer.main
from typer.cli import get_docs_for_click

from moefleet.cli import app


def cli_markdown(heading_offset: int = 1) -> str:
    """Markdown for every command and option; headings pushed down ``heading_offset``
    levels so the page keeps its own title. Raises if typer cannot document a command
    (the strict docs build then fails rather than printing an empty page)."""
    command = typer.main.get_command(app)
    ctx = typer.Context(command, info_name="moefleet")
    text = get_docs_for_click(obj=command, ctx=ctx, name="moefleet")
    if "**Options**" not in text:
        raise RuntimeError("typer produced no options for the moefleet CLI")
    return re.sub(r"^(#+) ", lambda m: "#" * (len(m[1]) + heading_offset) + " ", text,
                  flags=re.MULTILINE)
