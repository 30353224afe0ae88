"""RemoteExperts: the ExpertFn over a deployment's expert functions (local backend).

It must equal the in-process experts for every scatter-gather method, skip slots masked
with -1, refuse experts no function holds, attribute every invocation to the token rows'
owners, and drive the engine to the same greedy tokens as in-process experts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from moefleet.engine import SamplingParams
from moefleet.experts.kernels import in_process_experts
from moefleet.experts.remote import RemoteExperts
from moefleet.models.hf import HFMoEAdapter
from moefleet.models.tiny import tiny_model
from moefleet.plan import DeploymentPlan
from moefleet.platform import LocalObjectStore, PlatformSpec, load_platform
from moefleet.runtime import GatherError
from moefleet.runtime.calls import ExpertDirect
from moefleet.runtime.deploy import Deployment, deploy_plan
from moefleet.runtime.handlers import CallContext, InitContext, expert_handler
from moefleet.runtime.local import LocalBackend
from moefleet.runtime.messages import encode
from moefleet.runtime.payload import pack, unpack
from tests.engine_helpers import build_engine

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def platform() -> PlatformSpec:
    return load_platform("aws-lambda")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> LocalObjectStore:
    return LocalObjectStore(tmp_path_factory.mktemp("rx-store"))


@pytest.fixture(scope="module")
def backend(platform: PlatformSpec, store: LocalObjectStore) -> Iterator[LocalBackend]:
    b = LocalBackend(platform, store=store, workers=2)
    try:
        yield b
    finally:
        b.teardown()


@pytest.fixture(scope="module")
def adapter() -> HFMoEAdapter:
    return HFMoEAdapter(tiny_model("mixtral"))


def _plan(adapter: HFMoEAdapter, platform: str, method: str) -> DeploymentPlan:
    experts = [adapter.num_experts(layer) for layer in adapter.moe_layers]
    return DeploymentPlan.uniform(adapter.family, platform, adapter.moe_layers, experts,
                                  adapter.num_layers, 512, method=method,  # type: ignore[arg-type]
                                  replicas=2, beta=3)


@pytest.fixture(scope="module")
def deployments(adapter: HFMoEAdapter, platform: PlatformSpec, store: LocalObjectStore,
                backend: LocalBackend) -> dict[str, Deployment]:
    # The functions are the same for every method; only the plan RemoteExperts follows
    # differs, so one deployment per method shares warm instances through the namespace.
    direct = deploy_plan(adapter, _plan(adapter, platform.name, "direct"), platform, store,
                         backend=backend, namespace="rx.")
    out = {"direct": direct}
    for method in ("storage", "pipelined"):
        d = Deployment.from_dict(direct.to_dict())
        d.plan = _plan(adapter, platform.name, method)
        out[method] = d
    return out


def _routed(adapter: HFMoEAdapter, layer: int, n: int = 13, seed: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x_ND = torch.randn(n, adapter.hidden_size, generator=g)
    with torch.no_grad():
        ids_NK, w_NK = adapter.route(layer, x_ND)
    return x_ND, ids_NK, w_NK


@pytest.mark.parametrize("method", ["direct", "storage", "pipelined"])
def test_equals_the_in_process_experts(method: str, adapter: HFMoEAdapter,
                                       deployments: dict[str, Deployment],
                                       backend: LocalBackend, store: LocalObjectStore) -> None:
    layer = adapter.moe_layers[0]
    x_ND, ids_NK, w_NK = _routed(adapter, layer)
    want = in_process_experts(adapter, "loop")(layer, x_ND, ids_NK, w_NK)
    with RemoteExperts(deployments[method], backend, store) as rx:
        got = rx(layer, x_ND, ids_NK, w_NK)
        records = rx.drain()
        assert rx.stats[layer].token_slots == ids_NK.numel()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert records and all(shares == {"-": 1.0} for _, shares in records)
    assert not store.list(f"{deployments[method].prefix}/rx/")  # transfers cleaned up


def test_masked_slots_are_skipped(adapter: HFMoEAdapter, deployments: dict[str, Deployment],
                                  backend: LocalBackend, store: LocalObjectStore) -> None:
    layer = adapter.moe_layers[0]
    x_ND, ids_NK, w_NK = _routed(adapter, layer, seed=1)
    masked = ids_NK.clone()
    masked[ids_NK == 0] = -1  # expert 0 stays "local": its slots must add nothing here
    want = in_process_experts(adapter, "loop")(
        layer, x_ND, ids_NK, w_NK.masked_fill(ids_NK == 0, 0))
    with RemoteExperts(deployments["direct"], backend, store) as rx:
        got = rx(layer, x_ND, masked, w_NK)
        assert rx.stats[layer].token_slots == int((masked >= 0).sum())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_owners_split_every_invocation(adapter: HFMoEAdapter,
                                       deployments: dict[str, Deployment],
                                       backend: LocalBackend, store: LocalObjectStore) -> None:
    layer = adapter.moe_layers[0]
    x_ND, ids_NK, w_NK = _routed(adapter, layer, n=6, seed=2)
    with RemoteExperts(deployments["direct"], backend, store) as rx:
        rx.set_owners(["a"] * 4 + ["b"] * 2)
        rx(layer, x_ND, ids_NK, w_NK)
        records = rx.drain()
        assert rx.drain() == []
        with pytest.raises(ValueError, match="owners"):
            rx(layer, x_ND[:5], ids_NK[:5], w_NK[:5])
    assert records
    for _, shares in records:
        assert set(shares) <= {"a", "b"} and sum(shares.values()) == pytest.approx(1.0)
    owners = {o for _, shares in records for o in shares}
    assert owners == {"a", "b"}


def test_refuses_experts_no_function_holds(adapter: HFMoEAdapter,
                                           deployments: dict[str, Deployment],
                                           backend: LocalBackend,
                                           store: LocalObjectStore) -> None:
    layer = adapter.moe_layers[0]
    x_ND, ids_NK, w_NK = _routed(adapter, layer)
    with (RemoteExperts(deployments["direct"], backend, store) as rx,
          pytest.raises(GatherError, match="no expert functions for layer 99")):
        rx(99, x_ND, ids_NK, w_NK)


def test_group_function_runs_several_experts_in_one_call(
        adapter: HFMoEAdapter, deployments: dict[str, Deployment],
        store: LocalObjectStore) -> None:
    """The direct message for a replica of a group function: rows of several experts back
    to back, one count per expert (what RemoteExperts sends a Remoe group)."""
    dep = deployments["direct"]
    layer = adapter.moe_layers[0]
    handler = expert_handler(
        {"layer": layer, "skeleton": dep.layout.skeleton,
         "weights": {str(e): dep.layout.expert_key(layer, e) for e in (0, 1)}},
        InitContext("group", 4096, 1, store))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, adapter.hidden_size, generator=g)
    w = torch.rand(5, generator=g)
    body = pack({"x": x, "w": w}, encode(ExpertDirect(((0, 2), (1, 3)))))
    y = unpack(handler(body, CallContext("group", None, store, 1 << 20))).tensors["y"]
    fn = in_process_experts(adapter, "loop")
    ids = torch.tensor([[0], [0], [1], [1], [1]])
    torch.testing.assert_close(y, fn(layer, x, ids, w[:, None]), rtol=1e-5, atol=1e-5)
    bad = pack({"x": x, "w": w}, encode(ExpertDirect(((0, 2),))))
    with pytest.raises(Exception, match="cover 2 of 5 rows"):
        handler(bad, CallContext("group", None, store, 1 << 20))


def test_engine_through_remote_experts_matches_in_process(
        adapter: HFMoEAdapter, deployments: dict[str, Deployment], backend: LocalBackend,
        store: LocalObjectStore) -> None:
    prompts = [[5, 17, 42, 7, 99, 3], [8, 1, 250], [60, 61, 62, 63]]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    want = build_engine(adapter).generate(prompts, params)
    with RemoteExperts(deployments["storage"], backend, store) as rx:
        engine = build_engine(adapter, experts=rx)
        seen: dict[str, str | None] = {}
        got = engine.generate(prompts, params)
        for _, shares in rx.drain():
            for owner in shares:
                seen[owner] = owner
    assert [o.new_token_ids for o in got] == [o.new_token_ids for o in want]
    assert len(seen) == len(prompts)  # every sequence's tokens reached the functions
