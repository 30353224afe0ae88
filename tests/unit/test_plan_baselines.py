"""Baselines: LambdaML sizing, seeded random method choice, the CPU-cluster bill."""

from __future__ import annotations

import numpy as np
import pytest

from moefleet.plan import (
    InfeasibleError,
    LambdaMLPlanner,
    PlanningProblem,
    RandomPlanner,
    cpu_cluster_cost,
    evaluate,
)
from moefleet.platform import load_platform
from tests.plan_helpers import bert_profile, tiny_problem

SPEC = load_platform("aws-lambda-2020")


def test_lambdaml_is_fixed_worst_case_sizing() -> None:
    # 30 tokens x 400 kB = 12 MB > 6 MB payload: the worst case (all tokens to one
    # expert) cannot go direct, so every layer uses storage; 3008 MB, one replica each.
    p = tiny_problem([[10, 20], [15, 15]], 100.0, bytes_per_token=400_000)
    plan = LambdaMLPlanner().plan(p)
    assert {lp.method for lp in plan.layers} == {"storage"}
    assert {(e.memory_mb, e.replicas) for lp in plan.layers for e in lp.experts} == {(3008, 1)}
    assert plan.predicted["cost_usd"] == pytest.approx(evaluate(p, plan).cost_usd)
    # No prediction: other counts with the same batch give the same plan.
    other = LambdaMLPlanner().plan(p.with_counts(np.array([[30, 0], [1, 29]])))
    assert other.layers == plan.layers
    # Small tokens: the worst-case payload fits, so direct invocation.
    small = LambdaMLPlanner().plan(tiny_problem([[10, 20]], 100.0, bytes_per_token=3072))
    assert small.layers[0].method == "direct"


def test_lambdaml_that_misses_the_slo_says_so() -> None:
    p = tiny_problem([[10, 20], [15, 15]], 100.0, bytes_per_token=400_000)
    lam = LambdaMLPlanner().plan(p)
    from moefleet.plan import OdsPlanner

    # An SLO the optimiser meets (more replicas) but the one-replica baseline does not.
    tight = p.with_slo(lam.predicted["latency_s"] * 0.9)
    OdsPlanner().plan(tight)
    with pytest.raises(InfeasibleError, match="LambdaML plan breaks"):
        LambdaMLPlanner().plan(tight)


def test_random_is_seeded() -> None:
    p = tiny_problem([[6, 7, 10, 13], [0, 2, 11, 13], [3, 3, 3, 3]], 100.0,
                     bytes_per_token=1_500_000)
    a, b = RandomPlanner().plan(p, seed=5), RandomPlanner().plan(p, seed=5)
    assert a.layers == b.layers and a.meta == b.meta
    assert [lp.method_code for lp in a.layers] == a.meta["methods"]
    draws = {tuple(RandomPlanner().plan(p, seed=s).meta["methods"]) for s in range(8)}
    assert len(draws) > 1


def test_cpu_cluster_bills_whole_hours() -> None:
    prof = bert_profile(2)
    counts = [[10, 0], [4, 6]]
    p = PlanningProblem.from_profile(prof, SPEC, counts, slo_s=100.0, tokens=10)
    cluster = load_platform("cpu-cluster")  # 128 cores, $7.41888/h, started hours
    est = cpu_cluster_cost(p, prof, cluster)
    # Both experts of a layer at once on 128 / 2 = 64 cores each; segments on all 128.
    moe = sum(max(prof.expert_time_s(layer, n, 64.0) for n in row)
              for layer, row in enumerate(counts))
    seg = sum(prof.segment_time_s(b, 10, 128.0) for b in range(2))
    assert est.moe_s == pytest.approx(moe)
    assert est.wall_s == pytest.approx(moe + seg)
    assert est.billed_s == 3600.0 and est.cost_usd == pytest.approx(7.41888)
    assert est.moe_prorated_usd == pytest.approx(moe / 3600 * 7.41888)
