"""The deploy -> run -> teardown lifecycle (runtime.session) on the local backend."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moefleet.models.hf import HFMoEAdapter
from moefleet.models.tiny import tiny_model
from moefleet.plan import DeploymentPlan
from moefleet.platform import LocalObjectStore, load_platform
from moefleet.runtime.deploy import Deployment
from moefleet.runtime.session import Session, open_deployment, run_plan

pytestmark = pytest.mark.timeout(180)


def _setup(tmp_path: Path) -> tuple[HFMoEAdapter, DeploymentPlan, LocalObjectStore]:
    adapter = HFMoEAdapter(tiny_model("mixtral"))
    s = adapter.summary()
    plan = DeploymentPlan.uniform("tiny", "aws-lambda", s.moe_layers, s.num_experts,
                                  s.num_layers, 512, "direct")
    return adapter, plan, LocalObjectStore(tmp_path / "store")


def test_run_plan_equals_the_model_and_leaves_nothing(tmp_path: Path) -> None:
    adapter, plan, store = _setup(tmp_path)
    ids = torch.randint(0, 1000, (2, 6), generator=torch.Generator().manual_seed(0))
    batches = [(ids, torch.ones_like(ids), ["a", "b"])]
    out = run_plan(plan, batches, platform=load_platform("aws-lambda"), store=store,
                   adapter=adapter, backend_options={"workers": 1}, reference=adapter)
    assert out["tokens"] == 12 and out["max_abs_diff"] <= 1e-4
    assert store.list("") == []  # the weights it uploaded are gone again


def test_an_error_inside_the_session_still_tears_down(tmp_path: Path) -> None:
    adapter, plan, store = _setup(tmp_path)
    platform = load_platform("aws-lambda")
    seen: list[Session] = []
    with pytest.raises(RuntimeError, match="boom"), open_deployment(
            plan, platform=platform, store=store, adapter=adapter,
            backend_options={"workers": 1}) as session:
        seen.append(session)
        assert set(session.backend.functions()) == set(plan.placement().names)
        assert store.list("")  # weights are up while the session lives
        raise RuntimeError("boom")
    assert store.list("") == []
    with pytest.raises(Exception, match=r"torn down|closed"):
        seen[0].backend.invoke("seg-0", b"")


def test_deployments_saved_before_model_shape_still_load(tmp_path: Path) -> None:
    adapter, plan, store = _setup(tmp_path)
    from moefleet.runtime.session import deploy

    dep = deploy(plan, adapter, load_platform("aws-lambda"), store)
    old = dep.to_dict()
    shape = old.pop("shape")
    old["structure"] = {k: shape[k] for k in ("name", "family", "num_layers", "moe_layers",
                                              "num_experts", "top_k", "hidden_size")}
    back = Deployment.from_dict(old)
    assert (back.num_layers, back.moe_layers, back.top_k) == (
        dep.num_layers, dep.moe_layers, dep.top_k)
    assert back.placement.names == dep.placement.names
