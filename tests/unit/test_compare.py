"""``moefleet compare``: the pieces (traffic, cold-start pool, fleet, recommendation) and
the command end to end on a small shape (every policy, one table, one set of arrivals)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from moefleet.cli import app
from moefleet.compare.fleet import Fleet
from moefleet.compare.remoe_rows import main_pool
from moefleet.compare.rows import Row, fill_latency
from moefleet.compare.run import recommend
from moefleet.compare.traffic import load_traffic
from moefleet.errors import MoefleetError

runner = CliRunner()
FAST = ["--model", "tiny-moe-lm", "--traffic", "poisson:rate=0.5", "--duration", "40",
        "--quick", "--slo-ttft", "2", "--slo-tpot", "0.2"]


def _row(policy: str, cost: float, attain: float, family: str = "remoe") -> Row:
    r = Row(policy, family, "p", cost_usd=cost, output_tokens=1_000_000,
            slo_attainment=attain, bill={"GPU instance time": cost})
    return r


def test_recommend_cheapest_meeting_and_the_term_it_saves() -> None:
    rows = [_row("mono", 5.0, 0.99, "monolithic"), _row("a", 1.0, 0.95),
            _row("cheap-miss", 0.1, 0.5)]
    text = recommend(rows)
    assert text.startswith("cheapest meeting the SLO: a ")
    assert "5x cheaper than mono" in text and "GPU instance time" in text


def test_recommend_none_meets_names_the_closest() -> None:
    text = recommend([_row("x", 1.0, 0.2), _row("y", 3.0, 0.6)])
    assert text.startswith("no policy meets the SLO") and "closest: y" in text


def test_fill_latency_judges_one_token_requests_on_ttft_only() -> None:
    r = fill_latency(Row("p", "f", "x"), np.array([1.0, 3.0, 1.0]), np.array([0.0, 0.1, 9.0]),
                     np.array([1, 5, 5]), slo_ttft_s=2.0, slo_tpot_s=0.5)
    assert r.slo_attainment == pytest.approx(1 / 3)
    assert r.tpot_p50_s == pytest.approx(4.55)


def test_main_pool_cold_warm_and_keep_alive() -> None:
    times = np.array([0.0, 1.0, 100.0, 1000.0])
    busy = np.array([10.0, 10.0, 10.0, 10.0])
    wait, colds, episodes = main_pool(times, busy, cold_s=5.0, keep_alive_s=600.0)
    # 0: cold; 1: the first is busy -> a second cold; 100: warm; 1000: all expired
    assert list(wait) == [5.0, 5.0, 0.0, 5.0]
    assert colds == 3 and episodes == 2


def test_fleet_cold_start_is_in_ttft_and_replicas_are_reclaimed() -> None:
    fleet = Fleet(lambda out: 0.5, max_seqs=4, cold_s=10.0, keep_alive_s=60.0)
    res = fleet.run(np.array([0.0, 1000.0]), np.array([8, 8]), np.array([3, 3]))
    assert res.ttft_s[0] == pytest.approx(10.5) and res.ttft_s[1] == pytest.approx(10.5)
    assert res.cold_starts == 2
    assert res.tpot_s[0] == pytest.approx(0.5)
    # each replica: cold start + 3 steps + the keep-alive
    assert res.alive_s == pytest.approx(2 * (10 + 1.5 + 60))


def test_traffic_kinds_and_bad_specs() -> None:
    a = load_traffic("poisson:rate=2", 100, seed=1)
    b = load_traffic("poisson:rate=2", 100, seed=1, rate_scale=2.0)
    assert 100 < len(a.arrivals) < 320 and len(b.arrivals) > len(a.arrivals)
    assert all(x.prompt_tokens and x.output_tokens for x in a.arrivals)
    assert list(a.times) == sorted(a.times)
    for bad in ("nope", "poisson:rate=-1", "azure-llm:chat", "azure-fn-2019:weird"):
        with pytest.raises(MoefleetError, match="unknown traffic"):
            load_traffic(bad, 60)


@pytest.mark.parametrize("spec", ["azure-llm:conv", "azure-fn-2019:bursty"])
def test_trace_traffic_has_lengths_and_pattern(spec: str) -> None:
    t = load_traffic(spec, 600)
    assert t.arrivals and t.times.max() < 600
    if spec.startswith("azure-fn"):
        assert t.described["pattern"] == "bursty"


def test_trace_window_shorter_than_duration_or_interval() -> None:
    with pytest.raises(MoefleetError, match="shorter than --duration"):
        load_traffic("azure-llm:conv", 10 * 3600)
    with pytest.raises(MoefleetError, match=r"shorter than the 1e\+06 s control interval"):
        load_traffic("azure-fn-2021:slow", 60, interval_s=1e6)


def test_compare_cli_every_policy_same_arrivals(tmp_path: Path) -> None:
    res = runner.invoke(app, ["compare", *FAST, "--platform", "alibaba-fc-gpu", "--json",
                              "-o", str(tmp_path / "out")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    rows = data["rows"]
    assert len(rows) >= 20
    fams = {r["family"] for r in rows}
    assert {"monolithic", "ods/bo", "remoe", "smoe", "brownout", "composed"} <= fams
    ran = [r for r in rows if r["absent"] is None]
    assert len(ran) >= 18
    n = len(data["arrivals"]["t_s"])
    assert all(r["requests"] == n for r in ran if "first" not in " ".join(r["notes"]))
    for r in ran:
        assert r["cost_per_1m_usd"] > 0 and r["fidelity"] in ("simulated", "emulated")
        assert 0 <= r["slo_attainment"] <= 1
    assert data["recommendation"]
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["rows"] == rows
    for f in ("pareto.png", "pareto.svg", "arrivals.png"):
        assert (tmp_path / "out" / f).stat().st_size > 1000


def test_compare_cpu_platform_says_why_gpu_rows_are_absent() -> None:
    res = runner.invoke(app, ["compare", *FAST, "--platform", "aws-lambda", "--json"],
                        catch_exceptions=False)
    assert res.exit_code == 0, res.output
    rows = {r["policy"]: r for r in json.loads(res.stdout)["rows"]}
    assert "no GPU functions" in rows["remoe-gpu"]["absent"]
    assert "no GPU functions" in rows["mono-gpu-engine"]["absent"]
    assert rows["remoe-cpu"]["absent"] is None


@pytest.mark.parametrize("args, words", [
    (["--model", "nope"], "unknown model shape 'nope'"),
    (["--platform", "nope"], "nope"),
    (["--traffic", "nope"], "unknown traffic 'nope'"),
    (["--slo-ttft", "0"], "--slo-ttft must be in (0, 3600]"),
])
def test_compare_bad_input_one_line(args: list[str], words: str) -> None:
    res = runner.invoke(app, ["compare", *FAST, *args])
    assert res.exit_code != 0
    assert words in res.output and "Traceback" not in res.output


def test_compare_output_path_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    res = runner.invoke(app, ["compare", *FAST, "-o", str(f)])
    assert res.exit_code != 0 and "is a file, not a folder" in res.output


def test_compare_unmeetable_slo_still_prints_the_table() -> None:
    res = runner.invoke(app, ["compare", *FAST[:-4], "--slo-ttft", "1e-6", "--slo-tpot",
                              "1e-6"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "no policy meets the SLO" in res.output and "closest:" in res.output


@pytest.mark.parametrize("keep_alive, replicas, seqs", [(30.0, 3, 8), (math.inf, 1, 64),
                                                         (5.0, 10, 2)])
def test_fast_fleet_equals_the_per_token_fleet(keep_alive: float, replicas: int,
                                               seqs: int) -> None:
    """The strided fleet against the one driving the engine's real Scheduler: same cold
    starts and replica time, latencies within one step."""
    from moefleet.compare.fastfleet import FastFleet

    rng = np.random.default_rng(0)
    n = 120
    times = np.sort(rng.uniform(0, 100, n))
    prompts, outputs = rng.integers(1, 3000, n), rng.integers(1, 200, n)

    def st(tokens: int, rows: int, pre: bool) -> float:
        return 0.002 + 1e-5 * tokens + (0.01 if pre else 0.0)

    a = Fleet(lambda out: st(out.num_tokens, len(out.rows), any(r.prefill for r in out.rows)),
              max_seqs=seqs, cold_s=3.0, keep_alive_s=keep_alive,
              max_replicas=replicas).run(times, prompts, outputs)
    b = FastFleet(st, max_seqs=seqs, cold_s=3.0, keep_alive_s=keep_alive,
                  max_replicas=replicas).run(times, prompts, outputs)
    assert a.cold_starts == b.cold_starts
    assert b.alive_s == pytest.approx(a.alive_s, rel=1e-3)
    assert np.abs(a.ttft_s - b.ttft_s).max() < 0.05
    assert np.abs(a.tpot_s - b.tpot_s).max() < 1e-3
    assert abs(a.steps - b.steps) <= 0.01 * a.steps


def test_recommend_monolithic_winner_names_the_next_and_their_terms() -> None:
    text = recommend([_row("mono", 1.0, 0.99, "monolithic"), _row("r", 2.0, 0.95)])
    assert text.startswith("cheapest meeting the SLO: mono ")
    assert "next r at $2 pays mostly for GPU instance time" in text


def test_salc_driver_lowers_the_prefill_threshold_on_slow_ttft() -> None:
    from moefleet.compare.engine_rows import SalcDriver, accuracy_at

    ctl = SalcDriver(slo_ttft_s=1.0, slo_tpot_s=0.1)
    for k in range(1, 30):
        ctl.on_step(float(k), True, 0.5, [5.0])  # every TTFT 5x the SLO
        ctl.on_step(k + 0.5, False, 0.01, [])  # decode well within its SLO
    assert ctl.t_pre < 0.1 and ctl.t_dec == 1.0
    assert ctl.mean_prefill_threshold < 0.5 and ctl.mean_decode_threshold == 1.0
    assert accuracy_at(1.0) == "none"
    assert accuracy_at(ctl.mean_prefill_threshold) != "none"


def test_cpu_timing_is_measured_once_and_cached(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from moefleet.compare import scenario
    from moefleet.compare.shapes import resolve_dims

    monkeypatch.setenv("MOEFLEET_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(scenario, "_TIMING", {})
    d = resolve_dims("tiny-moe-lm")
    first = scenario.timing_for(d)
    files = list((tmp_path / "compare").glob("timing-tiny-moe-lm-*.json"))
    assert len(files) == 1
    monkeypatch.setattr(scenario, "_TIMING", {})
    monkeypatch.setattr(scenario, "measure_cpu", lambda *a, **k: pytest.fail("re-measured"))
    assert scenario.timing_for(d) == first
