"""The deploy -> use -> teardown lifecycle of the composition root (``open_engine`` over
``runtime.lifecycle``) on the local backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from moefleet.compose import OpenedEngine, open_engine
from moefleet.models.hf import HFMoEAdapter
from moefleet.models.tiny import tiny_model
from moefleet.plan import DeploymentPlan
from moefleet.platform import LocalObjectStore, load_platform
from moefleet.runtime.deploy import Deployment
from moefleet.runtime.lifecycle import deploy

pytestmark = pytest.mark.timeout(180)


def _setup(tmp_path: Path) -> tuple[HFMoEAdapter, DeploymentPlan, LocalObjectStore]:
    adapter = HFMoEAdapter(tiny_model("mixtral"))
    s = adapter.summary()
    plan = DeploymentPlan.uniform(adapter.name, "aws-lambda", s.moe_layers, s.num_experts,
                                  s.num_layers, 512, "direct")
    return adapter, plan, LocalObjectStore(tmp_path / "store")


def test_a_session_on_an_existing_deployment_keeps_its_weights(tmp_path: Path) -> None:
    # running a plan end to end (run_plan) is covered by moefleet run's tests
    adapter, plan, store = _setup(tmp_path)
    platform = load_platform("aws-lambda")
    dep = deploy(plan, adapter, platform, store)
    with open_engine(adapter, plan=dep, platform=platform, store=store,
                     backend_options={"workers": 1}) as opened:
        assert opened.deployment is dep
    assert store.list(dep.prefix + "/")  # not this session's to remove


def test_an_error_inside_the_session_still_tears_down(tmp_path: Path) -> None:
    adapter, plan, store = _setup(tmp_path)
    platform = load_platform("aws-lambda")
    seen: list[OpenedEngine] = []
    with pytest.raises(RuntimeError, match="boom"), open_engine(
            adapter, plan=plan, platform=platform, store=store,
            backend_options={"workers": 1}) as opened:
        seen.append(opened)
        assert opened.backend is not None
        # the in-process runner: only the expert functions exist (no segments to call)
        assert set(opened.backend.functions()) == {
            f.name for f in plan.placement().functions if f.role == "expert"}
        assert store.list("")  # weights are up while the session lives
        raise RuntimeError("boom")
    assert store.list("") == []
    with pytest.raises(Exception, match=r"torn down|closed"):
        backend = seen[0].backend
        assert backend is not None
        backend.invoke("exp-1-0", b"")


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
