"""``moefleet deploy`` / ``moefleet run`` end to end (in-process, local backend)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moefleet.cli import app

pytestmark = pytest.mark.timeout(240)
runner = CliRunner()
MODEL = "tiny-mixtral-random"


def run(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def _yaml(method: str, experts: int = 8, replicas: int = 1) -> str:
    """A hand-written plan (flow style), as a user would type it."""
    layer = ", ".join([f"{{memory_mb: 256, replicas: {replicas}}}"] * experts)
    layers = "\n".join(f"  - {{layer: {i}, method: {method}, beta: 4, experts: [{layer}]}}"
                       for i in range(3))
    return (f"model: {MODEL}\nplatform: aws-lambda\nsegment_memory_mb: [512, 512, 512]\n"
            f"layers:\n{layers}\n")


RUN_ARGS = ["--tokens", "24", "--batch-size", "4", "--max-length", "8", "--workers", "2"]


def test_run_plan_deploys_runs_and_reports(tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(_yaml("pipelined"))
    out = tmp_path / "results.json"
    res = run("run", "--plan", str(plan), *RUN_ARGS, "--json", "-o", str(out))
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data == json.loads(out.read_text())
    assert data["tokens"] == 24 and data["max_abs_diff"] <= 1e-4
    assert data["cost_usd"]["total"] > 0 and data["throughput_tokens_per_s"] > 0
    assert [row["method"] for row in data["layers"]] == ["pipelined"] * 3
    assert all(row["moe_latency_s"] > 0 for row in data["layers"])
    functions = [f for f in data["bill"]["by_function"] if not f.startswith("<")]
    assert data["cold_starts"] >= len(functions) >= 3  # every function started cold once
    assert sum(data["by_request"].values()) == pytest.approx(data["cost_usd"]["total"])


def test_deploy_then_run_the_deployment(tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(_yaml(3))  # the paper's numeric code for 'direct'
    dep = tmp_path / "deployment.json"
    res = run("deploy", str(plan), "--store", str(tmp_path / "store"), "-o", str(dep), "--json")
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["functions"] == 3 + 24 and info["bytes_uploaded"] > 0
    assert (tmp_path / "store" / info["prefix"] / "model" / "seg-0.safetensors").is_file()
    res = run("run", "--deployment", str(dep), *RUN_ARGS)
    assert res.exit_code == 0, res.output
    assert "billed $" in res.stdout and "cold starts" in res.stdout
    assert "direct" in res.stdout


@pytest.mark.parametrize("args,needle", [
    (["run"], "exactly one of --deployment and --plan"),
    (["run", "--deployment", "nowhere.json"], "does not exist"),
    (["deploy", "nowhere.yaml"], "does not exist"),
    (["deploy", "PLAN", "--backend", "cloud9"], "unknown backend 'cloud9'"),
])
def test_bad_input_is_a_clear_error(tmp_path: Path, args: list[str], needle: str) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(_yaml("storage"))
    res = runner.invoke(app, [str(plan) if a == "PLAN" else a for a in args])
    assert res.exit_code == 2
    assert needle in res.output and "Traceback" not in res.output


def test_plan_that_does_not_fit_the_model(tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(_yaml("storage", experts=4))
    res = runner.invoke(app, ["deploy", str(plan), "--store", str(tmp_path / "s")])
    assert res.exit_code == 2
    assert "plan has 4 experts, the model 8" in res.output and "hint:" in res.output
