"""The executor on the ``ray`` backend: a real MoE model, one Serve application per
function, equals the monolithic model for every scatter-gather method.

One local Ray node (loopback only) and one backend serve the whole module: Ray starts in
~5 s and every replica is a process that imports torch, so the model is deployed once and
the methods differ only in the plan the executor follows (the functions are the same, as
in tests/unit/test_segment_runner.py).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from moefleet.models.hf import HFMoEAdapter
from moefleet.plan import DeploymentPlan
from moefleet.platform import LocalObjectStore, PlatformSpec, load_platform
from moefleet.runtime.deploy import Deployment, deploy_plan
from moefleet.runtime.ray_backend import RayBackend, start_local_ray
from tests.segment_helpers import segment_batches

# Not importorskip: importing ray here would be too early for a loopback-only node.
if importlib.util.find_spec("ray") is None:
    pytest.skip("ray is not installed (pip install 'moefleet[ray]')", allow_module_level=True)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A Ray node for this module; backends use it and leave it running."""
    import ray

    started = start_local_ray()
    try:
        yield
    finally:
        if started:
            from ray import serve

            serve.shutdown()
            ray.shutdown()


@pytest.fixture(scope="module")
def platform() -> PlatformSpec:
    return load_platform("aws-lambda")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> LocalObjectStore:
    return LocalObjectStore(tmp_path_factory.mktemp("store"))


@pytest.fixture(scope="module")
def backend(local_ray: None, platform: PlatformSpec,
            store: LocalObjectStore) -> Iterator[RayBackend]:
    b = RayBackend(platform, store=store)
    try:
        yield b
    finally:
        b.teardown()


@pytest.fixture(scope="module")
def adapter() -> HFMoEAdapter:
    """tiny-mixtral trimmed to 2 blocks of 4 experts (top-2): 10 functions, i.e. 10 replica
    processes, where the full tiny model's 27 take ~80 s to start on 2 cores."""
    from moefleet.models.tiny import small_mixtral

    model = small_mixtral()
    return HFMoEAdapter(model, name="tiny-mixtral-2x4")


def _plan(adapter: HFMoEAdapter, platform: str, method: str) -> DeploymentPlan:
    experts = [adapter.num_experts(layer) for layer in adapter.moe_layers]
    return DeploymentPlan.uniform(adapter.family, platform, adapter.moe_layers, experts,
                                  adapter.num_layers, 512, method=method,  # type: ignore[arg-type]
                                  replicas=1, beta=3)


@pytest.fixture(scope="module")
def deployed(adapter: HFMoEAdapter, platform: PlatformSpec, store: LocalObjectStore,
             backend: RayBackend) -> Deployment:
    return deploy_plan(adapter, _plan(adapter, platform.name, "direct"), platform, store,
                       backend=backend)


@pytest.mark.parametrize("method", ["direct", "storage", "pipelined"])
def test_outputs_equal_the_monolithic_model(
    method: str, adapter: HFMoEAdapter, platform: PlatformSpec, store: LocalObjectStore,
    backend: RayBackend, deployed: Deployment,
) -> None:
    dep = replace(deployed, plan=_plan(adapter, platform.name, method))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # right padding, as the runner batches
    with segment_batches(adapter, dep, platform, backend, store) as ex:
        res = ex.run_batch(ids, mask, ["a", "b"])
    diff = ((res.output - adapter.reference_forward(ids, mask))[mask.bool()])
    assert diff.abs().max() <= 1e-4  # real tokens (padding skips the experts)
    N, K = int(mask.sum()), adapter.top_k  # padding never reaches an expert
    assert all(s.token_slots == N * K and s.method == method for s in res.layers)
    experts = [r for r in res.records if r.kind == "expert"]
    assert experts and len(experts) == sum(s.invocations for s in res.layers)
    if method == "direct":
        assert all(r.storage_puts == 0 for r in res.records)
    else:
        assert all(r.storage_gets >= 1 and r.storage_puts >= 1 for r in experts)
    assert not [k for k in store.list(dep.prefix + "/") if "/runs/" in k]  # cleaned up
    billed = backend.records()
    assert all(r in billed for r in res.records)
