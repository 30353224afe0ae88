"""Every code block of the tested pages either runs in a docs test or says why not."""

from __future__ import annotations

import pytest

from tests.docs.fences import NOT_RUN, OUTPUT_LANGS, blocks

SHELL_PAGES = ["getting-started.md", "quickstart.md"]
GUIDE_PAGES = ["guide/odsbo.md", "guide/remoe.md", "guide/smoe.md", "guide/brownout.md",
               "guide/engine.md", "guide/simulation.md", "guide/compare.md"]


@pytest.mark.parametrize("page", SHELL_PAGES)
def test_shell_pages_have_only_run_or_marked_blocks(page: str) -> None:
    bad = [b.id for b in blocks(page)
           if not (b.lang == "bash" or b.not_run or b.lang in OUTPUT_LANGS)]
    assert not bad, (f"blocks that would be skipped silently (use ```bash or a "
                     f"'{NOT_RUN}' title): {bad}")
    assert any(b.lang == "bash" and not b.not_run for b in blocks(page))


@pytest.mark.parametrize("page", GUIDE_PAGES)
def test_guide_python_blocks_are_run_or_marked(page: str) -> None:
    # A guide's shell blocks are documentation of long jobs; its Python blocks all run.
    bad = [b.id for b in blocks(page) if b.lang not in ("python", "bash", *OUTPUT_LANGS)
           and not b.not_run]
    assert not bad, f"unknown fence languages: {bad}"


def test_not_run_titles_give_a_reason() -> None:
    for page in SHELL_PAGES + GUIDE_PAGES:
        for b in blocks(page):
            if b.not_run:
                assert len(b.title) > len(NOT_RUN) + 3, f"{b.id}: say why it does not run"


def test_fence_reader_reads_titles_and_nesting(tmp_path, monkeypatch) -> None:
    import tests.docs.fences as fences

    (tmp_path / "p.md").write_text(
        'x\n```bash\necho 1\n```\n````markdown\n```bash title="not run: y"\nz\n```\n````\n'
        '```python title="not run: needs AWS"\nimport boto3\n```\n')
    monkeypatch.setattr(fences, "DOCS", tmp_path)
    got = fences.blocks("p.md")
    assert [(b.lang, b.line, b.not_run) for b in got] == [
        ("bash", 2, False), ("markdown", 5, False), ("python", 10, True)]
    assert got[0].code == "echo 1" and "not run: y" in got[1].code
