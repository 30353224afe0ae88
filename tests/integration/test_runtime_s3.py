"""The runtime against S3 (moto's server on 127.0.0.1): weights and tensors via S3."""

from __future__ import annotations

import pytest
import torch

from moefleet.models.hf import HFMoEAdapter
from moefleet.models.tiny import tiny_model
from moefleet.plan import DeploymentPlan
from moefleet.platform import load_platform, open_store
from moefleet.runtime.deploy import deploy_plan, remove_objects
from moefleet.runtime.local import LocalBackend
from tests.segment_helpers import segment_batches

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_pipelined_layer_through_s3(moto_endpoint: str, aws_credentials: None) -> None:
    platform = load_platform("aws-lambda")
    store = open_store(f"s3://moefleet-runtime/it?endpoint={moto_endpoint}&create=1")
    adapter = HFMoEAdapter(tiny_model("mixtral"))
    plan = DeploymentPlan.uniform("tiny", platform.name, adapter.moe_layers,
                                  [8] * len(adapter.moe_layers), adapter.num_layers, 512,
                                  method="pipelined", replicas=1, beta=4)
    # The backend starts after the credentials fixture: workers inherit the environment.
    backend = LocalBackend(platform, store=store, workers=2)
    try:
        dep = deploy_plan(adapter, plan, platform, store, backend=backend)
        assert store.exists(dep.layout.expert_key(1, 3))
        ids = torch.randint(0, 1000, (2, 5))
        with segment_batches(adapter, dep, platform, backend, store) as ex:
            res = ex.run_batch(ids)
        assert (res.output - adapter.reference_forward(ids)).abs().max() <= 1e-4
        experts = [r for r in res.records if r.kind == "expert"]
        assert experts and all(r.storage_gets >= 1 and r.storage_puts >= 1 for r in experts)
        assert not [k for k in store.list(dep.prefix + "/") if "/runs/" in k]
    finally:
        backend.teardown()
    assert remove_objects(dep, store) == 1 + 3 + 24
