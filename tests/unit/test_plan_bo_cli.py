"""``moefleet plan bo`` on synthetic traces with the hand-built BERT profile."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from moefleet.cli import app
from moefleet.plan import DeploymentPlan
from moefleet.predict.base import load_predictor
from moefleet.predict.baselines import LinaPredictor
from moefleet.predict.bayes import BayesPredictor
from moefleet.predict.synthetic import synthetic_trace
from moefleet.traces import write_trace
from tests.plan_helpers import bert_profile

pytestmark = pytest.mark.timeout(120)
runner = CliRunner()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bo")
    kw = {"moe_layers": (0, 1), "num_experts": 8, "top_k": 1, "noise": 0.3}
    train = synthetic_trace(120, (10, 40), vocab=300, seed=1, **kw)
    held = synthetic_trace(60, (10, 40), vocab=400, seed=2, request_prefix="bo", **kw)
    other = synthetic_trace(20, (10, 40), vocab=50, seed=3, moe_layers=(0, 1, 2),
                            num_experts=8, top_k=1)
    paths = {"pred": d / "p.npz", "lina": d / "l.npz", "bo": d / "bo.parquet",
             "other": d / "other.parquet", "profile": d / "profile.json"}
    BayesPredictor().fit(train).save(paths["pred"])
    LinaPredictor().fit(train).save(paths["lina"])
    write_trace(held, paths["bo"])
    write_trace(other, paths["other"])
    bert_profile(2).save(paths["profile"])
    return paths


def args(files: dict[str, Path], tmp: Path, *extra: str) -> list[str]:
    return ["plan", "bo", "--predictor", str(files["pred"]), "--bo-trace", str(files["bo"]),
            "--profile", str(files["profile"]), "--slo", "60", "--batch-tokens", "600",
            "--pairs", "30", "--iterations", "4", "-o", str(tmp / "plan.yaml"), *extra]


def test_plan_bo_writes_plan_and_adjusted_predictor(files, tmp_path: Path) -> None:
    res = runner.invoke(app, args(files, tmp_path, "--save-predictor",
                                  str(tmp_path / "adj.npz"), "--json"))
    assert res.exit_code == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["evaluator"] == "analytical" and 1 <= out["iterations"] <= 4
    assert out["best_cost_usd"] <= out["baseline_cost_usd"]
    assert out["batches"] >= 2 and len(out["history"]) == out["iterations"] + 1
    plan = DeploymentPlan.load(tmp_path / "plan.yaml")
    assert [lp.layer for lp in plan.layers] == [0, 1]
    adjusted = load_predictor(tmp_path / "adj.npz")
    original = load_predictor(files["pred"])
    assert isinstance(adjusted, BayesPredictor) and isinstance(original, BayesPredictor)
    reqs = [[1, 2, 3, 4, 5, 6]]
    assert adjusted.predict_counts(reqs).shape == original.predict_counts(reqs).shape
    if out["pairs"] and out["best_cost_usd"] < out["baseline_cost_usd"]:
        assert not np.allclose(adjusted.predict_counts(reqs), original.predict_counts(reqs))


def test_plan_bo_table_output(files, tmp_path: Path) -> None:
    res = runner.invoke(app, args(files, tmp_path))
    assert res.exit_code == 0, res.stderr
    assert "BO (eps-gp, evaluator analytical)" in res.stdout


@pytest.mark.parametrize(("change", "message"), [
    (("--predictor", "lina"), "'lina' predictor"),
    (("--bo-trace", "other"), "MoE layers"),
    (("--slo", "-1"), "--slo"),
    (("--sampler", "nope"), "sampler"),
    (("--slo", "1e-6"), "infeasible|feasible"),
])
def test_plan_bo_bad_input(files, tmp_path: Path, change: tuple[str, str],
                           message: str) -> None:
    argv = args(files, tmp_path)
    flag, value = change
    if flag in argv:
        argv[argv.index(flag) + 1] = str(files.get(value, value))
    else:
        argv += [flag, value]
    res = runner.invoke(app, argv)
    assert res.exit_code == 2
    assert re.search(message, res.stderr), res.stderr
    assert not (tmp_path / "plan.yaml").exists()
