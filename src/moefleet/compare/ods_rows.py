"""ODS/BO's policies: LambdaML, ODS on predicted counts, ODS on refined predictions
(standing in for ODS + BO), ODS oracle (the real routing), each planned for the mean
prompt as one batch at the TTFT SLO and simulated serving the whole traffic.

BO refines a fitted token predictor's tables from observed batches; no predictor exists
for these shapes, so "ods-bo" plans on the predictions updated with the routing of the
first 10% of the traffic's prompt tokens (a Dirichlet posterior), and says so.
"""

from __future__ import annotations

import numpy as np

from moefleet.compare.pipeline_common import profile_of, simulate_plan
from moefleet.compare.rows import Row, absent
from moefleet.compare.scenario import Scenario
from moefleet.errors import MoefleetError
from moefleet.plan.plan import DeploymentPlan


def refined_routing(sc: Scenario, share: float = 0.1) -> np.ndarray:
    """Predictions updated with the routing of the first ``share`` of prompt tokens."""
    tokens = int(sc.traffic.prompts[: max(1, int(len(sc.traffic.prompts) * share))].sum())
    rng = np.random.default_rng(sc.seed + 17)
    seen = np.array([rng.multinomial(tokens * sc.dims.top_k, row) for row in sc.real_LE])
    prior = sc.pred_LE * 2048 * sc.dims.top_k
    post = prior + seen
    return post / post.sum(axis=1, keepdims=True)


def _plan(sc: Scenario, planner: str, s_LE: np.ndarray) -> tuple[DeploymentPlan, float]:
    from moefleet.plan.problem import PlanningProblem
    from moefleet.plan.registry import get_planner

    n = sc.n_in
    counts = np.rint(s_LE * n * sc.dims.top_k).astype(np.int64)
    prob = PlanningProblem.from_profile(profile_of(sc), sc.spec, counts, sc.slo_ttft_s,
                                        top_k=sc.dims.top_k, tokens=n)
    factor = 1.0
    for _ in range(6):
        try:
            return get_planner(planner, time_limit_s=20.0).plan(prob), factor
        except MoefleetError:
            factor *= 2
            prob = prob.with_slo(sc.slo_ttft_s * factor)
    raise MoefleetError(f"{planner}: no plan even at the TTFT SLO x {factor / 2:g}",
                        "raise --slo-ttft or use a platform with larger functions")


def ods_rows(sc: Scenario) -> list[Row]:
    rows = []
    plat = sc.spec.name
    if not sc.spec.is_faas:
        return [absent(p, "ods/bo", plat, f"{plat} is not serverless")
                for p in ("lambdaml", "ods-predicted", "ods-bo", "ods-oracle")]
    for name, planner, s_LE in (("lambdaml", "lambdaml", sc.pred_LE),
                                ("ods-predicted", "ods", sc.pred_LE),
                                ("ods-bo", "ods", refined_routing(sc)),
                                ("ods-oracle", "ods", sc.real_LE)):
        cmd = f"moefleet plan --policy {planner} --platform {plat} (then simulate)"
        try:
            plan, factor = _plan(sc, planner, s_LE)
            row = Row(name, "ods/bo", plat, command=cmd)
            if factor > 1:
                row.notes.append(f"planned at the TTFT SLO x {factor:g} (infeasible at it)")
            if name == "ods-bo":
                row.notes.append("BO stand-in: predictions refined with the first 10% of "
                                 "traffic's routing (no token predictor at this shape)")
            rows.append(simulate_plan(sc, plan, row))
        except MoefleetError as err:
            rows.append(absent(name, "ods/bo", plat, err.message, cmd))
    return rows
