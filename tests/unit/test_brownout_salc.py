"""SALC's rules on a fake clock: shrink above the SLO, grow below the warning line (cap
1), hold in between, check interval, sliding window, separate prefill/decode."""

from __future__ import annotations

import math
import re

import pytest

from moefleet.brownout.groups import BrownoutError
from moefleet.brownout.salc import (
    SALC,
    LatencySnapshot,
    LatencyWindow,
    SALCConfig,
    SALCPairState,
    SALCState,
    p90,
    salc_step,
)

CFG = SALCConfig(slo_s=0.25, window_s=2.0, interval_s=1.0)


def _snap(now: float, lat: float, n: int = 10) -> LatencySnapshot:
    return LatencySnapshot(now, [(now - 0.1 * i, lat) for i in range(n)])


def test_p90_is_the_nearest_rank_percentile() -> None:
    assert p90([float(i) for i in range(1, 11)]) == 9.0
    assert p90([3.0]) == 3.0
    assert p90([0.1] * 8 + [1.0, 1.0]) == 1.0  # 2 of 10 slow tokens: P90 is slow


def test_above_slo_shrinks_below_warning_grows_with_cap_between_holds() -> None:
    d, s = salc_step(CFG, _snap(10.0, 0.30), SALCState(1.0))
    assert (d.action, d.threshold) == ("shrink", pytest.approx(0.8))
    d, s = salc_step(CFG, _snap(11.0, 0.30), s)
    assert d.threshold == pytest.approx(0.64)
    d, s = salc_step(CFG, _snap(12.0, 0.22), s)  # 0.2 <= p90 <= 0.25: hold
    assert (d.action, d.threshold) == ("hold", pytest.approx(0.64))
    for t in range(13, 20):
        d, s = salc_step(CFG, _snap(float(t), 0.1), s)
    assert d.threshold == 1.0 and s.threshold == 1.0  # 0.64 + 0.1 steps, capped at 1


def test_checks_only_once_per_interval_and_only_inside_the_window() -> None:
    _, s = salc_step(CFG, _snap(10.0, 0.5), SALCState(1.0))
    d, s2 = salc_step(CFG, _snap(10.5, 0.5), s)  # too soon
    assert d.action == "wait" and s2 == s
    old = LatencySnapshot(20.0, [(17.0, 0.9), (17.9, 0.9)])  # older than the 2 s window
    d, s3 = salc_step(CFG, old, s)
    assert d.action == "no-data" and s3.threshold == s.threshold and s3.last_check == 20.0


def test_prefill_and_decode_are_controlled_separately() -> None:
    salc = SALC(slo_ttft_s=0.25, slo_tpot_s=0.15, window_s=2.0, interval_s=1.0)
    window = LatencyWindow(5.0, _snap(5.0, 0.2).samples, _snap(5.0, 0.2).samples)
    (pre, dec), st = salc.decide(window, SALCPairState())
    # 0.2 s: fine for prefill (hold at 1), over the decode SLO (shrink)
    assert (pre.action, dec.action) == ("hold", "shrink")
    assert SALC.threshold_for("prefill", st) == 1.0
    assert SALC.threshold_for("decode", st) == pytest.approx(0.8)
    with pytest.raises(BrownoutError, match="'verify'"):
        SALC.threshold_for("verify", st)  # type: ignore[arg-type]


@pytest.mark.parametrize(("field", "value"), [("slo_s", 0.0), ("slo_s", -1.0),
                                               ("slo_s", math.inf), ("shrink", 1.0),
                                               ("warning", 0.0), ("increment", 0.0)])
def test_bad_settings_are_clear_errors(field: str, value: float) -> None:
    kwargs = {"slo_s": 0.25, field: value}
    with pytest.raises(BrownoutError, match=f"={value!r}"):
        SALCConfig(**kwargs)
    if field == "slo_s":
        with pytest.raises(BrownoutError, match="slo"):
            SALC(slo_ttft_s=0.25, slo_tpot_s=value)


def test_control_sets_the_step_threshold_from_recorded_latencies() -> None:
    from moefleet.brownout.groups import Grouping, index_groups
    from moefleet.experts.brownout import BrownoutExperts
    from moefleet.experts.brownout_hook import SALCHook

    experts = BrownoutExperts(lambda layer, x, ids, w: x, Grouping(2, "index",
                              {0: index_groups(4, 2)}), 1.0, "full")
    ctl = SALCHook(SALC(0.25, 0.15, window_s=2.0, interval_s=0.0), experts)
    for i in range(10):
        ctl.record("tpot", 1.0 + 0.01 * i, 0.3)  # decode too slow
        ctl.record("ttft", 1.0 + 0.01 * i, 0.1)  # prefill fine
    assert ctl.set_threshold("decode", 1.5) == pytest.approx(0.8)
    assert experts.threshold == pytest.approx(0.8)
    # both controllers run every step: decode shrank again while prefill held at 1
    assert ctl.set_threshold("prefill", 1.6) == 1.0
    assert ctl.state.decode.threshold == pytest.approx(0.64)
    # samples older than the 2 s window are dropped: no data, the threshold holds
    assert ctl.set_threshold("decode", 10.0) == pytest.approx(0.64)
    assert ctl.last is not None and ctl.last[1].action == "no-data"


@pytest.mark.parametrize(("text", "needle"), [
    ("ways=8,slo-ttft=0.25", "lacks slo-tpot="),
    ("ways=8,slo-ttft=0,slo-tpot=0.15", "slo=0.0"),
    ("ways=8,slo-ttft=0.25,slo-tpot=-1", "slo=-1.0"),
    ("ways=1,slo-ttft=0.25,slo-tpot=0.15", "ways=1"),
    ("ways=8,slo-ttft=fast,slo-tpot=0.15", "slo-ttft='fast'"),
    ("ways=8,slo-ttft=0.2,slo-tpot=0.1,speed=2", "key 'speed'"),
])
def test_brownout_spec_errors_name_the_value(text: str, needle: str) -> None:
    from moefleet.experts.brownout_control import parse_brownout_spec

    with pytest.raises(BrownoutError, match=re.escape(needle)):
        parse_brownout_spec(text)


def test_brownout_spec_parses_the_serve_option() -> None:
    from moefleet.experts.brownout_control import parse_brownout_spec

    spec = parse_brownout_spec("ways=8, slo-ttft=0.25, slo-tpot=0.15, mode=full, shrink=0.5")
    assert (spec.ways, spec.slo_ttft_s, spec.slo_tpot_s, spec.mode, spec.shrink) == (
        8, 0.25, 0.15, "full", 0.5)
