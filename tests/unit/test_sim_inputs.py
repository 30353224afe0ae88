"""Bad input gives moefleet errors; runs are deterministic; the bill equals the Meter's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from moefleet.calibration.sim import MeasuredRun, calibrate
from moefleet.errors import MoefleetError
from moefleet.plan import PlanError
from moefleet.platform import Meter
from moefleet.sim import SimConfig, SimError, Simulator
from moefleet.sim.config import Calibration, apply_calibration
from moefleet.workloads import Arrival, PoissonWorkload
from tests.unit.sim_helpers import arrivals, plan, profile, spec


def sim(**kw):  # type: ignore[no-untyped-def]
    kw.setdefault("top_k", 1)
    return Simulator(kw.pop("p", plan()), kw.pop("prof", profile()), spec(), **kw)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_bad_duration(bad: float) -> None:
    with pytest.raises(SimError, match="duration"):
        sim().run([], bad)


def test_unsorted_or_out_of_range_arrivals() -> None:
    with pytest.raises(SimError, match="not sorted"):
        sim().run([Arrival(2.0, "a"), Arrival(1.0, "b")], 10.0)
    with pytest.raises(SimError, match="outside"):
        sim().run([Arrival(12.0, "a")], 10.0)


def test_plan_must_match_model_profile_and_platform() -> None:
    with pytest.raises(PlanError, match="blocks"):
        sim(p=plan(blocks=2))  # the profile has one block
    with pytest.raises(PlanError, match="experts"):
        from moefleet.sim import DistributionRouter
        sim(p=plan(experts=2), router=DistributionRouter.uniform([3], 1))
    with pytest.raises(PlanError, match="platform"):
        sim(p=plan().model_copy(update={"platform": "aws-lambda"}))
    with pytest.raises(PlanError, match="does not offer"):
        sim(p=plan(memory_mb=3000))


def test_bad_config_values() -> None:
    for kw in ({"keep_alive_s": -1.0}, {"interval_s": 0.0}, {"concurrency": 0},
               {"scaling": "magic"}, {"slo_s": -2.0}):
        with pytest.raises(SimError):
            SimConfig(**kw)  # type: ignore[arg-type]
    with pytest.raises(SimError, match="concurrency"):
        sim(config=SimConfig(concurrency=5))  # the platform allows 4


def test_deterministic_under_seed() -> None:
    def once(seed: int) -> dict[str, object]:
        s = sim(p=plan(experts=4, blocks=2), prof=profile(blocks=2), top_k=2, seed=seed,
                config=SimConfig(output_tokens=3))
        d = s.run(PoissonWorkload(3.0), 30.0).to_dict()
        d.pop("performance")
        return d

    a, b, c = once(7), once(7), once(8)
    assert a == b
    assert a != c


def test_streamed_bill_equals_meter_bill() -> None:
    s = sim(p=plan(experts=4, blocks=2, method="storage"), prof=profile(blocks=2), top_k=2,
            config=SimConfig(keep_records=True, output_tokens=2, keep_alive_s=3.0))
    r = s.run(PoissonWorkload(2.0), 20.0)
    assert r.bill is not None
    assert r.bill.invocations == r.invocations > 0
    assert r.bill.cold_starts == r.cold_starts > 0
    assert r.bill.total.total == pytest.approx(r.cost.total, rel=1e-12)
    assert r.bill.total.storage == pytest.approx(r.cost.storage, rel=1e-12)
    assert r.bill.gb_s == pytest.approx(r.gb_s, rel=1e-12)
    # The records re-priced by a fresh Meter give the same bill again.
    assert Meter(s.spec, s.meter.records if s.meter else []).bill().total.compute == (
        pytest.approx(r.cost.compute, rel=1e-12))


def test_calibration_hooks() -> None:
    cfg = SimConfig(prewarm=True)
    cal = Calibration(warm_start_s=0.2, call_overhead_s=0.05, function_bandwidth_bytes_per_s=1e6)
    s2, c2 = apply_calibration(spec(), cfg, cal)
    assert s2.network is not None and s2.network.function_bandwidth_bytes_per_s == 1e6
    r = Simulator(plan(), profile(), s2, top_k=1, decoder=False, config=c2).run(
        arrivals(0.0), 1.0)
    # pre 0.2 + 0.01 + 0.05, back 0.01 (B_f 1e6); expert 0.2 + 0.01 + 0.1 + 0.05, back
    # 0.01; post 0.2 + 0.01 + 0.05, back 0.01.
    assert r.latency["mean"] == pytest.approx(0.27 + 0.37 + 0.27, abs=1e-12)
    with pytest.raises(MoefleetError):
        Calibration(warm_start_s=-1.0)
    # A "measured" run: the simulator itself with overheads 0.2 s warm, 0.05 s per call;
    # calibrating against the overhead-free prediction recovers both.
    truth = Simulator(plan(), profile(), s2, top_k=1, decoder=False,
                      config=replace(c2, keep_records=True, prewarm=False))
    res = truth.run(arrivals(0.0, 50.0), 100.0)
    assert truth.meter is not None
    measured = MeasuredRun([0.0, 0.0], truth.meter.records)
    bare = Simulator(plan(), profile(), s2, top_k=1, decoder=False,
                     config=SimConfig(prewarm=True)).run(arrivals(0.0, 50.0), 100.0)
    lat = [res.latency["max"], res.latency["min"]]  # the cold one, the warm one
    measured = MeasuredRun(lat, truth.meter.records)
    got = calibrate(measured, bare, serial=True)
    assert got.call_overhead_s == {"expert": pytest.approx(0.05), "segment": pytest.approx(0.05)}
    # Serial: latency beyond handler + INIT per call = warm start + the 0.01 s payload back.
    assert got.warm_start_s == pytest.approx(0.2 + 0.01)
    assert got.cold_start_s == pytest.approx((1.01 + 2.01) / 2)


def test_overhead_per_kind() -> None:
    cfg = SimConfig(prewarm=True, call_overhead_s={"expert": 0.01})
    assert cfg.overhead_s("expert") == 0.01 and cfg.overhead_s("segment") == 0.0
    r = sim(decoder=False, config=cfg).run(arrivals(0.0), 1.0)
    assert r.latency["mean"] == pytest.approx(0.435 + 0.01, abs=1e-12)
    with pytest.raises(SimError, match="expert"):
        SimConfig(call_overhead_s={"expert": -1.0})


def test_calibration_scales_compute_that_the_profile_overestimates() -> None:
    """A profile measured under heavier load than the run predicts slower calls than the
    backend made: no (non-negative) overhead closes that gap, so calibration scales the
    kind's compute by measured / predicted, and the calibrated simulator reproduces it."""
    fast = SimConfig(keep_records=True, compute_scale=0.5, prewarm=True)  # warm: no INIT
    truth = Simulator(plan(), profile(), spec(), top_k=1, decoder=False, config=fast)
    res = truth.run(arrivals(0.0, 50.0), 100.0)
    assert truth.meter is not None
    bare = Simulator(plan(), profile(), spec(), top_k=1, decoder=False,
                     config=SimConfig(prewarm=True)).run(arrivals(0.0, 50.0), 100.0)
    got = calibrate(MeasuredRun([res.latency["max"], res.latency["min"]],
                                truth.meter.records), bare, serial=False)
    assert got.call_overhead_s == {"expert": 0.0, "segment": 0.0}
    # measured / predicted handler time: 0.5 on the compute part, 1 on the fixed part
    # (payload and load times the profile does not scale), so between the two
    assert all(0.5 < v < 0.75 for v in got.compute_scale.values())  # type: ignore[union-attr]
    s2, c2 = apply_calibration(spec(), SimConfig(prewarm=True), got)
    again = Simulator(plan(), profile(), s2, top_k=1, decoder=False, config=c2).run(
        arrivals(0.0, 50.0), 100.0)
    off_bare = bare.latency["mean"] - res.latency["mean"]
    off_cal = again.latency["mean"] - res.latency["mean"]
    assert off_bare > 0 and abs(off_cal) < 0.25 * off_bare
    with pytest.raises(SimError, match="compute_scale"):
        SimConfig(compute_scale={"expert": 0.0})
