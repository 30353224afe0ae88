"""Every Python block of the user guide runs (the blocks of one page in one process, in
order, in a temporary directory), with the tiny random Mixtral in place of tiny-moe-lm."""

from __future__ import annotations

import pytest

from tests.docs.block_runner import run
from tests.docs.fences import for_tests, runnable
from tests.docs.test_docs_fences import GUIDE_PAGES

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
PAGES = [p for p in GUIDE_PAGES if runnable(p, "python")]


def test_some_guide_pages_have_python() -> None:
    assert "guide/engine.md" in PAGES and "guide/odsbo.md" in PAGES


@pytest.mark.parametrize("page", PAGES)
def test_guide_python_blocks_run(page, tmp_path) -> None:
    import sys

    code = "\n\n".join(for_tests(b.code) for b in runnable(page, "python"))
    res = run([sys.executable, "-c", code], tmp_path)
    assert res.returncode == 0, f"{page} failed:\n{code}\n---\n{res.stdout[-4000:]}"
