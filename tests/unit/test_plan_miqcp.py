"""The MIQCP reference (SCIP): agrees with exhaustive enumeration on tiny instances."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from moefleet.errors import MissingExtraError
from moefleet.plan import MiqcpPlanner, build_plan, evaluate, solve_miqcp
from moefleet.plan.base import Frontiers
from tests.plan_helpers import all_configs, brute_force_optimum, planned_cost, tiny_problem

pytest.importorskip("pyscipopt")


def _slos(p):  # type: ignore[no-untyped-def]
    fr = Frontiers(p)
    fastest = p.fixed_latency_s + sum(
        min(float(fr.get(li, a).latency_s[0]) for a in (1, 2, 3) if len(fr.get(li, a)))
        for li in range(p.num_moe_layers))
    return [fastest * 1.02, fastest * 1.3, fastest * 3.0]


@pytest.mark.parametrize("method", [1, 2, 3])
def test_per_method_miqcp_matches_enumeration(method: int) -> None:
    p = tiny_problem([[3, 7, 2]], 100.0, bytes_per_token=1_500_000)
    configs = all_configs(p)
    for slo in _slos(p):
        q = p.with_slo(slo)
        opt = brute_force_optimum(q, [method], configs=configs)
        res = solve_miqcp(q, [[method]], time_limit_s=120)
        if np.isinf(opt):
            assert res.layers is None
            continue
        assert res.layers is not None, res.status
        _, est = build_plan(q, res.layers, "miqcp")
        assert est.feasible, est.violations
        assert res.status == "optimal"
        assert planned_cost(q, est.as_predicted()) == pytest.approx(opt, rel=1e-6)


def test_full_miqcp_planner_matches_enumeration() -> None:
    p = tiny_problem([[3, 5], [2, 6]], 100.0, bytes_per_token=1_500_000)
    configs = all_configs(p)
    for slo in _slos(p):
        q = p.with_slo(slo)
        plan = MiqcpPlanner(time_limit_s=120).plan(q)
        assert evaluate(q, plan).feasible
        assert plan.meta["status"] == "optimal"
        assert planned_cost(q, plan.predicted) == pytest.approx(
            brute_force_optimum(q, configs=configs), rel=1e-6)


def test_missing_solver_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyscipopt", None)  # import now raises ImportError
    monkeypatch.setitem(sys.modules, "gurobipy", None)
    p = tiny_problem([[3, 5]], 100.0)
    with pytest.raises(MissingExtraError, match="pyscipopt") as err:
        MiqcpPlanner().plan(p)
    assert "moefleet[plan]" in err.value.hint
    with pytest.raises(MissingExtraError, match="gurobipy"):
        solve_miqcp(p, [[2]], solver="gurobi")


def test_warm_instances_miqcp_agrees_with_ods_and_enumeration() -> None:
    from moefleet.plan import OdsPlanner

    p = tiny_problem([[3, 5], [2, 6]], 100.0, bytes_per_token=1_500_000, warm_instances=True)
    configs = all_configs(p)
    for slo in _slos(p):
        q = p.with_slo(slo)
        plan = MiqcpPlanner(time_limit_s=120).plan(q)
        assert evaluate(q, plan).feasible
        assert plan.meta["status"] == "optimal" and plan.meta["warm_instances"] is True
        opt = brute_force_optimum(q, configs=configs)
        assert planned_cost(q, plan.predicted) == pytest.approx(opt, rel=1e-6)
        assert planned_cost(q, plan.predicted) == pytest.approx(
            planned_cost(q, OdsPlanner().plan(q).predicted), rel=1e-6)
    # a=1 alone: its quadratic billing and the dropped parameter GET in the formulation.
    q = tiny_problem([[3, 7, 2]], 100.0, bytes_per_token=1_500_000, warm_instances=True)
    q = q.with_slo(_slos(q)[2])  # a=1 alone misses the tighter SLOs here
    res = solve_miqcp(q, [[1]], time_limit_s=120)
    opt = brute_force_optimum(q, [1])
    assert res.layers is not None and res.status == "optimal"
    est = build_plan(q, res.layers, "miqcp")[1]
    assert planned_cost(q, est.as_predicted()) == pytest.approx(opt, rel=1e-6)
