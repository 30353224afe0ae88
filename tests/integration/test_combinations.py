"""Every deployment is one engine, and the systems combine: plan (none, ODS/BO, Remoe) x
brownout (off, a fixed threshold, SALC) x faults (off, crash, timeout, throttle) on the
local backend, and a subset on ray and on aws (moto). Each combination, opened by the
composition root, generates for the same prompts and must:

- lose nothing accepted: every request finishes, none with an error (the faults here are
  transient: retries get through);
- with no brownout or at threshold 1, give the monolithic model's greedy tokens;
- bill each request exactly its records re-priced: every invocation record it caused
  (failed attempts too) times its share, its store requests, and (Remoe) its main-function
  seconds.

The model is the tiny random Mixtral (3 MoE layers of 8 experts), so a combination costs
seconds: one backend per backend kind serves the whole module, and each plan is deployed
once (its functions stay warm between combinations).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest

from moefleet.compose import EngineOptions, StackOptions, open_engine
from moefleet.compose.billing import InvocationBiller
from moefleet.compose.run import run_billed
from moefleet.engine import SamplingParams
from moefleet.experts.brownout_control import BrownoutSpec
from moefleet.models.hf import HFMoEAdapter
from moefleet.models.tiny import tiny_model
from moefleet.plan import DeploymentPlan
from moefleet.platform import LocalObjectStore, Meter, load_platform
from moefleet.runtime.deploy import Deployment
from moefleet.runtime.faults import FaultPlan
from moefleet.runtime.lifecycle import deploy
from tests.engine_helpers import build_engine

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PLATFORM = "aws-lambda"
PROMPTS = [[5, 17, 42, 7, 99, 3], [8, 1, 250], [60, 61, 62, 63, 64]]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
BROWNOUT = {"off": None,
            "fixed": BrownoutSpec(ways=2, mode="full", threshold=1.0),
            # SLOs far below any step: SALC lowers the threshold from the first steps
            "salc": BrownoutSpec(ways=2, mode="full", slo_ttft_s=1e-4, slo_tpot_s=1e-4,
                                 interval_s=0.001)}
FAULTS = {"off": None,
          "crash": FaultPlan("crash", 0.15, seed=3),
          "timeout": FaultPlan("timeout", 0.15, seed=3, timeout_s=0.01),
          "throttle": FaultPlan("throttle", 0.15, seed=3, retry_after_s=0.01)}


@functools.cache
def adapter() -> HFMoEAdapter:
    return HFMoEAdapter(tiny_model("mixtral"))


@functools.cache
def monolithic() -> tuple[tuple[int, ...], ...]:
    outs = build_engine(adapter(), max_num_seqs=4).generate(PROMPTS, GREEDY)
    return tuple(tuple(o.new_token_ids) for o in outs)


def _plans() -> dict[str, DeploymentPlan | None]:
    from moefleet.remoe.plans import manual_plan

    a = adapter()
    s = a.summary()
    ods = DeploymentPlan.uniform(a.name, PLATFORM, s.moe_layers, s.num_experts,
                                 s.num_layers, 512, method="direct", replicas=1)
    remoe = manual_plan(s, PLATFORM, {layer: [1, 4, 6] for layer in s.moe_layers},
                        main_memory_mb=2048, remote_memory_mb=512)
    return {"none": None, "ods": ods, "remoe": remoe}


def _check(opened: Any, run: Any, exact: bool) -> None:
    assert [o.finish_reason for o in run.outputs] == ["length"] * len(PROMPTS), \
        [o.error for o in run.outputs]
    if exact:
        assert tuple(tuple(o.new_token_ids) for o in run.outputs) == monolithic()
    biller = opened.biller
    if not isinstance(biller, InvocationBiller):
        assert all(c.total > 0 for c in run.costs)  # the in-process estimate
        return
    meter = Meter(biller.spec)
    assert biller.audit is not None and biller.unattributed.total == 0
    for rid, cost in zip((o.request_id for o in run.outputs), run.costs, strict=True):
        want = sum(meter.cost_of(rec).total * share for rec, share in biller.audit[rid])
        want += biller.audit_storage.get(rid, 0.0)
        if biller.main is not None:
            want += meter.cost_of(biller.audit_main[rid]).total
        assert cost.total == pytest.approx(want, rel=1e-9, abs=1e-15)
        assert cost.invocations == len(biller.audit[rid]) > 0


def _run(backend: Any, store: Any, deployments: dict[str, Deployment | None], plan: str,
         brownout: str, faults: str) -> None:
    spec = BROWNOUT[brownout]
    stack = StackOptions(brownout=spec, faults=FAULTS[faults])
    with open_engine(adapter(), plan=deployments[plan], stack=stack, backend=backend,
                     store=store, platform=load_platform(PLATFORM), audit=True,
                     options=EngineOptions(max_num_seqs=4)) as opened:
        run = run_billed(opened, PROMPTS, GREEDY)
        if faults != "off":
            assert opened.faults_injected >= 1  # the faults happened
        if spec is not None:
            assert opened.brownout is not None
            assert (opened.salc is not None) == (brownout == "salc")
        _check(opened, run, exact=spec is None or not spec.controlled)


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, dict]]:
    from moefleet.runtime.local import LocalBackend

    platform = load_platform(PLATFORM)
    store = LocalObjectStore(tmp_path_factory.mktemp("store"))
    backend = LocalBackend(platform, store=store, workers=2)
    try:
        deployments = {k: None if p is None else deploy(p, adapter(), platform, store)
                       for k, p in _plans().items()}
        yield backend, store, deployments
    finally:
        backend.teardown()


@pytest.mark.parametrize("faults", list(FAULTS))
@pytest.mark.parametrize("brownout", list(BROWNOUT))
@pytest.mark.parametrize("plan", ["none", "ods", "remoe"])
def test_every_combination_on_the_local_backend(local: tuple, plan: str, brownout: str,
                                                faults: str) -> None:
    backend, store, deployments = local
    _run(backend if plan != "none" else "local", store, deployments, plan, brownout, faults)


@pytest.fixture(scope="module")
def ray(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, dict]]:
    """One local Ray node and backend for the module. Only the Remoe plan runs here: its
    3 group functions are 3 Serve replicas (each a process importing torch), where the
    ODS/BO plan's 24 expert functions would take minutes to start on 2 cores."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (pip install 'moefleet[ray]')")
    from moefleet.runtime.ray_backend import RayBackend, start_local_ray

    started = start_local_ray()
    platform = load_platform(PLATFORM)
    store = LocalObjectStore(tmp_path_factory.mktemp("ray-store"))
    backend = RayBackend(platform, store=store)
    try:
        yield backend, store, {"remoe": deploy(_plans()["remoe"],  # type: ignore[arg-type]
                                               adapter(), platform, store)}
    finally:
        backend.teardown()
        if started:
            import ray as ray_module
            from ray import serve

            serve.shutdown()
            ray_module.shutdown()


@pytest.mark.parametrize(("brownout", "faults"), [
    ("off", "off"), ("fixed", "throttle"), ("salc", "timeout")])
def test_a_subset_on_ray(ray: tuple, brownout: str, faults: str) -> None:
    backend, store, deployments = ray
    _run(backend, store, deployments, "remoe", brownout, faults)


@pytest.mark.parametrize(("plan", "brownout", "faults"), [
    ("ods", "fixed", "throttle"), ("remoe", "salc", "off"), ("remoe", "off", "timeout")])
def test_a_subset_on_aws_moto(moto_endpoint: str, aws_credentials: None, plan: str,
                              brownout: str, faults: str) -> None:
    from moefleet.platform import open_store
    from tests.aws_helpers import moto_aws_backend

    platform = load_platform(PLATFORM)
    store = open_store(f"s3://moefleet-combos/{plan}?endpoint={moto_endpoint}&create=1")
    backend = moto_aws_backend(platform, bucket="moefleet-combos", store=store.url)
    try:
        deployments = {plan: deploy(_plans()[plan], adapter(), platform, store)}  # type: ignore[arg-type]
        _run(backend, store, deployments, plan, brownout, faults)  # type: ignore[arg-type]
    finally:
        backend.teardown()
