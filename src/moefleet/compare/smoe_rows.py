"""sMoE's policies on pod-style expert functions (``scaling="replicas"``: a function has
at most ``replicas`` instances and each call goes whole to one): the trained policy (a
checkpoint exists only for the synthetic 4 x 8 shape it was trained on), HPA,
ElasticMoE, a uniform static plan and static-pop (replicas by predicted popularity);
and the composed policy's simulated row.

Composed, in simulation: Remoe's local/remote split planned on the refined predictions
(ODS/BO's stand-in, :func:`moefleet.compare.ods_rows.refined_routing`), served by the
Remoe simulator whose remote functions start instances on demand. sMoE's scaling of the
remote functions and SALC on the main are in the measured path (compose's engine with a
Remoe plan and a brownout stack), not in the Remoe simulator: the row says so.
"""

from __future__ import annotations

import math

from moefleet.compare.pipeline_common import simulate_plan
from moefleet.compare.rows import Row, absent
from moefleet.compare.scenario import Scenario
from moefleet.control import FunctionConfig
from moefleet.errors import MoefleetError
from moefleet.plan.plan import DeploymentPlan

EXPERT_MB = 2048
REPLICAS = 2


def _plan(sc: Scenario) -> DeploymentPlan:
    d = sc.dims
    seg_mb = max(EXPERT_MB, sc.spec.memory_options_mb()[0])
    return DeploymentPlan.uniform(d.name, sc.spec.name, list(range(d.moe_layers)),
                                  [d.experts] * d.moe_layers, d.moe_layers,
                                  sc.spec.nearest_memory_options(EXPERT_MB)[0]
                                  if not sc.spec.is_valid_memory(EXPERT_MB) else EXPERT_MB,
                                  "direct", replicas=REPLICAS,
                                  segment_memory_mb=seg_mb if sc.spec.is_valid_memory(seg_mb)
                                  else None, policy="static")


def static_pop_initial(sc: Scenario, plan: DeploymentPlan) -> dict[str, FunctionConfig]:
    """Replicas per expert proportional to predicted popularity (same total as the
    uniform plan's, at least one each)."""
    out = {}
    placement = plan.placement()
    for li, lp in enumerate(plan.layers):
        fns = placement.expert_functions(lp.layer)
        total = REPLICAS * len(fns)
        for fn in fns:
            share = float(sc.pred_LE[li, fn.experts[0]])
            r = max(1, math.ceil(share * total))
            out[fn.name] = FunctionConfig(fn.memory_mb, r, 1)
    return out


def smoe_rows(sc: Scenario) -> list[Row]:
    from moefleet.autoscale import make_policy

    plat = sc.spec.name
    rows = [absent("smoe-trained", "smoe", plat,
                   f"no trained sMoE checkpoint for the {sc.model} shape (the checkpoints "
                   "are for the synthetic 4x8 model; train with moefleet autoscale train)")]
    if not sc.spec.is_faas:
        return rows + [absent(p, "smoe", plat, f"{plat} is not serverless")
                       for p in ("smoe-hpa", "smoe-elasticmoe", "smoe-static", "static-pop")]
    for name, pol in (("smoe-hpa", "hpa"), ("smoe-elasticmoe", "elasticmoe"),
                      ("smoe-static", "static"), ("static-pop", "static")):
        cmd = f"moefleet simulate --policy {pol} --scaling replicas --platform {plat}"
        try:
            plan = _plan(sc)
            initial = static_pop_initial(sc, plan) if name == "static-pop" else None
            row = Row(name, "smoe", plat, command=cmd)
            rows.append(simulate_plan(sc, plan, row, policy=make_policy(pol),
                                      scaling="replicas", initial=initial,
                                      pod_mb=plan.layers[0].experts[0].memory_mb,
                                      decode="per-request"))
            row.notes.append("each request runs its own passes through the shared "
                             "functions (sMoE's setting), so replicas carry concurrency")
        except MoefleetError as err:
            rows.append(absent(name, "smoe", plat, err.message, cmd))
    return rows


def composed_row(sc: Scenario) -> Row:
    from moefleet.compare.ods_rows import refined_routing
    from moefleet.compare.remoe_rows import plan_relaxed, problem, simulate_layout

    plat = sc.spec.name
    cmd = (f"moefleet serve --plan remoe.yaml --brownout ways=8,slo-ttft={sc.slo_ttft_s:g},"
           f"slo-tpot={sc.slo_tpot_s:g}")
    if sc.spec.gpu is None:
        return absent("composed", "composed", plat,
                      f"platform {plat} has no GPU functions (the main needs one)", cmd)
    try:
        p = problem(sc, refined_routing(sc))
        res, factor = plan_relaxed(p, "remoe")
    except MoefleetError as err:
        return absent("composed", "composed", plat, err.message, cmd)
    row = Row("composed", "composed", plat, command=cmd)
    if factor > 1:
        row.notes.append(f"planned at SLOs x {factor:g} (infeasible at the SLOs)")
    row.notes.append("simulated as Remoe on refined predictions; sMoE scaling of the remote "
                     "functions and SALC on the main run only in the measured path")
    return simulate_layout(sc, p, res, row)
