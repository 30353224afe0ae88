"""The segment runner (ODS/BO's layout: non-experts in segment functions) on the local
backend, through the composition root: equals the monolithic model for every method,
accounts for every token, prices and attributes cost, and fails clearly."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moefleet.compose import open_engine
from moefleet.compose.score import score, score_options
from moefleet.errors import MoefleetError
from moefleet.experts.remote import RemoteExperts
from moefleet.models.hf import HFMoEAdapter
from moefleet.models.tiny import tiny_model
from moefleet.plan import DeploymentPlan, PlanError
from moefleet.platform import LocalObjectStore, PlatformSpec, load_platform
from moefleet.runtime import FunctionError
from moefleet.runtime.deploy import Deployment, deploy_plan, install
from moefleet.runtime.local import LocalBackend
from tests.segment_helpers import segment_batches

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def platform() -> PlatformSpec:
    return load_platform("aws-lambda")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> LocalObjectStore:
    return LocalObjectStore(tmp_path_factory.mktemp("store"))


@pytest.fixture(scope="module")
def backend(platform: PlatformSpec, store: LocalObjectStore) -> Iterator[LocalBackend]:
    b = LocalBackend(platform, store=store, workers=2)
    try:
        yield b
    finally:
        b.teardown()


@pytest.fixture(scope="module")
def adapters() -> dict[str, HFMoEAdapter]:
    return {f: HFMoEAdapter(tiny_model(f)) for f in ("mixtral", "deepseek_v2")}


def _plan(adapter: HFMoEAdapter, platform: str, method: str, replicas: int = 2,
          beta: int = 3) -> DeploymentPlan:
    experts = [adapter.num_experts(layer) for layer in adapter.moe_layers]
    return DeploymentPlan.uniform(adapter.family, platform, adapter.moe_layers, experts,
                                  adapter.num_layers, 512, method=method,  # type: ignore[arg-type]
                                  replicas=replicas, beta=beta)


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 6:] = 0  # right padding, as the runner batches
    return ids, mask


@pytest.fixture(scope="module")
def deployed(adapters: dict[str, HFMoEAdapter], platform: PlatformSpec,
             store: LocalObjectStore, backend: LocalBackend) -> dict[str, Deployment]:
    """One deployment per family; methods differ only in the plan the executor follows
    (the functions are the same), so instances stay warm across the method tests."""
    return {f: deploy_plan(a, _plan(a, platform.name, "direct"), platform, store,
                           backend=backend, namespace=f"{f}.") for f, a in adapters.items()}


@pytest.mark.parametrize("method", ["direct", "storage", "pipelined"])
@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2"])
def test_outputs_equal_the_monolithic_model(
    family: str, method: str, adapters: dict[str, HFMoEAdapter], platform: PlatformSpec,
    store: LocalObjectStore, backend: LocalBackend, deployed: dict[str, Deployment],
) -> None:
    adapter = adapters[family]
    dep = replace(deployed[family], plan=_plan(adapter, platform.name, method))
    ids, mask = _batch()
    with segment_batches(adapter, dep, platform, backend, store) as ex:
        res = ex.run_batch(ids, mask, ["a", "b", "c"])
    diff = ((res.output - adapter.reference_forward(ids, mask))[mask.bool()])
    assert diff.abs().max() <= 1e-4  # real tokens (padding skips the experts)
    assert all(r.function.startswith(f"{family}.") for r in res.records)
    N, K = int(mask.sum()), adapter.top_k  # padding never reaches an expert
    assert [s.layer for s in res.layers] == adapter.moe_layers
    assert all(s.token_slots == N * K for s in res.layers)  # every real token-slot, once
    assert all(s.method == method and s.moe_s > 0 for s in res.layers)
    experts = [r for r in res.records if r.kind == "expert"]
    assert len(experts) == sum(s.invocations for s in res.layers)
    assert all(r.expert is not None and r.layer in adapter.moe_layers for r in experts)
    if method == "direct":
        assert all(r.storage_puts == 0 for r in res.records)
    else:
        assert all(r.storage_gets >= 1 and r.storage_puts >= 1 for r in experts)
    assert not [k for k in store.list(dep.prefix + "/") if "/runs/" in k]  # cleaned up


def test_run_workload_prices_and_attributes_cost(
    adapters: dict[str, HFMoEAdapter], platform: PlatformSpec, store: LocalObjectStore,
    backend: LocalBackend,
) -> None:
    adapter = adapters["mixtral"]
    dep = deploy_plan(adapter, _plan(adapter, platform.name, "pipelined", replicas=1),
                      platform, store, backend=backend)
    prompts = []
    for seed in range(2):
        ids, mask = _batch(seed)
        prompts += [(f"r{seed}-{b}", ids[b, : int(mask[b].sum())].tolist()) for b in range(3)]
    with open_engine(adapter, plan=dep, backend=backend, store=store, platform=platform,
                     options=score_options(3, 9)) as opened:
        summary = score(opened, prompts, reference=adapter)
    assert summary["max_abs_diff"] <= 1e-4
    cost = summary["cost_usd"]
    assert cost["total"] > 0 and cost["storage"] > 0
    assert sum(summary["by_request"].values()) == pytest.approx(cost["total"], rel=1e-9)
    assert set(summary["by_request"]) == {f"r{s}-{b}" for s in range(2) for b in range(3)}
    assert summary["tokens"] == 2 * (27 - 3)
    assert [row["layer"] for row in summary["layers"]] == [0, 1, 2]
    functions = [f for f in summary["bill"]["by_function"] if not f.startswith("<")]
    assert summary["cold_starts"] >= len(functions) >= 3  # each function started cold once
    assert sum(cost["by_layer"].values()) <= cost["total"]


def test_bert_moe_family_runs_too(platform: PlatformSpec, store: LocalObjectStore,
                                  backend: LocalBackend) -> None:
    from tests.unit.test_runtime_weights import tiny_bert_moe

    adapter = tiny_bert_moe()
    plan = DeploymentPlan.uniform("tiny-bert-moe", platform.name, [0, 1], [4, 4], 2, 256,
                                  method="storage", replicas=2)
    dep = deploy_plan(adapter, plan, platform, store, backend=backend, namespace="bert.")
    ids = torch.randint(0, 120, (2, 6))
    with segment_batches(adapter, dep, platform, backend, store) as ex:
        out = ex.run_batch(ids).output
    assert (out - adapter.reference_forward(ids)).abs().max() <= 1e-4


def test_deployment_json_roundtrip_and_reinstall(
    adapters: dict[str, HFMoEAdapter], platform: PlatformSpec, store: LocalObjectStore,
    tmp_path: Path,
) -> None:
    adapter = adapters["deepseek_v2"]
    dep = deploy_plan(adapter, _plan(adapter, platform.name, "storage"), platform, store)
    loaded = Deployment.load(dep.save(tmp_path / "dep.json"))
    assert loaded.to_dict() == dep.to_dict()
    fresh = LocalBackend(platform, store=store.url, workers=1)
    try:
        install(loaded, fresh)
        ids, mask = _batch(1)
        with segment_batches(adapter, loaded, platform, fresh, store) as ex:
            out = ex.run_batch(ids, mask).output
        diff = ((out - adapter.reference_forward(ids, mask))[mask.bool()])
        assert diff.abs().max() <= 1e-4  # real tokens (padding skips the experts)
    finally:
        fresh.teardown()


def test_plans_are_checked_against_model_and_platform(
    adapters: dict[str, HFMoEAdapter], platform: PlatformSpec, store: LocalObjectStore,
    backend: LocalBackend,
) -> None:
    adapter = adapters["mixtral"]
    with pytest.raises(PlanError, match="made for platform"):
        deploy_plan(adapter, _plan(adapter, "gcp-cloud-run-functions", "direct"), platform,
                    store)
    bad = _plan(adapter, platform.name, "direct")
    bad.layers[0].experts.pop()
    with pytest.raises(PlanError, match="7 experts"):
        deploy_plan(adapter, bad, platform, store)
    dep = deploy_plan(adapter, _plan(adapter, platform.name, "storage"), platform, store)
    with pytest.raises(FunctionError, match=r"layers \[0, 1, 2\] pass tokens through"):
        RemoteExperts(dep, backend, None)


def test_small_payload_limit_spills_segments_and_refuses_direct(
    adapters: dict[str, HFMoEAdapter], platform: PlatformSpec, store: LocalObjectStore,
) -> None:
    assert platform.limits is not None
    small = platform.model_copy(
        update={"limits": platform.limits.model_copy(update={"sync_payload_bytes": 12_000})})
    adapter = adapters["mixtral"]
    b = LocalBackend(small, store=store, workers=2)
    try:
        ids, mask = _batch(2)
        dep = deploy_plan(adapter, _plan(adapter, small.name, "storage"), small, store,
                          backend=b)
        with segment_batches(adapter, dep, small, b, store) as ex:
            res = ex.run_batch(ids, mask)
        diff = ((res.output - adapter.reference_forward(ids, mask))[mask.bool()])
        assert diff.abs().max() <= 1e-4  # real tokens (padding skips the experts)
        assert max(r.bytes_in for r in res.records) <= 12_000  # big tensors went by store
        # A direct share bigger than the payload (the plan undercounted the expert) goes
        # as several invocations of its replica, each under the limit, each billed.
        dep = deploy_plan(adapter, _plan(adapter, small.name, "direct", replicas=1), small,
                          store, backend=b)
        big = torch.randint(0, 1000, (4, 40))
        with segment_batches(adapter, dep, small, b, store) as ex:
            res = ex.run_batch(big)
            assert ex.oversize_splits > 0
        diff = res.output - adapter.reference_forward(big, torch.ones_like(big))
        assert diff.abs().max() <= 1e-4
        expert_in = [r.bytes_in for r in res.records if r.kind == "expert"]
        assert expert_in and max(expert_in) <= 12_000
    finally:
        b.teardown()


def test_missing_weights_name_the_object(
    adapters: dict[str, HFMoEAdapter], platform: PlatformSpec, store: LocalObjectStore,
    backend: LocalBackend,
) -> None:
    adapter = adapters["mixtral"]
    dep = deploy_plan(adapter, _plan(adapter, platform.name, "direct", replicas=1), platform,
                      store, backend=backend)
    key = dep.layout.segments[1]
    store.delete(key)
    with segment_batches(adapter, dep, platform, backend, store) as ex, pytest.raises(
            MoefleetError, match=f"HandlerError: seg-1: init failed.*{key}") as info:
        ex.run_batch(*_batch())
    assert "deploy the model again" in str(info.value)  # the hint travels with the error


@pytest.mark.parametrize("fail_first,recovers", [(1, True), (-1, False)])
def test_storage_faults_in_functions(
    fail_first: int, recovers: bool, adapters: dict[str, HFMoEAdapter],
    platform: PlatformSpec, store: LocalObjectStore,
) -> None:
    adapter = adapters["mixtral"]
    wrap = ("moefleet.runtime.stores:faulty",
            {"ops": ["get"], "match": "/out-", "fail_first": fail_first})
    b = LocalBackend(platform, store=store, workers=1, store_wrap=wrap)
    try:
        dep = deploy_plan(adapter, _plan(adapter, platform.name, "storage", replicas=1),
                          platform, store, backend=b)
        ids, mask = _batch()
        with segment_batches(adapter, dep, platform, b, store) as ex:
            if recovers:
                out = ex.run_batch(ids, mask).output
                diff = ((out - adapter.reference_forward(ids, mask))[mask.bool()])
                assert diff.abs().max() <= 1e-4  # real tokens (padding skips the experts)
            else:
                with pytest.raises(MoefleetError, match=r"seg-0: run failed: StorageError: "
                                                       r"GET '.*/out-0' failed 3 times"):
                    ex.run_batch(ids, mask)
        assert not [k for k in store.list(dep.prefix + "/") if "/runs/" in k]
    finally:
        b.teardown()


def test_pipelined_experts_start_while_the_gate_still_uploads(
    adapters: dict[str, HFMoEAdapter], platform: PlatformSpec, tmp_path: Path,
) -> None:
    # ODS/BO's pipelined method overlaps the gate's uploads with the experts: with an
    # S3-like store latency (30 ms a request) the gate needs several rounds of 8 parallel
    # PUTs for beta=1 minibatches, and every layer's first expert starts before it ends.
    adapter = adapters["mixtral"]
    store = LocalObjectStore(tmp_path / "store")
    b = LocalBackend(platform, store=store, workers=3, store_latency=(0.03, 1e9))
    try:
        dep = deploy_plan(adapter, _plan(adapter, platform.name, "pipelined", replicas=1,
                                         beta=1), platform, store, backend=b)
        ids, mask = _batch(1)
        with segment_batches(adapter, dep, platform, b, store) as ex:
            res = ex.run_batch(ids, mask, ["a", "b", "c"])
    finally:
        b.teardown()
    diff = ((res.output - adapter.reference_forward(ids, mask))[mask.bool()])
    assert diff.abs().max() <= 1e-4  # real tokens (padding skips the experts)
    for layer in adapter.moe_layers:
        gate = min((r for r in res.records if r.kind != "expert" and r.layer == layer),
                   key=lambda r: r.start_s)
        first = min(r.start_s for r in res.records if r.kind == "expert" and r.layer == layer)
        assert first < gate.end_s, layer
