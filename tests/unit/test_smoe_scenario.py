"""sMoE scenarios: uniform routing vs a routing trace (skewed), and the SLO rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moefleet.autoscale.errors import AutoscaleError
from moefleet.autoscale.smoe.harness import build_scenario, unloaded_latency_s
from moefleet.autoscale.smoe.train import (
    SLO_HEADROOM,
    TrainSetup,
    load_checkpoint,
    scenario_for,
    scenario_setup,
)
from moefleet.predict.synthetic import synthetic_trace
from moefleet.sim.routing import DistributionRouter, TraceRowRouter
from moefleet.traces.schema import write_trace

TINY = "synthetic:blocks=2,experts=4,top_k=2,hidden=64,decoder=0"


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("smoe-trace")
    return write_trace(synthetic_trace(40, moe_layers=(0, 1), num_experts=4, top_k=2,
                                       seed=0), d / "t.parquet")


def test_skewed_scenario_replays_the_traces_popularity(trace_path: Path) -> None:
    uni = build_scenario(TINY, slo_s=0.5)
    assert isinstance(uni.routing(), DistributionRouter) and uni.routing_trace == ""
    sc = build_scenario(TINY, slo_s=0.5, routing_trace=str(trace_path))
    router = sc.routing()
    assert isinstance(router, TraceRowRouter)
    rng = np.random.default_rng(0)
    for li in range(2):
        got = sum(router.counts(li, 64, rng) for _ in range(200)).astype(float)
        want = np.bincount(router.ids[li].reshape(-1), minlength=4).astype(float)
        assert got.sum() == 200 * 64 * 2
        # the trace is skewed (Zipf tokens) and the draws follow it, not uniform
        assert want.max() / want.mean() > 1.2
        assert np.abs(got / got.sum() - want / want.sum()).max() < 0.03


def test_trace_of_another_shape_or_missing_is_an_error(tmp_path: Path,
                                                       trace_path: Path) -> None:
    with pytest.raises(AutoscaleError, match=r"\[4, 4\] top-2; the scenario model has "
                                              r"\[8, 8\] top-2"):
        build_scenario(TINY.replace("experts=4", "experts=8"), routing_trace=str(trace_path))
    with pytest.raises(AutoscaleError, match="no routing trace") as err:
        build_scenario(TINY, routing_trace=str(tmp_path / "none.parquet"))
    assert "moefleet profile" in (err.value.hint or "")


def test_skewed_slo_rule_and_checkpoint_scenario_check(trace_path: Path,
                                                       tmp_path: Path) -> None:
    setup = scenario_setup("skewed", routing_trace=str(trace_path), model=TINY,
                           prompt_tokens=16)
    assert setup.scenario == "skewed"
    unloaded = unloaded_latency_s(scenario_for(setup))
    assert unloaded > 0 and setup.slo_s == round(SLO_HEADROOM * unloaded, 4)
    assert scenario_setup("uniform", model=TINY).slo_s == 0.3
    with pytest.raises(AutoscaleError, match="unknown scenario 'zipf'"):
        scenario_setup("zipf")

    from moefleet.autoscale.smoe import ActorSpec, ConfigSpace, DDPGConfig
    from moefleet.autoscale.smoe.train import new_agent, save_checkpoint

    space = ConfigSpace(memory_mb=(512, 2048), replicas=(1, 2), concurrency=(1, 2))
    _, agent = new_agent(setup, space, ActorSpec(hidden=8), DDPGConfig(), seed=0)
    path = save_checkpoint(tmp_path / "s.pt", agent, setup, 0, [])
    sc, _, got, _, _ = load_checkpoint(path, expect_setup=setup)
    assert got == setup and isinstance(sc.routing(), TraceRowRouter)
    other = TrainSetup(model=TINY, slo_s=setup.slo_s, prompt_tokens=16)
    with pytest.raises(AutoscaleError, match=r"skewed routing.*not.*uniform routing"):
        load_checkpoint(path, expect_setup=other)
