"""The shell blocks of Getting started and the Quickstart run, in order, as a reader
would type them (one working directory per page), with the tiny random Mixtral in place
of tiny-moe-lm and a free port in place of 8000."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.docs.block_runner import free_port, run
from tests.docs.fences import for_tests, runnable

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
PAGES = ["getting-started.md", "quickstart.md"]
CASES = [b for page in PAGES for b in runnable(page, "bash")]


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {page: tmp_path_factory.mktemp(page.replace(".md", "")) for page in PAGES}


@pytest.mark.parametrize("block", CASES, ids=[b.id for b in CASES])
def test_shell_block_runs(block, workdirs) -> None:
    code = for_tests(block.code, port=free_port())
    res = run(["bash", "-euo", "pipefail", "-c", code], workdirs[block.page])
    assert res.returncode == 0, (f"{block.id} failed (exit {res.returncode}):\n{code}\n"
                                 f"---\n{res.stdout[-4000:]}")
    if "/v1/completions" in code:  # the served model answered, in OpenAI's shape
        assert '"choices"' in res.stdout and '"billed_cost"' in res.stdout, res.stdout[-2000:]
        assert "moefleet:generation_tokens_total" in res.stdout


def test_substitution_keeps_the_commands() -> None:
    code = for_tests("moefleet serve --model tiny-moe-lm --port 8000 &\n"
                     "curl http://127.0.0.1:8000/health", port=1234)
    assert code == ("moefleet serve --model tiny-mixtral-random --port 1234 &\n"
                    "curl http://127.0.0.1:1234/health")
    assert subprocess.run(["bash", "-n", "-c", code]).returncode == 0
