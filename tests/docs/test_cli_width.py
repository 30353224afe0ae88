"""Result tables fit an 80-column terminal and never cut a number; every command that
prints results has --json. The table-printing commands run for real (tiny random Mixtral,
seconds each) with COLUMNS=80, as rich reads it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer.main

from tests.docs.block_runner import ROOT, run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
M = "tiny-mixtral-random"
# In order: later commands read what earlier ones wrote (trace, plan).
COMMANDS = [
    ["models", "build", M],
    ["platforms", "list"],
    ["platforms", "show", "aws-lambda"],
    ["models", "list"],
    ["models", "info", M],
    ["profile", "--model", M, "--dataset", "wikitext2:train", "--max-tokens", "1024",
     "-o", "trace.parquet"],
    ["traces", "show", "trace.parquet"],
    ["plan", "--model", M, "--platform", "aws-lambda", "--slo", "2", "--counts",
     "trace.parquet", "-o", "plan.yaml"],
    ["plan", "show", "plan.yaml"],
    ["run", "--plan", "plan.yaml", "--dataset", "wikitext2", "--tokens", "64"],
    ["simulate", "--model", M, "--memory", "1769", "--workload", "poisson:rate=2",
     "--duration", "20"],
    ["predict", "eval", "--model", M, "--train", "wikitext2:train", "--test",
     "wikitext2:test", "--max-tokens", "2048", "--test-tokens", "1024", "--predictors",
     "bayes,lina,dop"],
    ["demo", "--model", M, "--quick", "--no-run", "-o", "demo"],
    ["compare", "--model", M, "--traffic", "poisson:rate=1", "--duration", "60", "--quick",
     "--platform", "alibaba-fc-gpu", "-o", "cmp"],
    ["report", "cmp"],
    # Remoe's planner on the DeepSeek-V2-Lite shape (no weights) with the shipped timing.
    ["plan", "--policy", "remoe", "--model", "deepseek-v2-lite", "--platform",
     "alibaba-fc-gpu", "--ttft", "30", "--tpot", "1", "--activation", "uniform.npy",
     "--timing", str(ROOT / "benchmarks" / "results" / "remoe_timing.json"), "-o",
     "remoe.yaml"],
]
# A digit, $ or % right before an ellipsis, or an ellipsis ending a cell: a cut value.
CUT = re.compile(r"[\d.,$%]…|…\s*[│┃]")
# Long-running or file-only commands: a server and manifest writers print no results.
NO_JSON = {"moefleet serve", "moefleet export"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import numpy as np

    d = tmp_path_factory.mktemp("cli80")
    np.save(d / "uniform.npy", np.full((26, 64), 1 / 64))  # DeepSeek-V2-Lite: 26 x 64
    return d


@pytest.mark.parametrize("args", COMMANDS, ids=[" ".join(a[:3]) for a in COMMANDS])
def test_tables_fit_80_columns(args: list[str], workdir: Path) -> None:
    res = run(["moefleet", *args], workdir)  # runner's env sets COLUMNS=80
    assert res.returncode == 0, res.stdout[-3000:]
    lines = res.stdout.splitlines()
    # stdout and stderr share the pipe; library warnings are not ours to wrap.
    ours = [ln for ln in lines if "Warning:" not in ln and "warnings.warn" not in ln]
    assert not [ln for ln in ours if len(ln) > 80], "\n".join(ours)
    assert not [ln for ln in ours if CUT.search(ln)], "\n".join(ours)


def _leaves(cmd, prefix: str):
    subs = getattr(cmd, "commands", None) or {}
    if cmd.callback is not None or not subs:
        yield prefix, cmd
    for name, sub in subs.items():
        yield from _leaves(sub, f"{prefix} {name}")


def test_every_result_command_has_json() -> None:
    from moefleet.cli import app

    missing = [name for name, cmd in _leaves(typer.main.get_command(app), "moefleet")
               if name not in NO_JSON
               and "--json" not in [o for p in cmd.params for o in getattr(p, "opts", [])]]
    assert not missing, f"commands without --json: {missing}"
