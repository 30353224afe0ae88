"""The analytical model (plan/costmodel.py) against measured runs on the local backend.

Same model (tiny-mixtral-random, 3 MoE layers x 8 experts, top-2), same 48-token requests
(one per batch), one plan per scatter-gather method (direct, storage, pipelined beta=4), all
experts at 1769 MB (1 vCPU: the worker runs one torch thread), one worker process. The
requests alternate between a calibration and a validation half. Calibration: T_warm from
the calibration half of the direct run (wall time per warm expert call), T_acc and B_s
from timing the backend's own store, U from the model's compute profile. The
PlanningProblem of each validation batch carries that batch's real expert counts.

Compared on the validation half, per method, on MoE layers 0 and 1 (layer 2's gather call
also runs the LM head and returns the logits: that is the tail's T^NE, not MoE latency).
Asserted (the parts of the model this backend can honestly check):

- direct latency: ``calibration.odsbo.one_worker_layer_latency`` (the model's per-replica
  eq. 10 composed as one worker with warm instances runs it) within LATENCY_TOL of the
  median measured ``moe_s`` (measured: +16%, +17% in two runs);
- request accounting: the model's request USD equals the Meter's exactly, and its store
  requests exceed the Meter's by exactly two parameter GETs per replica (skeleton and
  weights, charged every batch by the model; a warm instance fetches neither);
- storage / pipelined total MoE cost within COST_TOL of the Meter's bill (expert
  invocations plus the scatter PUTs / gather GETs the MoE segments made): store requests
  dominate it (measured: +4..+6% storage, +1..+2% pipelined);
- the warm-instances variant (``PlanningProblem(warm_instances=True)``: no parameter
  download or GET, T_warm not billed): its request and store USD equal the Meter's
  exactly for every method, and the direct total MoE cost is within WARM_COST_TOL of the
  bill (measured: -0.0%; the paper's model: +187%).

Printed, not asserted (structural gaps, see the test's report): ``LayerEstimate.latency_s``
verbatim for every method (eqs. 7/9/11 take max over concurrent replicas that each fetch
their parameters), the storage/pipelined one-worker reading (measured -37%, -68%: the
fsync'd local PUTs, the scatter's and the pipeline's thread pools are no T_acc), the direct
total cost (+190..+240%: the parameter GET and the billed T_warm) and the billed compute,
and the warm-instances cost of storage / pipelined.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.integration]

MODEL = "tiny-mixtral-random"
MEMORY_MB = 1769  # exactly 1 vCPU on aws-lambda: the local worker runs one torch thread
REQUESTS = 16
TOKENS = 48
METHODS = (("direct", 1), ("storage", 1), ("pipelined", 4))
LAYERS = (0, 1)  # MoE layers whose post call is a pure gather (layer 2's runs the head)
LATENCY_TOL = 0.25
COST_TOL = 0.15
# Direct total MoE cost with PlanningProblem(warm_instances=True) against the Meter's bill.
# Request and store parts match by construction (asserted exactly); the compute part
# (~1/8 of the bill) is billed at the 1 ms minimum on both sides when handlers stay under
# 1 ms (measured: -0.0% total, +0% compute, in three runs). 5% leaves room for some
# handlers crossing 1 ms on a loaded machine (a compute error up to ~40%).
WARM_COST_TOL = 0.05


def _run(tmp: Path) -> dict[str, Any]:
    from moefleet.data import load_prompts
    from moefleet.models import load_adapter, zoo
    from moefleet.plan import DeploymentPlan
    from moefleet.platform import load_platform, open_store
    from moefleet.runtime.base import create_backend
    from moefleet.runtime.deploy import deploy_plan
    from moefleet.sim.routing import TraceRowRouter
    from moefleet.traces import profile as record_routing
    from tests.segment_helpers import one_request_batches, segment_batches

    zoo.build(MODEL)
    adapter = load_adapter(MODEL)
    prompts = load_prompts("wikitext2")[: 4 * REQUESTS]
    ids, texts = [p.request_id for p in prompts], [p.text for p in prompts]
    budget: dict[str, Any] = dict(max_tokens=REQUESTS * TOKENS, max_length=TOKENS)
    batches = one_request_batches(adapter, ids, texts, **budget)
    router = TraceRowRouter(record_routing(adapter, ids, texts, attention_ids=False, **budget))
    s = adapter.summary()
    platform = load_platform("aws-lambda")
    runs: dict[str, Any] = {}
    for method, beta in METHODS:
        plan = DeploymentPlan.uniform(MODEL, platform.name, s.moe_layers, s.num_experts,
                                      s.num_layers, MEMORY_MB, method, beta=beta)  # type: ignore[arg-type]
        store = open_store(str(tmp / method))
        dep = deploy_plan(adapter, plan, platform, store, backend_name="local")
        backend = create_backend("local", platform, store=dep.store, workers=1)
        results = []
        try:
            with segment_batches(adapter, dep, platform, backend, store, batch_size=1,
                                 max_length=TOKENS) as ex:
                results = [ex.run_batch(*b) for b in batches]
        finally:
            backend.teardown()
        runs[method] = (plan, results)
    counts = {rids[0]: np.stack([router.replay_RE[li][router.request_index[rids[0]]]
                                 for li in range(len(s.moe_layers))])
              for _, _, rids in batches}
    return {"runs": runs, "counts": counts, "platform": platform, "store": open_store(
        str(tmp / "calibration")), "hidden": s.hidden_size}


def _moe_bill(results: list[Any], platform: Any, layers: tuple[int, ...]) -> Any:
    """Meter's bill of the MoE work of ``layers``: expert invocations (all parts) and the
    store requests of the segment calls (scatter PUTs in pre, gather GETs in post)."""
    from moefleet.platform import Meter

    meter = Meter(platform)
    for res in results:
        for rec in res.records:
            if rec.layer not in layers:
                continue
            if rec.kind == "expert":
                meter.add(rec)
            else:
                meter.add_storage(rec.storage_puts, rec.storage_gets, function=rec.function)
    return meter.bill().total


def _layer_parts(problem: Any, plan: Any, le: Any, spec: Any) -> np.ndarray:
    """(compute, request, store) USD of one LayerEstimate, split with the model's own
    request accounting (``costmodel.requests_per_replica``, which honours the problem's
    ``warm_instances``)."""
    from moefleet.plan.costmodel import n_blocks, requests_per_replica

    li = problem.moe_layers.index(le.layer)
    lp = plan.layers[li]
    store = 0.0
    for d, ec in zip(problem.counts(li), lp.experts, strict=True):
        if d > 0:
            r = -(-int(d) // ec.replicas)
            nblk = int(n_blocks(r, lp.beta)) if le.method == 1 else 1
            puts, gets = requests_per_replica(le.method, nblk, problem.warm_instances)
            store += ec.replicas * (puts * spec.storage.price_per_put
                                    + gets * spec.storage.price_per_get)
    request = le.invocations * spec.prices.per_request
    return np.array([le.cost_usd - request - store, request, store])


@pytest.mark.timeout(600)
def test_costmodel_matches_local_runtime(tmp_path: Path) -> None:
    from moefleet.calibration.odsbo import (
        StoreTiming,
        calibrated_platform,
        measure_store,
        one_worker_layer_latency,
        warm_call_s,
    )
    from moefleet.plan import PlanningProblem, evaluate
    from moefleet.plan.costmodel import PARAM_GETS
    from moefleet.profiles.cache import profile_for

    data = _run(tmp_path)
    profile = profile_for(MODEL)
    _, direct_res = data["runs"]["direct"]
    calib = direct_res[0::2][1:]  # calibration half, the cold first request left out
    stats = [st for r in calib for st in r.layers if st.layer in LAYERS]
    warm = warm_call_s([st.experts_s for st in stats], [st.invocations for st in stats])
    bench = measure_store(data["store"], hidden=data["hidden"])
    # T_acc from the calibration half of the storage run: a storage call is a direct call
    # plus one GET and one PUT in the worker (the bytes are ~3 KB: latency, not bandwidth).
    st_calib = data["runs"]["storage"][1][0::2][1:]
    handler = {kind: statistics.median(
        rec.duration_s for r in runs for rec in r.records
        if rec.kind == "expert" and rec.layer in LAYERS)
        for kind, runs in (("storage", st_calib), ("direct", calib))}
    access = max(1e-6, (handler["storage"] - handler["direct"]) / 2)
    store = StoreTiming(access, bench.bandwidth_bytes_per_s, bench.put_s, bench.get_s)
    spec = calibrated_platform(data["platform"], warm_s=warm, store=store,
                               function_bandwidth_bytes_per_s=1e12)  # local pipes: in T_warm
    print(f"\ncalibrated: T_warm {warm * 1e3:.3f} ms, T_acc {store.access_s * 1e3:.3f} ms "
          f"(PUT {store.put_s * 1e3:.3f}, GET {store.get_s * 1e3:.3f}), "
          f"B_s {store.bandwidth_bytes_per_s / 1e6:.0f} MB/s")
    failures = []
    for method, _ in METHODS:
        plan, results = data["runs"][method]
        valid = results[1::2]
        est_verbatim, est_local, measured = [], [], []
        model_parts = np.zeros(3)
        warm_parts = np.zeros(3)  # the same plans under PlanningProblem(warm_instances=True)
        calls = 0
        for res in valid:
            counts = data["counts"][res.request_ids[0]]
            assert counts.sum(axis=1).tolist() == [2 * res.tokens] * 3  # top-2, every token
            problem = PlanningProblem.from_profile(profile, spec, counts, slo_s=1e3,
                                                   memory_options_mb=[MEMORY_MB],
                                                   segment_memory_mb=MEMORY_MB)
            est = evaluate(problem, plan)
            by_layer = {le.layer: le for le in est.layers}
            for st in res.layers:
                if st.layer in LAYERS:
                    li = problem.moe_layers.index(st.layer)
                    measured.append(st.moe_s)
                    est_verbatim.append(by_layer[st.layer].latency_s)
                    est_local.append(one_worker_layer_latency(problem, plan, li))
                    assert st.invocations == by_layer[st.layer].invocations
                    calls += st.invocations
            for layer in LAYERS:
                model_parts += _layer_parts(problem, plan, by_layer[layer], spec)
            warm_problem = dataclasses.replace(problem, warm_instances=True)
            warm_layer = {le.layer: le for le in evaluate(warm_problem, plan).layers}
            for layer in LAYERS:
                warm_parts += _layer_parts(warm_problem, plan, warm_layer[layer], spec)
        real = statistics.median(measured)
        verb, local = statistics.median(est_verbatim), statistics.median(est_local)
        bill = _moe_bill(valid, data["platform"], LAYERS)
        per_get = spec.storage.price_per_get if spec.storage else 0.0
        err = {"verbatim": verb / real - 1, "one-worker": local / real - 1,
               "cost": model_parts.sum() / bill.total - 1,
               "compute": model_parts[0] / bill.compute - 1}
        print(f"{method:9s} moe_s median {real * 1e3:7.3f} ms | model verbatim "
              f"{verb * 1e3:7.3f} ms ({err['verbatim']:+.0%}) | one-worker reading "
              f"{local * 1e3:7.3f} ms ({err['one-worker']:+.0%}) | cost model "
              f"{model_parts.sum():.4g} vs bill {bill.total:.4g} USD ({err['cost']:+.1%}); "
              f"compute {model_parts[0]:.3g} vs {bill.compute:.3g} ({err['compute']:+.0%})")
        warm_err = {"cost": warm_parts.sum() / bill.total - 1,
                    "compute": warm_parts[0] / bill.compute - 1}
        print(f"{'':9s} warm_instances=True: cost model {warm_parts.sum():.4g} vs bill "
              f"{bill.total:.4g} USD ({warm_err['cost']:+.2%}); compute {warm_parts[0]:.3g} "
              f"vs {bill.compute:.3g} ({warm_err['compute']:+.0%})")
        assert model_parts[1] == pytest.approx(bill.request, rel=1e-9)  # one request per call
        assert warm_parts[1] == pytest.approx(bill.request, rel=1e-9)
        if method == "pipelined":
            # The gate runs concurrently with the experts: its routing PUT and the experts'
            # GETs of minibatches not uploaded yet (polls) are billed on top of the
            # replicas' own requests (the model has them in transfer_usd / poll_usd, in
            # the layer cost, not in requests_per_replica); every request the replicas'
            # accounting counts is in the bill.
            print(f"{'':9s} pipelined polls and routing: {bill.storage - warm_parts[2]:.3g} "
                  "USD of store requests beyond the replicas' own")
            assert bill.storage >= warm_parts[2] * (1 - 1e-9)
        else:
            # The model's two parameter GETs (skeleton, weights) per replica and batch: a
            # warm instance makes neither.
            assert model_parts[2] - bill.storage == pytest.approx(
                PARAM_GETS * calls * per_get, rel=1e-6)
            # Warm instances: the same requests, and no parameter GET: the Meter's exactly.
            assert warm_parts[2] == pytest.approx(bill.storage, rel=1e-9, abs=1e-15)
        if method == "direct" and abs(warm_err["cost"]) > WARM_COST_TOL:
            failures.append(f"{method}: warm-instances cost error {warm_err['cost']:+.1%}")
        if method == "direct" and abs(err["one-worker"]) > LATENCY_TOL:
            failures.append(f"{method}: latency error {err['one-worker']:+.0%}")
        if method != "direct" and abs(err["cost"]) > COST_TOL:
            failures.append(f"{method}: cost error {err['cost']:+.1%}")
    assert not failures, failures
