"""Plans the planner accepts run on the backends: eq. 12f at its exact boundary on the aws
backend (moto), and a sweep of token counts x SLOs whose accepted plans run on the local
backend (memory/CPU limits on) and on aws without memory or payload errors."""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
import pytest
import torch

from moefleet.models.base import param_bytes
from moefleet.plan import DeploymentPlan
from moefleet.plan.costmodel import direct_fits, evaluate
from moefleet.plan.problem import PlanningProblem
from moefleet.plan.registry import get_planner
from moefleet.platform import load_platform, open_store
from moefleet.platform.inline import GATE_WEIGHT_BYTES, PACKET_ENVELOPE_BYTES
from moefleet.profiles.footprint import intermediate_per_token, measure_runtime_footprints
from moefleet.runtime.local import LocalBackend
from tests.aws_helpers import moto_aws_backend
from tests.integration.plan_run_helpers import routed_counts, run_plan, tiny_adapter

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@cache
def _model() -> tuple[Any, dict[str, int], int]:
    adapter = tiny_adapter()
    inter = intermediate_per_token(adapter.expert(adapter.moe_layers[0], 0).eval(),
                                   adapter.hidden_size)
    return adapter, measure_runtime_footprints(), inter


def _platform(payload_bytes: int | None = None) -> Any:
    spec = load_platform("aws-lambda")
    if payload_bytes is None:
        return spec
    assert spec.limits is not None
    return spec.model_copy(update={"limits": spec.limits.model_copy(
        update={"sync_payload_bytes": payload_bytes})})


def _problem(platform: Any, counts: np.ndarray, slo_s: float, tokens: int) -> PlanningProblem:
    adapter, footprint, inter = _model()
    layers = list(adapter.moe_layers)
    mem = [1024, 1769, 3008, 5307]
    return PlanningProblem.explicit(
        model="tiny", platform=platform, moe_layers=layers,
        num_experts=[adapter.num_experts(x) for x in layers], num_blocks=adapter.num_layers,
        counts_LE=counts, tokens=tokens,
        expert_param_bytes=[param_bytes(adapter.expert(x, 0)) for x in layers],
        bytes_per_token=adapter.hidden_size * 4, memory_options_mb=mem,
        per_token_s=[2e-4 / platform.vcpus(m) for m in mem], slo_s=slo_s,
        segment_time_s=0.01, segment_param_bytes=1 << 20, top_k=2,
        runtime_bytes=max(footprint.values()), intermediate_bytes_per_token=inter,
        max_replicas=4, extra_per_token_s={
            platform.baseline_memory(): [2e-4 / platform.vcpus(platform.baseline_memory())]
            * len(layers)})


def test_a_direct_plan_at_the_payload_boundary_runs_on_aws(aws_credentials: None) -> None:
    adapter, _, _ = _model()
    torch.manual_seed(1)
    ids_BT = torch.randint(0, 1000, (4, 32))
    counts = routed_counts(adapter, ids_BT)
    per = max(adapter.hidden_size * 4 + GATE_WEIGHT_BYTES, adapter.hidden_size * 4)
    need = int(counts.max()) * per + PACKET_ENVELOPE_BYTES
    limit = -(-need * 4 // 3) + 1024  # the smallest platform limit whose budget holds it
    platform = _platform(limit)
    s = adapter.summary()
    plan = DeploymentPlan.uniform("tiny", platform.name, s.moe_layers, s.num_experts,
                                  s.num_layers, 1769, "direct",
                                  segment_memory_mb=platform.baseline_memory())
    at = _problem(platform, counts, 60.0, int(ids_BT.numel()))
    assert direct_fits(at, int(counts.max())) and evaluate(at, plan).feasible
    below = _problem(_platform(limit - 4), counts, 60.0, int(ids_BT.numel()))
    assert any("12f" in v for v in evaluate(below, plan).violations)  # the boundary is sharp
    backend = moto_aws_backend(platform)
    store = open_store(backend.store_url)
    try:
        res = run_plan(adapter, plan, platform, backend, store, ids_BT)
        biggest = max(r.bytes_in for r in res.records if r.kind == "expert")
        assert biggest <= backend.max_inline_bytes  # sent inline, at most the budget
    finally:
        backend.teardown()


def test_every_accepted_plan_of_a_sweep_runs_on_local_and_aws(tmp_path: Any,
                                                           aws_credentials: None) -> None:
    adapter, _, _ = _model()
    platform = _platform()
    accepted: dict[str, tuple[DeploymentPlan, torch.Tensor]] = {}
    # Token counts x SLOs: the small batch under a loose SLO, the large one under the
    # tightest SLO a plan can meet (5% above the all-maximum-memory LambdaML latency).
    for batch, tight in ((2, False), (8, True)):
        torch.manual_seed(batch)
        ids_BT = torch.randint(0, 1000, (batch, 32))
        loose = _problem(platform, routed_counts(adapter, ids_BT), 60.0, int(ids_BT.numel()))
        slo = evaluate(loose, get_planner("lambdaml").plan(loose)).latency_s * 1.05
        plan = get_planner("ods").plan(loose.with_slo(slo) if tight else loose)
        accepted[f"{batch}-{tight}"] = (plan, ids_BT)
    assert accepted
    local = LocalBackend(platform, store=str(tmp_path / "store"), workers=1, limits=True)
    aws = moto_aws_backend(platform)
    try:
        for backend in (local, aws):
            store = open_store(str(tmp_path / "store") if backend is local else aws.store_url)
            for plan, ids_BT in accepted.values():
                run_plan(adapter, plan, platform, backend, store, ids_BT)
        assert local.stats()["out_of_memory"] == 0
    finally:
        local.teardown()
        aws.teardown()
