"""``compare --measure`` runs what the simulator prices: a Remoe layout one request per
main function (no batching across requests, TTFT from the main's start), an ODS/BO plan
as one batch; and every plan leaves room for the functions' runtime footprint, so an
ODS/BO plan run for real starts on the local backend instead of running out of memory."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from moefleet.compare.measure import HELD_SHARES, _plan_for, mini_scenario, run_real
from moefleet.compare.scenario import Scenario, build_scenario
from moefleet.compare.shapes import dims_from_adapter
from moefleet.models.hf import HFMoEAdapter
from moefleet.models.tiny import tiny_model

pytestmark = pytest.mark.timeout(600)


@functools.cache
def adapter() -> HFMoEAdapter:
    return HFMoEAdapter(tiny_model("mixtral"))


def _scenario(platform: str, runtime_mb: float | None = None) -> Scenario:
    a = adapter()
    return build_scenario(a.name, platform, "poisson:rate=1", slo_ttft_s=2.0,
                          slo_tpot_s=0.2, duration_s=30, dims=dims_from_adapter(a),
                          quick=True, runtime_mb=runtime_mb)


@pytest.mark.parametrize("runtime_mb", [256.0, 700.0])
def test_ods_plans_leave_room_for_the_runtime_footprint(runtime_mb: float) -> None:
    sc = _scenario("aws-lambda", runtime_mb)
    plan = _plan_for(sc, "ods-predicted", adapter())
    memories = [e.memory_mb for lp in plan.layers for e in lp.experts]
    assert memories and min(memories) >= runtime_mb, (runtime_mb, sorted(set(memories)))
    assert sc.describe()["runtime_footprint_mb"] == runtime_mb


def test_remoe_plans_leave_room_for_the_runtime_footprint() -> None:
    small = _plan_for(_scenario("aws-lambda", 256.0), "remoe-cpu", adapter())
    big = _plan_for(_scenario("aws-lambda", 900.0), "remoe-cpu", adapter())
    assert small.main is not None and big.main is not None
    assert big.main.memory_mb >= 900 > small.main.memory_mb


def test_remoe_measured_one_request_per_main_ods_as_a_batch() -> None:
    """The measured run takes the deployment's shape: Remoe requests alone (TTFT from
    their main's start, so no request waits on another's), ODS/BO requests together."""
    from moefleet.profiles.footprint import measure_runtime_footprint

    local_mb = measure_runtime_footprint("local") / 2**20
    sc = mini_scenario(_scenario("aws-lambda", max(256.0, local_mb)))
    a = adapter()
    remoe = run_real(sc, "remoe-cpu", a, salc=False)
    assert "error" not in remoe and not remoe["errors"], remoe
    assert remoe["requests_at_once"] == 1
    assert remoe["output_tokens"] == sum(x.output_tokens or 1 for x in sc.traffic.arrivals)
    ods = run_real(sc, "ods-predicted", a, salc=False)
    assert "error" not in ods and not ods["errors"], ods  # it started: no OOM
    assert ods["requests_at_once"] == len(sc.traffic.arrivals)
    # alone, the slowest first token is one request's prefill, not the whole queue's
    assert remoe["ttft_p95_s"] < remoe["wall_s"] / 2
    for run in (remoe, ods):  # the per-request figures behind each P95
        assert len(run["ttft_s"]) == len(sc.traffic.arrivals) >= len(run["tpot_s"]) > 0
        assert run["tpot_p95_s"] == pytest.approx(np.percentile(run["tpot_s"], 95), abs=1e-5)
        assert run["tpot_p50_s"] == pytest.approx(np.percentile(run["tpot_s"], 50), abs=1e-5)


def test_the_measured_side_emulates_the_platforms_startup_and_store() -> None:
    from moefleet.compare.measure import platform_emulation

    sc = _scenario("aws-lambda")
    opts = platform_emulation(sc)
    assert opts["startup"] == "platform"
    assert opts["store_latency"] == (sc.spec.storage.access_latency_s,  # type: ignore[union-attr]
                                     sc.spec.storage.bandwidth_bytes_per_s)  # type: ignore[union-attr]


def test_a_remoe_row_is_held_to_its_warm_main_figures() -> None:
    """The measured main runs in this process, warm: the reference leaves the simulated
    main's INIT out of the cost and its cold wait out of the TTFT; ODS rows are as
    simulated."""
    from moefleet.compare.measure import reference, simulated_row

    mini = mini_scenario(_scenario("aws-lambda"))  # aws-lambda bills INIT
    remoe = simulated_row(mini, "remoe-cpu")
    assert remoe.bill["main INIT"] > 0 and remoe.ttft_warm_p95_s is not None
    ref = reference(remoe)
    warm = (remoe.cost_usd - remoe.bill["main INIT"]) / remoe.output_tokens * 1e6  # type: ignore[operator]
    assert ref["cost_per_1m_usd"] == pytest.approx(warm)
    assert ref["ttft_p95_s"] == remoe.ttft_warm_p95_s < remoe.ttft_p95_s  # type: ignore[operator]
    assert ref["tpot_p50_s"] == remoe.tpot_p50_s is not None  # a decode step is warm either way
    ods = simulated_row(mini, "ods-predicted")
    assert reference(ods)["cost_per_1m_usd"] == ods.cost_per_1m


def test_measure_calibrates_remoe_rows_with_the_engines_cpu_step() -> None:
    """``--measure`` times the engine on this machine (prompts of its own) and Remoe's rows
    take those CPU times: the engine's step (scheduling, sampling, Python per layer) is
    slower than the FLOP-scaled one, so the calibrated rows are slower; the scenario
    says which times it used."""
    from moefleet.compare.measure import calibrate_cpu, simulated_row

    sc = _scenario("aws-lambda")
    flop = simulated_row(mini_scenario(sc), "remoe-cpu")
    cal = calibrate_cpu(sc, adapter())
    assert cal.nonexpert_decode_s > 0 and cal.expert_token_s > 0
    # the engine timed held at each share too: one point per share, factors >= 1
    assert [h[0] for h in cal.held] == list(HELD_SHARES)
    assert all(min(h[1:]) >= 1.0 for h in cal.held)
    assert cal.call_overhead_s >= 0 and cal.handler_fixed_s >= 0
    sc.cpu_cal = cal
    assert "measured on this machine" in sc.describe()["cpu_timing"]
    engine = simulated_row(mini_scenario(sc), "remoe-cpu")
    assert engine.tpot_p95_s > flop.tpot_p95_s  # type: ignore[operator]


def test_an_ods_run_plays_and_bills_its_segment_functions() -> None:
    """The measured ODS run plays the plan's segment functions (emulated) and says so (the
    records they bill: tests/unit/test_played_segments.py)."""
    from moefleet.profiles.footprint import measure_runtime_footprint

    local_mb = measure_runtime_footprint("local") / 2**20
    sc = mini_scenario(_scenario("aws-lambda", max(256.0, local_mb)))
    ods = run_real(sc, "ods-predicted", adapter(), salc=False)
    assert "error" not in ods and not ods["errors"], ods
    assert any("plays the" in n and "segment functions" in n for n in ods["notes"]), ods


def test_a_calibrated_profile_takes_the_engines_times_at_one_thread() -> None:
    """With the engine's CPU times (``--measure``), ODS/BO's segment and expert laws are
    the measured ones, and more vCPUs than one buy no speed (one thread was measured);
    without them the laws stay FLOP-scaled with the assumed thread law."""
    from moefleet.calibration.remoe import RemoeCalibration
    from moefleet.compare.pipeline_common import profile_of

    sc = _scenario("aws-lambda")
    flop = profile_of(sc)
    assert flop.segments[0].threads.speed_factor(4.0) < 1.0
    sc.cpu_cal = RemoeCalibration(0.002, 3e-4, 0.001, 0.5, handler_fixed_s=0.0015,
                                  slot_wire_s=1e-4)
    cal = profile_of(sc)
    seg, ex = cal.segments[0], cal.experts[cal.moe_layers[0]]
    assert seg.batch.time_s(1) == pytest.approx(0.002)  # one decode token: the engine's
    assert seg.batch.per_token_s == pytest.approx(3e-4)  # per further (prompt) token
    assert ex.batch.overhead_s == 0.0015 and ex.batch.per_token_s == pytest.approx(1.1e-3)
    assert seg.threads.speed_factor(4.0) == ex.threads.speed_factor(4.0) == 1.0
    assert seg.threads.speed_factor(0.5) == pytest.approx(2.0)  # a half share: 2x slower
    assert cal.machine == {"estimated": False}
