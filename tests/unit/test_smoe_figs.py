"""sMoE Figs. 7/8 data (best baseline, normalisation, one checkpoint against baselines)
and the imitation floor of DDPG training."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from moefleet.autoscale.errors import AutoscaleError
from moefleet.autoscale.smoe import ActorSpec, ConfigSpace, DDPGConfig
from moefleet.autoscale.smoe.agent import imitation_weight
from moefleet.autoscale.smoe.figs import best_baseline, compare, normalise
from moefleet.autoscale.smoe.train import TrainSetup, new_agent, save_checkpoint

TINY = "synthetic:blocks=2,experts=2,top_k=1,hidden=64,decoder=0"
SPACE = ConfigSpace(memory_mb=(512, 2048), replicas=(1, 2), concurrency=(1, 2))


def _row(cost: float, p95: float) -> dict[str, float]:
    return {"cost_usd": cost, "p95_over_slo": p95}


def test_best_baseline_is_the_cheapest_within_the_slo_slack() -> None:
    rows = {"smoe": _row(0.5, 0.9), "static": _row(1.0, 0.8), "hpa": _row(0.4, 1.3),
            "static-pop": _row(0.7, 1.02)}
    assert best_baseline(rows) == ("static-pop", True)  # hpa is cheaper but breaks it
    cell = normalise(rows)
    assert cell["best_baseline"] == "static-pop"
    assert cell["controllers"]["static-pop"]["cost_over_best"] == 1.0
    assert cell["cost_ratio_vs_best_baseline"] == pytest.approx(0.5 / 0.7)
    assert cell["bar_cost_met"] and cell["bar_p95_met"]
    # none within the slack: the lowest P95 is the reference, flagged
    worse = {"smoe": _row(0.5, 3.0), "static": _row(1.0, 1.5), "hpa": _row(0.4, 2.0)}
    assert best_baseline(worse) == ("static", False)
    assert not normalise(worse)["bar_p95_met"]
    with pytest.raises(AutoscaleError, match="no baseline rows"):
        best_baseline({"smoe": _row(1.0, 1.0)})


def test_imitation_weight_fades_to_its_floor_and_stays() -> None:
    cfg = DDPGConfig(bc_weight=1.0, bc_updates=100, bc_floor=0.2)
    ws = [imitation_weight(cfg, u) for u in range(0, 400, 7)]
    assert ws[0] == 1.0 and min(ws) == 0.2 and ws[-1] == 0.2
    assert all(a >= b for a, b in itertools.pairwise(ws))  # never grows back
    assert imitation_weight(DDPGConfig(bc_updates=100), 150) == 0.0  # default: fades out
    with pytest.raises(AutoscaleError, match="imitation floor"):
        DDPGConfig(bc_floor=-0.1)


def test_compare_writes_every_key_the_figures_read(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    setup = TrainSetup(model=TINY, slo_s=0.2, interval_s=60.0, mean_rps=0.3,
                       windows_per_pattern=2)
    _, agent = new_agent(setup, SPACE, ActorSpec(hidden=8), DDPGConfig(), seed=0)
    ckpt = save_checkpoint(tmp_path / "f.pt", agent, setup, 0, [])
    res = compare(ckpt, pattern="bursty", windows=1, prompt_tokens=32,
                  baselines=("static", "elasticmoe"),
                  extra=lambda sc, setup, space: {"ref:static": lambda: None})
    assert res["prompt_tokens"] == 32 and res["trained_prompt_tokens"] == 64
    assert res["slo_s"] == 0.2 and res["best_baseline"] in ("static", "elasticmoe")
    assert set(res["controllers"]) == {"smoe", "static", "elasticmoe", "ref:static"}
    # a reference row is reported, never the best baseline (the static plan twice:
    # same arrivals and seed, so the same cost)
    ref = res["controllers"]["ref:static"]
    assert ref["cost_usd"] == res["controllers"]["static"]["cost_usd"]
    for row in res["controllers"].values():
        assert row["cost_over_best"] > 0 and len(row["window_p95_over_slo"]) == 1
        series = row["interval_p95_over_slo"][0]
        assert len(series["t_s"]) == len(series["p95_over_slo"]) > 0
        assert series["t_s"] == sorted(series["t_s"])
    assert res["cost_ratio_vs_best_baseline"] == res["controllers"]["smoe"]["cost_over_best"]
    with pytest.raises(AutoscaleError, match="prompt_tokens"):
        compare(ckpt, prompt_tokens=0)
    with pytest.raises(AutoscaleError, match="shadows"):
        compare(ckpt, baselines=("static",),
                extra=lambda sc, setup, space: {"static": lambda: None})
    with pytest.raises(AutoscaleError, match="unknown or no baselines"):
        compare(ckpt, baselines=("nope",))
