"""Every malformed model directory of ``model_dirs.CASES`` is refused with one ``error:``
line, a non-zero exit and no traceback, by every command that loads a model, quickly.

Each case runs through the real CLI (typer's runner, in process) with one of the model-
loading commands (rotated over the cases, so each command sees many); a subset runs as a
subprocess to prove nothing reaches stderr but the error and its hint."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moefleet.cli import app
from tests.reliability.model_dirs import CASES, LOADING, seed_model

runner = CliRunner()
COMMANDS = ["info", "generate", "profile", "profile-compute", "serve", "distill"]
#: Seconds a refusal may take (a case that loads weights included); a hang fails sooner
#: than pytest's own timeout.
BOUND_S = 30.0


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return seed_model(tmp_path_factory.mktemp("seed") / "tiny-mixtral")


def args_for(command: str, model: Path, work: Path) -> list[str]:
    (work / "prompts.txt").write_text("hello world\nthe cat sat\n")
    return {
        "info": ["models", "info", str(model)],
        "generate": ["generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "2"],
        "profile": ["profile", "--model", str(model), "--dataset", str(work / "prompts.txt"),
                    "--max-tokens", "8", "--out", str(work / "t.parquet")],
        "profile-compute": ["profile-compute", "--model", str(model), "--out",
                            str(work / "c.json"), "--threads", "1", "--batch-sizes", "1",
                            "--repeats", "1"],
        "serve": ["serve", "--model", str(model), "--port", "0"],
        "distill": ["brownout", "distill", "--model", str(model), "--ways", "2",
                    "--calib-tokens", "64", "--max-epochs", "1"],
    }[command]


def broken_copy(seed: Path, case: str, tmp: Path) -> Path:
    model = tmp / "model"
    shutil.copytree(seed, model)
    CASES[case](model)
    return model


def assert_one_line_error(code: int, output: str) -> None:
    assert code != 0, output
    assert "Traceback" not in output, output
    errors = [ln for ln in output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, output
    assert len(errors[0]) < 400, errors[0]


def test_corpus_size() -> None:
    assert len(CASES) >= 60


def test_the_seed_checkpoint_loads(seed: Path) -> None:
    res = runner.invoke(app, ["models", "info", str(seed), "--json"])
    assert res.exit_code == 0, res.output


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_model_dir_is_refused(case: str, seed: Path, tmp_path: Path) -> None:
    model = broken_copy(seed, case, tmp_path)
    index = sorted(CASES).index(case)
    # Cases that need the weights loaded run on the quick commands only.
    command = ("info", "generate")[index % 2] if case in LOADING \
        else COMMANDS[index % len(COMMANDS)]
    old = Path.cwd()
    os.chdir(tmp_path)
    try:
        t0 = time.monotonic()
        res = runner.invoke(app, args_for(command, model, tmp_path))
        took = time.monotonic() - t0
    finally:
        os.chdir(old)
    assert_one_line_error(res.exit_code, res.output)
    assert took < BOUND_S, f"{case} via {command} took {took:.1f} s"
    assert not (tmp_path / "t.parquet").exists() and not (tmp_path / "c.json").exists()


SUBPROCESS = ["config-list", "memory-layers", "weights-half"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", SUBPROCESS)
def test_refusal_in_a_subprocess_has_no_traceback(case: str, seed: Path,
                                                 tmp_path: Path) -> None:
    model = broken_copy(seed, case, tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "moefleet", "generate", "--model", str(model),
                           "--prompt", "hi", "--max-tokens", "2"], capture_output=True,
                          text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines[0].startswith("error:") and all(
        ln.startswith(("error:", "hint:")) for ln in lines), proc.stderr
    assert proc.stdout == ""
