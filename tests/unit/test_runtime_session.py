"""The deploy -> run -> teardown lifecycle (runtime.session) on the local backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from moefleet.models.hf import HFMoEAdapter
from moefleet.models.tiny import tiny_model
from moefleet.plan import DeploymentPlan
from moefleet.platform import LocalObjectStore, load_platform
from moefleet.runtime.deploy import Deployment
from moefleet.runtime.session import Session, deploy, open_deployment

pytestmark = pytest.mark.timeout(180)


def _setup(tmp_path: Path) -> tuple[HFMoEAdapter, DeploymentPlan, LocalObjectStore]:
    adapter = HFMoEAdapter(tiny_model("mixtral"))
    s = adapter.summary()
    plan = DeploymentPlan.uniform("tiny", "aws-lambda", s.moe_layers, s.num_experts,
                                  s.num_layers, 512, "direct")
    return adapter, plan, LocalObjectStore(tmp_path / "store")


def test_a_session_on_an_existing_deployment_keeps_its_weights(tmp_path: Path) -> None:
    # running a plan end to end (run_plan) is covered by moefleet run's tests
    adapter, plan, store = _setup(tmp_path)
    platform = load_platform("aws-lambda")
    dep = deploy(plan, adapter, platform, store)
    with open_deployment(dep, platform=platform, store=store,
                         backend_options={"workers": 1}) as session:
        assert session.deployment is dep
    assert store.list(dep.prefix + "/")  # not this session's to remove


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
    dep = deploy(plan, adapter, load_platform("aws-lambda"), store)
    old = dep.to_dict()
    shape = old.pop("shape")
    old["structure"] = {k: shape[k] for k in ("name", "family", "num_layers", "moe_layers",
                                              "num_experts", "top_k", "hidden_size")}
    back = Deployment.from_dict(old)
    assert (back.num_layers, back.moe_layers, back.top_k) == (
        dep.num_layers, dep.moe_layers, dep.top_k)
    assert back.placement.names == dep.placement.names
