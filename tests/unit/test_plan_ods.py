"""ODS (Alg. 1) and its per-method solves against exhaustive enumeration; the paper-style
comparison with LambdaML and the CPU cluster."""

from __future__ import annotations

import numpy as np
import pytest

from moefleet.plan import (
    LambdaMLPlanner,
    OdsPlanner,
    PlanningProblem,
    cpu_cluster_cost,
    evaluate,
    get_planner,
)
from moefleet.plan.base import Frontiers, LayerChoice
from moefleet.plan.costmodel import Estimate, LayerEstimate
from moefleet.plan.ods import _algorithm1
from moefleet.platform import load_platform
from tests.plan_helpers import (
    all_configs,
    bert_profile,
    brute_force_optimum,
    planned_cost,
    skewed_counts,
    tiny_problem,
)

# ≤ 2 layers x 4 experts, 3 memory options, ≤ 2 replicas; 1.5 MB tokens, so direct
# invocation needs replicas above 4 tokens and the three methods compete.
INSTANCES = [
    [[6, 7, 10, 13], [0, 2, 11, 13]],
    [[9, 7, 1, 0], [12, 10, 11, 7]],
    [[11, 4, 6, 11], [1, 4, 1, 6]],
    [[10, 13, 1, 10], [4, 7, 12, 3]],
]
SLO_FRACTIONS = [0.0, 0.05, 0.2, 0.5, 1.0]  # of the way from the fastest to the slowest plan


def _slo_grid(p: PlanningProblem) -> list[float]:
    fr = Frontiers(p)
    lo = hi = p.fixed_latency_s
    for li in range(p.num_moe_layers):
        fronts = [fr.get(li, a) for a in (1, 2, 3) if len(fr.get(li, a))]
        lo += min(float(f.latency_s[0]) for f in fronts)
        hi += max(float(f.latency_s[-1]) for f in fronts)
    return [lo + f * (hi - lo) for f in SLO_FRACTIONS]


@pytest.mark.parametrize("counts", INSTANCES)
def test_ods_within_2_percent_of_the_exact_optimum(counts: list[list[int]]) -> None:
    p = tiny_problem(counts, 100.0, bytes_per_token=1_500_000)
    configs = all_configs(p)
    for slo in _slo_grid(p):
        q = p.with_slo(slo)
        opt = brute_force_optimum(q, configs=configs)
        plan = OdsPlanner().plan(q)
        est = evaluate(q, plan)
        assert est.feasible
        cost = planned_cost(q, est.as_predicted())
        assert cost <= 1.02 * opt, (counts, slo, cost / opt)
        assert cost >= opt * (1 - 1e-9)  # nothing beats the enumeration
        # Alg. 1 as published is never better than the refined result, and is feasible.
        paper = get_planner("ods-paper").plan(q)
        assert planned_cost(q, paper.predicted) >= cost * (1 - 1e-9)
        assert evaluate(q, paper).feasible


@pytest.mark.parametrize("counts", INSTANCES[:2])
def test_per_method_decomposition_is_the_per_method_optimum(counts: list[list[int]]) -> None:
    # What ODS step 1 needs from each per-method MIQCP: its optimum. The decomposition
    # gives exactly the enumeration's optimum with every layer fixed to one method.
    p = tiny_problem(counts, 100.0, bytes_per_token=1_500_000)
    configs = all_configs(p)
    fr = Frontiers(p)
    for slo in _slo_grid(p)[1::2]:
        q = p.with_slo(slo)
        fq = Frontiers(q)
        fq._cache, fq._tables = fr._cache, fr._tables  # frontiers do not depend on the SLO
        for a in (1, 2, 3):
            opt = brute_force_optimum(q, [a], configs=configs)
            sol = fq.solve([[a]] * q.num_moe_layers)
            if np.isinf(opt):
                assert sol is None
                continue
            assert sol is not None and sol.selection.exact
            assert sol.selection.cost == pytest.approx(opt, rel=1e-9)


def _estimate(lat_cost: list[tuple[float, float]]) -> tuple[list[LayerChoice], Estimate]:
    layers = [LayerEstimate(i, 1, 1, c, lat, lat, 1) for i, (lat, c) in enumerate(lat_cost)]
    est = Estimate(sum(c for _, c in lat_cost), sum(lat for lat, _ in lat_cost), 0, 0, 0, 0,
                   layers, True)
    return [], est


def test_algorithm1_drops_the_slowest_layers_method() -> None:
    p = tiny_problem([[1, 1], [1, 1]], slo_s=1.0 + 5.0, seg_s=0.5)  # budget 5 s for MoE
    per_method = {
        1: _estimate([(4.0, 1.0), (1.5, 5.0)]),  # a=1: layer 0 cheap but slow
        2: _estimate([(2.0, 3.0), (1.0, 2.0)]),  # a=2: layer 1 cheap
        3: _estimate([(1.0, 9.0), (0.5, 9.0)]),
    }
    # Round 1: (a=1, a=2) = 4 + 1 = 5 s fits exactly -> chosen at once.
    assert _algorithm1(p, per_method) == ([1, 2], 1)
    # With 4.5 s: (1, 2) misses; layer 0 is slowest -> its a=1 is dropped; (2, 2) = 3 s.
    assert _algorithm1(p.with_slo(1.0 + 4.5), per_method) == ([2, 2], 2)
    # With 1 s nothing fits: exclusions run until a layer has no method left.
    vector, rounds = _algorithm1(p.with_slo(1.0 + 1.0), per_method)
    assert vector is None and rounds <= 2 * 2 + 1


def test_ods_result_is_reproducible_and_reports_how_it_was_found() -> None:
    p = tiny_problem(INSTANCES[2], 100.0, bytes_per_token=1_500_000)
    q = p.with_slo(_slo_grid(p)[2])
    a, b = OdsPlanner().plan(q, seed=1), OdsPlanner().plan(q, seed=2)
    assert a.layers == b.layers
    assert a.meta["exact"] is True
    assert a.meta["result"] in ("alg1", "polish", "mixed") or a.meta["result"].startswith(
        "single-method")
    assert a.predicted["cost_usd"] <= a.meta["alg1_cost_usd"] * (1 + 1e-12)


PAPER_E = [4, 8, 16]


@pytest.mark.parametrize("experts", PAPER_E)
def test_paper_style_setting(experts: int) -> None:
    # ODS/BO's basic BERT MoE on aws-lambda-2020: 12 MoE layers, top-1, 10,240 tokens.
    # The SLO lets the plan be 1/(1 - 0.1876) slower than LambdaML, the paper's largest
    # throughput loss against LambdaML.
    # Functions hold a measured-size runtime footprint (~350 MB: python + torch), so no
    # 128 MB function is possible (eq. 12c), and an expert's FFN activations per token.
    spec = load_platform("aws-lambda-2020")
    prof = bert_profile(12)
    prof.runtime_bytes = {"aws": 352 << 20}
    prof.intermediate_bytes_per_token = dict.fromkeys(prof.moe_layers, 2 * 3072 * 4)
    p = PlanningProblem.from_profile(prof, spec, skewed_counts(12, experts, 10240),
                                     slo_s=1e4, tokens=10240)
    lam = LambdaMLPlanner().plan(p)
    q = p.with_slo(lam.predicted["latency_s"] / (1 - 0.1876))
    ods = OdsPlanner().plan(q)
    cpu = cpu_cluster_cost(q, prof, load_platform("cpu-cluster"))
    assert evaluate(q, ods).feasible
    # The paper's headline is 43% below LambdaML (0.57x); measured here 0.60x, 0.44x, 0.32x
    # for 4, 8, 16 experts, with the segments' and coordinator's store requests billed
    # (plan.transfers: 3.3e-4 USD a batch, the 31 MB activations spill in every layer).
    assert ods.predicted["cost_usd"] <= 0.6 * lam.predicted["cost_usd"]
    # Against the CPU cluster read as a fully busy server (MoE seconds x hourly price, no
    # idle hour billed): measured 0.19x, 0.36x, 0.55x. (A whole rented hour per batch,
    # cpu.cost_usd, is ~3,000x any plan and proves nothing.)
    assert ods.predicted["cost_usd"] <= 0.6 * cpu.moe_prorated_usd


@pytest.mark.parametrize("counts", INSTANCES)
def test_warm_instances_ods_is_the_exact_optimum(counts: list[list[int]]) -> None:
    # The warm-instances variant (no parameter download/GET, T_warm not billed) goes
    # through the same frontiers; the enumeration sees it through the costmodel helpers.
    p = tiny_problem(counts, 100.0, bytes_per_token=1_500_000, warm_instances=True)
    configs = all_configs(p)
    cold = tiny_problem(counts, 100.0, bytes_per_token=1_500_000)
    cold_configs = all_configs(cold)
    for slo in _slo_grid(p):
        q = p.with_slo(slo)
        opt = brute_force_optimum(q, configs=configs)
        plan = OdsPlanner().plan(q)
        est = evaluate(q, plan)
        assert est.feasible and plan.meta["exact"] is True
        assert plan.meta["warm_instances"] is True
        assert planned_cost(q, est.as_predicted()) == pytest.approx(opt, rel=1e-9), (counts, slo)
        # Cheaper than the paper's model at the same SLO (nothing is charged extra).
        cold_opt = brute_force_optimum(cold.with_slo(slo), configs=cold_configs)
        assert opt <= cold_opt * (1 + 1e-12)
    for a in (1, 2, 3):  # the per-method decomposition too
        q = p.with_slo(_slo_grid(p)[2])
        opt = brute_force_optimum(q, [a], configs=configs)
        sol = Frontiers(q).solve([[a]] * q.num_moe_layers)
        if np.isinf(opt):
            assert sol is None
        else:
            assert sol is not None and sol.selection.cost == pytest.approx(opt, rel=1e-9)
