"""Contract of Planner, checked for every registered policy.

A planner returns a plan that (1) is feasible under the analytical model and carries
that model's cost/latency in ``predicted``, (2) fits the model and the platform
(``check_model``/``check_platform``) and round-trips through YAML, (3) is the same for the
same seed, and (4) an SLO no plan can meet raises InfeasibleError naming the fastest plan.
"""

from __future__ import annotations

import dataclasses

import pytest

from moefleet.plan import (
    DeploymentPlan,
    InfeasibleError,
    PlanningProblem,
    evaluate,
    get_planner,
    planner_names,
)
from moefleet.plan.base import Frontiers
from tests.plan_helpers import tiny_problem

POLICIES = planner_names()


@pytest.fixture(scope="module")
def problem() -> PlanningProblem:
    # Two MoE layers of two experts over three blocks; layer 2 is the last block. Tokens
    # of 400 kB: direct invocation fits the payload only up to 15 tokens per replica.
    p = tiny_problem([[9, 3], [20, 0]], 100.0, bytes_per_token=400_000)
    p = PlanningProblem.explicit(
        model="tiny3", platform=p.platform, moe_layers=[0, 2], num_experts=[2, 2],
        num_blocks=3, counts_LE=p.counts_LE, expert_param_bytes=20_000_000,
        bytes_per_token=400_000, memory_options_mb=p.memory_options_mb,
        per_token_s=p.per_token_s_LJ, slo_s=100.0, segment_time_s=[0.5, 0.3, 0.4],
        segment_param_bytes=[9_000_000, 5_000_000, 7_000_000], max_replicas=2,
        extra_per_token_s=p.extra_per_token_s,
    )
    fastest = Frontiers(p)
    fastest.check_feasible()
    return p.with_slo(20.0)  # loose enough for the LambdaML baseline too


def _stable(plan: DeploymentPlan) -> dict:  # type: ignore[type-arg]
    d = plan.model_dump(mode="json")
    d["predicted"].pop("solve_s", None)  # wall time of the solve
    return d


@pytest.mark.parametrize("policy", POLICIES)
def test_plan_is_feasible_and_predicted(policy: str, problem: PlanningProblem) -> None:
    plan = get_planner(policy, time_limit_s=60).plan(problem, seed=0)
    est = evaluate(problem, plan)
    assert est.feasible, est.violations
    assert plan.policy == policy
    assert plan.predicted["cost_usd"] == pytest.approx(est.cost_usd, rel=1e-12)
    assert plan.predicted["latency_s"] == pytest.approx(est.latency_s, rel=1e-12)
    assert plan.predicted["latency_s"] <= problem.slo_s
    assert plan.predicted["slo_s"] == problem.slo_s


@pytest.mark.parametrize("policy", POLICIES)
def test_plan_fits_model_and_platform_and_round_trips(
    policy: str, problem: PlanningProblem
) -> None:
    plan = get_planner(policy, time_limit_s=60).plan(problem, seed=0)
    plan.check_model([0, 2], [2, 2], 3)
    plan.check_platform(problem.platform)
    assert plan.model == "tiny3" and plan.platform == problem.platform.name
    assert DeploymentPlan.from_yaml(plan.to_yaml()) == plan


@pytest.mark.parametrize("policy", POLICIES)
def test_same_seed_same_plan(policy: str, problem: PlanningProblem) -> None:
    planner = get_planner(policy, time_limit_s=60)
    assert _stable(planner.plan(problem, seed=7)) == _stable(planner.plan(problem, seed=7))


@pytest.mark.parametrize("policy", POLICIES)
def test_infeasible_slo_is_a_clear_error(policy: str, problem: PlanningProblem) -> None:
    with pytest.raises(InfeasibleError) as err:
        get_planner(policy, time_limit_s=60).plan(problem.with_slo(1.0), seed=0)
    msg = err.value.message
    assert msg.startswith("infeasible: the fastest plan takes") and "binding:" in msg
    assert "SLO is 1 s" in msg
    assert "raise the SLO" in err.value.hint


@pytest.mark.parametrize("policy", POLICIES)
def test_warm_instances_plan_is_feasible_and_says_so(
    policy: str, problem: PlanningProblem
) -> None:
    # The opt-in warm-instances variant: the same contract, predicted from the same model,
    # and the plan's meta records the variant it was priced under.
    warm = dataclasses.replace(problem, warm_instances=True)
    plan = get_planner(policy, time_limit_s=60).plan(warm, seed=0)
    est = evaluate(warm, plan)
    assert est.feasible, est.violations
    assert plan.predicted["cost_usd"] == pytest.approx(est.cost_usd, rel=1e-12)
    assert plan.predicted["latency_s"] == pytest.approx(est.latency_s, rel=1e-12)
    assert plan.meta["warm_instances"] is True
    # Re-priced under the paper's model the same plan costs at least as much.
    assert evaluate(problem, plan).cost_usd >= est.cost_usd
