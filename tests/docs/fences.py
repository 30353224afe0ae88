"""Fenced code blocks of the docs pages, and how the docs tests run them.

Why not mktestdocs or pytest-examples: mktestdocs runs every bash block in its own
subshell with no time limit, and pytest-examples only runs Python. The quickstart needs
one working directory across blocks, a background server on a free port stopped by its
pid, a bound on each block's time, and the tiny random Mixtral standing in for
``tiny-moe-lm`` (whose build trains for ~13 minutes); so reading the fences is ours (a
few lines, below) and running them is in the tests.

A block runs when its info string is exactly ``bash`` (shell pages) or ``python`` (guide
pages). A block that must not run says so in its title, visible on the site:
```` ```bash title="not run: needs AWS credentials" ````. Any other fence in a tested
page must be output (``text``, ``json``, ``yaml``, ``markdown``): nothing is skipped
silently.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
NOT_RUN = "not run:"
OUTPUT_LANGS = {"text", "json", "yaml", "markdown", "console"}
# The model the docs use, and what the tests run instead (seconds to build, same family).
DOCS_MODEL, TEST_MODEL = "tiny-moe-lm", "tiny-mixtral-random"
# The port the docs use for `moefleet serve`; the tests substitute a free one.
DOCS_PORT = "8000"

_FENCE = re.compile(r"^(?P<indent> *)(?P<ticks>`{3,})(?P<info>.*)$")
_TITLE = re.compile(r'title="(?P<title>[^"]*)"')


@dataclass(frozen=True)
class Block:
    """One fenced block: its page, first line (1-based), language, title and code."""

    page: str
    line: int
    lang: str
    title: str
    code: str

    @property
    def not_run(self) -> bool:
        return self.title.startswith(NOT_RUN)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    """Every top-level fenced block of ``docs/<page>`` in order (nested fences, as in a
    ````markdown example, belong to their outer block)."""
    out: list[Block] = []
    lines = (DOCS / page).read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        ticks, info = m["ticks"], m["info"].strip()
        lang = info.split()[0] if info else ""
        title = _TITLE.search(info)
        body: list[str] = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != ticks:
            body.append(lines[j][len(m["indent"]):])
            j += 1
        out.append(Block(page, i + 1, lang, title["title"] if title else "", "\n".join(body)))
        i = j + 1
    return out


def runnable(page: str, lang: str) -> list[Block]:
    """The blocks of ``page`` in ``lang`` that the tests execute."""
    return [b for b in blocks(page) if b.lang == lang and not b.not_run]


def for_tests(code: str, port: int | None = None) -> str:
    """The block as the tests run it: the tiny random model, and a free port."""
    code = code.replace(DOCS_MODEL, TEST_MODEL)
    if port is not None:
        code = code.replace(f":{DOCS_PORT}", f":{port}").replace(
            f"--port {DOCS_PORT}", f"--port {port}")
    return code
