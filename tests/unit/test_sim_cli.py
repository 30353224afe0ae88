"""``moefleet simulate`` end to end (in-process, synthetic model: no weights needed)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from moefleet.cli import app
from moefleet.plan import DeploymentPlan

runner = CliRunner()
MODEL = "synthetic:blocks=2,experts=4,top_k=2,hidden=64"


def sim(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["simulate", *args], catch_exceptions=False)


def test_json_png_and_out(tmp_path: Path) -> None:
    out, png = tmp_path / "r.json", tmp_path / "t.png"
    res = sim("--model", MODEL, "--memory", "1024", "--workload", "poisson:rate=2",
              "--duration", "20", "--interval", "5", "--policy", "elasticmoe", "--seed", "1",
              "--output-tokens", "2", "--json", "-o", str(out), "--png", str(png))
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["policy"] == "elasticmoe" and data["config"]["scaling"] == "replicas"
    assert data["requests"]["completed"] == data["requests"]["arrived"] > 0
    assert data["cost"]["total"] > 0 and data["latency_s"]["p95"] > 0
    assert json.loads(out.read_text())["cost"] == data["cost"]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_plan_file_and_platform_default(tmp_path: Path) -> None:
    plan = DeploymentPlan.uniform(MODEL, "gcp-cloud-run-functions", [0, 1], [4, 4], 2, 1024,
                                  "storage")
    plan.save(tmp_path / "p.yaml")
    res = sim("--plan", str(tmp_path / "p.yaml"), "--duration", "5", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["platform"] == "gcp-cloud-run-functions"
    assert data["cost"]["storage"] > 0  # storage method: PUT/GET requests billed


def test_csv_workload_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("time,request_id\n0.5,a\n")
    res = sim("--model", MODEL, "--memory", "1024", "--workload", str(bad))
    assert res.exit_code == 2 and "missing column" in res.output
    unsorted = tmp_path / "unsorted.csv"
    unsorted.write_text("t_s,request_id\n2.0,a\n1.0,b\n")
    res = sim("--model", MODEL, "--memory", "1024", "--workload", str(unsorted))
    assert res.exit_code == 2 and "earlier than the previous" in res.output
    good = tmp_path / "good.csv"
    good.write_text("t_s,request_id,prompt_tokens,output_tokens\n0.5,a,16,1\n1.0,b,8,0\n")
    res = sim("--model", MODEL, "--memory", "1024", "--workload", str(good), "--duration", "5",
              "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["requests"]["prompt_tokens"] == 24


def test_bad_arguments() -> None:
    res = sim("--model", MODEL, "--memory", "1024", "--duration", "-5")
    assert res.exit_code == 2 and "duration" in res.output
    res = sim("--model", MODEL)
    assert res.exit_code == 2 and "--memory" in res.output
    res = sim("--model", MODEL, "--memory", "1000000")
    assert res.exit_code == 2 and "does not offer" in res.output
    res = sim("--model", MODEL, "--memory", "1024", "--policy", "magic")
    assert res.exit_code == 2 and "unknown autoscale policy" in res.output


def test_plan_for_another_model(tmp_path: Path) -> None:
    plan = DeploymentPlan.uniform("other", "aws-lambda", [0], [4], 1, 1024)
    plan.save(tmp_path / "p.yaml")
    res = sim("--plan", str(tmp_path / "p.yaml"), "--profile", str(tmp_path / "none.json"))
    assert res.exit_code == 2 and "does not exist" in res.output
    from moefleet.sim.synthetic import parse_synthetic

    parse_synthetic(MODEL).profile().save(tmp_path / "prof.json")
    res = sim("--plan", str(tmp_path / "p.yaml"), "--profile", str(tmp_path / "prof.json"))
    assert res.exit_code == 2 and "segment functions" in res.output


def test_result_reports_serving_figures_under_the_servers_metric_names() -> None:
    from moefleet import metric_names as N

    res = sim("--model", MODEL, "--memory", "1024", "--workload", "poisson:rate=4",
              "--duration", "5", "--seed", "3", "--output-tokens", "3", "--slo", "1e-9",
              "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    m = data["named_metrics"]
    assert set(m) == set(N.RESULT_NAMES)
    assert N.TTFT == "moefleet:time_to_first_token_seconds"  # what /metrics exports
    assert m[N.TTFT] == data["ttft_s"] and m[N.E2E] == data["latency_s"]
    assert m[N.TPOT] == data["tpot_s"]
    done = data["requests"]["completed"]
    assert m[N.REQUEST_SUCCESS] == done > 0 and m[N.QUEUE]["count"] == done
    assert 0 <= m[N.QUEUE]["max"] <= m[N.TTFT]["max"]  # queueing is part of TTFT
    assert m[N.PROMPT_TOKENS] == data["requests"]["prompt_tokens"]
    assert m[N.GENERATION_TOKENS] == data["requests"]["output_tokens"] == 3 * done
    # every request misses a 1 ns end-to-end SLO; no TTFT/TPOT SLO was set
    assert m[N.SLO_VIOLATIONS] == {"e2e": done, "ttft": 0, "tpot": 0}
    billed = m[N.BILLED_COST]
    assert set(billed) == {*N.COST_PARTS, "total"}
    assert billed["total"] > 0
    assert billed["total"] == data["cost"]["total"]
    assert billed["compute"] == data["cost"]["compute"]
    table = sim("--model", MODEL, "--memory", "1024", "--workload", "poisson:rate=4",
                "--duration", "5", "--seed", "3", "--output-tokens", "3")
    assert table.exit_code == 0 and N.TTFT in table.output and N.BILLED_COST in table.output
