"""MkDocs build hooks for the moefleet docs site (``mkdocs.yml`` names this file).

Three jobs, so that the site never needs a second copy of something that lives elsewhere:

- the benchmark figures stay in ``benchmarks/results/`` (the scripts write them there);
  every ``*.png`` there is added to the site as ``results/img/<name>`` so the results
  pages can show them and ``mkdocs build --strict`` checks the links;
- ``docs/architecture.md`` is written alongside the code by the lead engineer; while it is
  missing, a short stand-in page is generated under the same name so the nav entry and
  the links to it stay valid (once the file exists it is used as it is);
- ``reference/cli.md`` gets the CLI reference generated from the typer app
  (:func:`moefleet.cli.docs.cli_markdown`) where it says ``<!-- moefleet-cli -->``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CLI_MARKER = "<!-- moefleet-cli -->"

ARCHITECTURE_STUB = """# Architecture

!!! note "Being written"
    The architecture page (`docs/architecture.md`) is being written alongside the
    composition root. Until it lands, the design is summarised in
    [The three seams](concepts/seams.md) and [Fidelity levels](concepts/fidelity.md),
    and the source layout in [Contributing](contributing.md#layout).
"""


def on_files(files: Files, config: Any, **kwargs: Any) -> Files:
    """Add the benchmark figures and, if needed, the architecture stand-in page."""
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"results/img/{png.name}", abs_src_path=str(png)))
    if files.get_file_from_path("architecture.md") is None:
        files.append(File.generated(config, "architecture.md", content=ARCHITECTURE_STUB))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, **kwargs: Any) -> str:
    """Generate the CLI reference from this checkout's code."""
    if CLI_MARKER not in markdown:
        return markdown
    src = str(ROOT / "src")
    if src not in sys.path:
        sys.path.insert(0, src)  # document this checkout, not another installed copy
    from moefleet.cli.docs import cli_markdown

    return markdown.replace(CLI_MARKER, cli_markdown())
