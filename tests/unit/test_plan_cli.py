"""``moefleet plan`` and ``moefleet plan show`` in-process: counts from .npy and from a
trace, --json purity, error paths."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from moefleet.cli import app
from moefleet.plan import DeploymentPlan
from moefleet.traces.schema import Trace, arrow_schema, write_trace
from tests.plan_helpers import bert_profile, skewed_counts

runner = CliRunner()


def run(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, list(args), catch_exceptions=False)


@pytest.fixture
def inputs(tmp_path: Path) -> tuple[Path, Path]:
    profile = bert_profile(4).save(tmp_path / "profile.json")
    counts = tmp_path / "counts.npy"
    np.save(counts, skewed_counts(4, 4, 2048, seed=3))
    return profile, counts


def _common(profile: Path, counts: Path, out: Path, slo: str = "30") -> list[str]:
    return ["plan", "--platform", "aws-lambda-2020", "--slo", slo, "--counts", str(counts),
            "--profile", str(profile), "-o", str(out)]


def test_plan_json_then_show(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    res = run(*_common(*inputs, out), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)  # stdout is only the JSON
    assert data["policy"] == "ods" and data["out"] == str(out)
    plan = DeploymentPlan.load(out)
    assert plan.predicted["cost_usd"] == pytest.approx(data["predicted"]["cost_usd"])
    assert plan.predicted["latency_s"] <= 30.0
    plan.check_model([0, 1, 2, 3], [4] * 4, 4)
    shown = run("plan", "show", str(out))
    assert shown.exit_code == 0
    assert "memory per expert" in shown.stdout and "predicted cost" in shown.stdout
    assert plan.layers[0].method in shown.stdout
    as_json = json.loads(run("plan", "show", str(out), "--json").stdout)
    assert as_json["layers"][0]["method"] == plan.layers[0].method


def test_plan_from_a_trace(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    profile, _ = inputs
    # 300 tokens x 4 MoE layers, top-1, expert = token index mod 4 (experts 0-3).
    rows = [(f"r{t // 100}", layer, t % 100, t, -1, [t % 4], [1.0])
            for layer in range(4) for t in range(300)]
    cols = list(zip(*rows, strict=True))
    table = pa.table([pa.array(c) for c in cols], schema=arrow_schema(1))
    meta = {"model": "bert-moe-hand", "moe_layers": [0, 1, 2, 3], "num_experts": [4] * 4,
            "top_k": 1}
    trace = write_trace(Trace(table, meta), tmp_path / "trace.parquet")
    out = tmp_path / "plan.yaml"
    res = run(*_common(profile, trace, out, slo="20"), "--policy", "lambdaml", "--json")
    assert res.exit_code == 0, res.output
    plan = DeploymentPlan.load(out)
    assert plan.policy == "lambdaml" and plan.meta["worst_case_payload_bytes"] == 300 * 3072


def test_plan_errors_are_clean(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    profile, counts = inputs
    out = tmp_path / "plan.yaml"
    res = run(*_common(profile, counts, out, slo="0.5"))
    assert res.exit_code == 2 and "infeasible: the fastest plan takes" in res.stderr
    assert not out.exists()
    res = run(*_common(profile, counts, out), "--policy", "odz")
    assert res.exit_code == 2 and "did you mean 'ods'" in res.stderr
    res = run("plan", "--counts", str(counts), "--profile", str(profile))
    assert res.exit_code == 2 and "needs --slo and --counts" in res.stderr
    bad = tmp_path / "c.npy"
    np.save(bad, np.ones(3))
    res = run(*_common(profile, bad, out))
    assert res.exit_code == 2 and "(layers, experts)" in res.stderr
    res = run("plan", "--slo", "30", "--counts", str(counts))
    assert res.exit_code == 2 and "needs --profile or --model" in res.stderr
    res = run("plan", "show", str(tmp_path / "missing.yaml"))
    assert res.exit_code == 2 and "does not exist" in res.stderr


def test_plan_warm_instances_flag(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    cold, warm = tmp_path / "cold.yaml", tmp_path / "warm.yaml"
    assert run(*_common(*inputs, cold), "--json").exit_code == 0
    res = run(*_common(*inputs, warm), "--warm-instances", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["meta"]["warm_instances"] is True
    c, w = DeploymentPlan.load(cold), DeploymentPlan.load(warm)
    assert "warm_instances" not in c.meta and w.meta["warm_instances"] is True
    assert w.predicted["cost_usd"] < c.predicted["cost_usd"]
