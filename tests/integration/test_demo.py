"""The demo pipeline end to end on a small zoo model: profile, fit, BO + ODS, deploy on
the local backend, run the workload, report. (``make demo`` runs the same code on
minilm-moe-e8 with bigger batches.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moefleet.cli import app
from moefleet.demo.pipeline import DemoConfig, run_demo
from moefleet.report.demo import demo_png, demo_table

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
MODEL = "tiny-mixtral-random"


def test_demo_pipeline_reports_every_plan(tmp_path: Path) -> None:
    cfg = DemoConfig(model=MODEL, fit_tokens=1024, batch_tokens=512, bo_batches=1,
                     workload_tokens=512, max_length=64, bo_pairs=20, bo_iters=3, workers=2)
    messages: list[str] = []
    report = run_demo(cfg, tmp_path, say=messages.append)
    plans = report["plans"]
    assert set(plans) == {"bo", "oracle", "unadjusted", "lambdaml", "cpu_cluster"}
    oracle = plans["oracle"]["cost_usd"]
    assert oracle > 0 and plans["oracle"]["slo_met"]
    # ODS on the real counts is optimal for them: no other serverless plan is cheaper
    # while meeting the SLO on the same routing.
    for name in ("bo", "unadjusted", "lambdaml"):
        if plans[name]["feasible"]:
            assert plans[name]["cost_usd"] >= oracle * (1 - 1e-9), name
    assert plans["bo"]["cost_usd"] > 0
    bo = report["bo"]
    assert bo["evaluator"] == "analytical" and 1 <= bo["iterations"] <= 3
    assert bo["best_cost_usd"] == min(h["cost_usd"] for h in report["bo_history"])
    footprint = max(report["memory"]["runtime_bytes"].values())
    assert footprint > 100 << 20  # torch imported: the floor of every function
    for name in ("bo", "oracle", "unadjusted", "lambdaml"):
        m = plans[name]["measured"]
        assert "error" not in m, m  # every plan runs under the local memory/CPU limits
        assert "emulated" in m["limits"]
        assert plans[name]["min_memory_mb"] << 20 > footprint
        # The workload it was planned for, as one batch; segments' store requests billed.
        assert m["tokens"] == report["workload"]["tokens"] and m["invocations"] > 0
        assert m["moe_cost_usd"] >= m["expert_cost_usd"] + m["segment_store_usd"]
        assert m["moe_cost_usd"] > 0 and m["throughput_tokens_per_s"] > 0
        assert m["max_abs_diff"] is not None and m["max_abs_diff"] <= 1e-4
        assert (tmp_path / f"plan_{name}.yaml").is_file()
    assert any("BO" in msg for msg in messages)
    json.dumps(report)  # the report is plain JSON
    assert demo_table(report).row_count == 5
    assert demo_png(report, tmp_path / "r.png").stat().st_size > 1000


def test_demo_cli_rejects_bad_options(tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["demo", "--sampler", "nope", "-o", str(tmp_path)])
    assert res.exit_code == 2 and "eps-gp" in res.stderr
    res = runner.invoke(app, ["demo", "--slo", "-1", "-o", str(tmp_path)])
    assert res.exit_code == 2 and "--slo" in res.stderr


def test_demo_with_shifted_traffic_plans_without_running(tmp_path: Path) -> None:
    cfg = DemoConfig(model=MODEL, fit_tokens=1024, batch_tokens=512, bo_batches=1,
                     workload_tokens=512, max_length=64, bo_pairs=10, bo_iters=2,
                     traffic="c4", run=False)
    report = run_demo(cfg, tmp_path, say=lambda _: None)
    assert report["workload"]["dataset"] == "c4"
    assert report["workload"]["tokens"] >= 0.9 * 512
    assert all("measured" not in row for row in report["plans"].values())
    assert report["plans"]["oracle"]["cost_usd"] > 0
