"""``moefleet bench serve`` against the session's real server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moefleet import metric_names as N
from moefleet.cli import app
from tests.serve.conftest import Server


def test_bench_serve_cli_measures_and_bills(server: Server, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The castle was old.\n\nA river ran by it.\n\nNobody lived there.\n")
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(app, [
        "bench", "serve", "--url", server.url, "--dataset", str(prompts),
        "--workload", "poisson:rate=20", "--duration", "0.5", "--max-requests", "4",
        "--max-tokens", "3", "--slo-ttft", "60", "--slo-tpot", "60", "-o", str(out)])
    assert r.exit_code == 0, r.output
    m = json.loads(out.read_text())["metrics"]
    assert m["requests"] == m["completed"] >= 1 and m["failed"] == 0
    assert m["output_tokens"] == 3 * m["completed"]
    assert m["billed_cost_usd"] > 0
    assert m["slo_violation_rate"] == 0 and m["goodput_rps"] == m["request_throughput_rps"]
    assert m["ttft_s"]["p50"] is not None and m["itl_s"]["p50"] is not None
    assert out.with_suffix(".png").stat().st_size > 1000
    named = m["named_metrics"]  # the same figures under the server's metric names
    assert set(named) == set(N.RESULT_NAMES)
    assert named[N.TTFT] == m["ttft_s"] and named[N.GENERATION_TOKENS] == m["output_tokens"]
    assert named[N.BILLED_COST]["total"] == pytest.approx(m["billed_cost_usd"])
    assert named[N.QUEUE] is None  # the client cannot see the server's queue


def test_bench_serve_rejects_bad_options(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["bench", "serve", "--url", "localhost:1", "--dataset", "x",
                                 "--workload", "poisson:rate=1"])
    assert r.exit_code == 2 and "--url" in r.output
    r = CliRunner().invoke(app, ["bench", "serve", "--url", "http://127.0.0.1:1",
                                 "--dataset", "x", "--workload", "poisson:rate=1",
                                 "--duration", "-1"])
    assert r.exit_code == 2 and "--duration" in r.output
