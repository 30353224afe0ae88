"""The analytical model (READING-NOTES eqs. 3-12) against hand calculations.

Platform aws-lambda-2020: T_warm 0.02 s, T_acc 0.05 s, B_s 80e6 B/s, B_f 50e6 B/s,
payload 6,291,456 B, billing 100 ms (min 100 ms), $1.66667e-5 per GB-s, $2e-7 per request,
$5e-6 per PUT, $4e-7 per GET.
Problem: one MoE layer (block 0) of 2 blocks, 2 experts with d = [10, 0],
P = 8e6 B (P/B_s = 0.1 s), D = 400,000 B per token (D/B_s = 0.005 s, D/B_f = 0.008 s),
U = 0.02 s at 768 MB and 0.01 s at 1536 MB, segment 0.5 s each (Σ T^NE = 1.0 s),
segment parameters 4e6 B -> T_load = 0.02 + 0.05 + 4e6/80e6 = 0.12 s.
T_head = 0.02 + 0.05 + 0.1 = 0.17 s. A cold expert GETs 2 objects (skeleton, weights).

Segment/coordinator requests (plan.transfers), 10 tokens: activations 4e6 B each against
the spill budget (6,291,456 - 1024)*3//4 - 4096 - 1024 = 4,712,704 B. seg pre returns
residual + x + ids + w (8,000,120 B): residual spills (1 PUT), seg post GETs it. Direct:
the coordinator sends x + routed (8e6 B): x spills (1 PUT, 1 GET). Pipelined: the routing
PUT, the coordinator's asks while the gate runs 0.02 + 0.5 s (2, 4, 8, 16, then 20 ms:
29 empty asks), the found ask and the GET. One LIST per batch. So transfer_usd:
storage 2 PUT + 1 GET = 1.04e-5; direct 3 PUT + 2 GET = 1.58e-5; pipelined 3 PUT +
32 GET = 2.78e-5.
"""

from __future__ import annotations

import dataclasses

import pytest

from moefleet.plan import DeploymentPlan, PlanningProblem, evaluate
from moefleet.plan.costmodel import billed_s
from moefleet.platform import InvocationRecord, Meter, load_platform

SPEC = load_platform("aws-lambda-2020")


def _problem(slo: float = 10.0, intermediate: int = 0) -> PlanningProblem:
    return PlanningProblem.explicit(
        model="hand", platform=SPEC, moe_layers=[0], num_experts=[2], num_blocks=2,
        counts_LE=[[10, 0]], expert_param_bytes=8_000_000, bytes_per_token=400_000,
        memory_options_mb=[768, 1536], per_token_s=[0.02, 0.01], slo_s=slo,
        segment_time_s=0.5, segment_param_bytes=4_000_000, intermediate_bytes=intermediate,
    )


def _plan(method: str, mem: int, replicas: int, beta: int = 1) -> DeploymentPlan:
    plan = DeploymentPlan.uniform("hand", SPEC.name, [0], [2], 2, memory_mb=768,
                                  method=method, beta=beta)  # type: ignore[arg-type]
    plan.segment_memory_mb = [SPEC.baseline_memory()] * 2
    plan.layers[0].experts[0].memory_mb = mem
    plan.layers[0].experts[0].replicas = replicas
    return plan


def test_storage_method_by_hand() -> None:
    # a=2, expert 0 at 768 MB with 2 replicas: r = 5.
    # t_rep = 0.17 + 2*0.05 + 5*(0.005 + 0.02 + 0.005) = 0.42 s -> billed 0.5 s.
    # per replica: 0.5 s * 0.75 GB * 1.66667e-5 = 6.25e-6 compute, 2e-7 request,
    #   2 PUT + 4 GET = 1e-5 + 1.6e-6 = 1.16e-5 storage  -> 1.805e-5; x2 = 3.61e-5;
    #   + transfers 1.04e-5 = 4.65e-5.
    # layer latency = max(0.42, 0.12) + 0.05 + 10*400000/80e6 = 0.52; e2e = 1.52 s.
    est = evaluate(_problem(), _plan("storage", 768, 2))
    assert est.feasible, est.violations
    assert est.cost_usd == pytest.approx(4.65e-5, rel=1e-4)
    assert est.compute_usd == pytest.approx(2 * 6.25e-6, rel=1e-4)
    assert est.request_usd == pytest.approx(4e-7)
    assert est.storage_usd == pytest.approx(2.32e-5)
    assert est.transfer_usd == pytest.approx(1.04e-5)
    assert est.layers[0].cost_usd == pytest.approx(4.65e-5 - 5e-6)  # the LIST is per batch
    assert est.layers[0].max_replica_s == pytest.approx(0.42)
    assert est.layers[0].latency_s == pytest.approx(0.52)
    assert est.latency_s == pytest.approx(1.52)
    assert est.layers[0].invocations == 2  # expert 1 has no tokens: not invoked


def test_pipelined_method_by_hand() -> None:
    # a=1, beta 2, 1536 MB, 1 replica: r = 10, nblk = 5.
    # t_blk = 0.05 + 2*max(0.005 + 0.01, 0.005) = 0.08; t_tail = 0.05 + 2*0.005 = 0.06.
    # t_rep = 0.17 + 5*0.08 + 0.06 = 0.63 -> billed 0.7 s * 1.5 GB * 1.66667e-5 = 1.75e-5.
    # storage: 10 PUT (5e-5) + 12 GET (4.8e-6); request 2e-7 -> 7.25e-5; + transfers
    # 2.78e-5 = 1.003e-4. Minibatch m is up after (m+1) * (0.05 + 2*0.005) = 0.06(m+1) s,
    # asked at 0.17 + 0.08 m: never early, no empty asks.
    # latency = max(0.63, 0.12) + 0.05 + 0.05 = 0.73.
    est = evaluate(_problem(), _plan("pipelined", 1536, 1, beta=2))
    assert est.feasible, est.violations
    assert est.cost_usd == pytest.approx(1.003e-4, rel=1e-4)
    assert est.storage_usd == pytest.approx(5.48e-5)
    assert est.transfer_usd == pytest.approx(2.78e-5)
    assert est.layers[0].latency_s == pytest.approx(0.73)


def test_direct_method_by_hand_and_payload_rule() -> None:
    # a=3, 768 MB, 1 replica: r = 10, payload 4e6 B <= 6,291,456 B.
    # t_rep = 0.17 + 10*(0.008 + 0.02) = 0.45 -> billed 0.5 s -> 6.25e-6;
    # 2 GET (parameters) 8e-7, request 2e-7 -> 7.25e-6; + transfers 1.58e-5 = 2.305e-5.
    # latency = 0.45 + 10*0.008 + 0.12 = 0.65.
    est = evaluate(_problem(), _plan("direct", 768, 1))
    assert est.feasible, est.violations
    assert est.cost_usd == pytest.approx(2.305e-5, rel=1e-4)
    assert est.transfer_usd == pytest.approx(1.58e-5)
    assert est.layers[0].latency_s == pytest.approx(0.65)
    # 16 tokens in one replica: 6.4e6 B > 6,291,456 B breaks (12f); 2 replicas fix it.
    p16 = _problem().with_counts([[16, 0]])
    bad = evaluate(p16, _plan("direct", 768, 1))
    assert not bad.feasible and "payload" in bad.violations[0]
    assert evaluate(p16, _plan("direct", 768, 2)).feasible


def test_constraint_violations_are_named() -> None:
    # SLO 1.5 s < 1.52 s (eq. 12d).
    slow = evaluate(_problem(slo=1.5), _plan("storage", 768, 2))
    assert not slow.feasible and "SLO" in slow.violations[-1]
    # 2 GB intermediate memory fits no option (eq. 12c).
    mem = evaluate(_problem(intermediate=2 << 30), _plan("storage", 1536, 1))
    assert any("needs" in v and "1536 MB" in v for v in mem.violations)
    # beta above the tokens of any replica (eq. 12e).
    beta = evaluate(_problem(), _plan("pipelined", 768, 1, beta=11))
    assert any("beta 11" in v for v in beta.violations)
    # More replicas than the problem allows.
    many = evaluate(_problem(), _plan("storage", 768, 9))
    assert any("9 replicas" in v for v in many.violations)


def test_cost_matches_the_platform_meter() -> None:
    # The same two replica invocations billed by moefleet.platform.Meter, plus the
    # segments' and coordinator's 2 PUT (LIST included) + 1 GET.
    est = evaluate(_problem(), _plan("storage", 768, 2))
    meter = Meter(SPEC)
    for k in range(2):
        meter.add(InvocationRecord(function=f"exp-0-0-{k}", kind="expert", memory_mb=768,
                                   start_s=0.0, end_s=0.42, storage_puts=2, storage_gets=4))
    meter.add_storage(2, 1)
    assert meter.bill().total.total == pytest.approx(est.cost_usd, rel=1e-9)


def test_billing_granularity() -> None:
    from moefleet.plan.costmodel import Rates

    rates = Rates.of(_problem())
    # 100 ms steps with a 100 ms minimum; exact multiples are not rounded up further.
    assert billed_s(0.0, rates) == pytest.approx(0.1)
    assert billed_s(0.3, rates) == pytest.approx(0.3)
    assert billed_s(0.30001, rates) == pytest.approx(0.4)
    for t in (0.05, 0.3, 0.42, 1.2345):
        assert billed_s(t, rates) == pytest.approx(SPEC.billed_duration_s(t))


def test_segment_cost_is_reported_separately() -> None:
    # Two segments of 0.5 s at 3008 MB, 2 parameter GETs each:
    # 2 * (0.5 * 3008/1024 * 1.66667e-5 + 2e-7 + 8e-7).
    est = evaluate(_problem(), _plan("storage", 768, 2))
    assert est.segment_cost_usd == pytest.approx(
        2 * (0.5 * 3008 / 1024 * 1.66667e-5 + 2e-7 + 8e-7))
    assert est.as_predicted()["cost_usd"] == est.cost_usd


# ---- warm instances (PlanningProblem.warm_instances, opt-in) ------------------------------
# Instances hold their parameters: T_head = T_warm = 0.02 s, T_load = 0.02 s, no parameter
# GET, and a replica is billed for t_rep - T_warm (T_warm still counts for latency).


def _warm(slo: float = 10.0) -> PlanningProblem:
    return dataclasses.replace(_problem(slo), warm_instances=True)


def test_warm_instances_defaults_off_and_changes_only_its_terms() -> None:
    from moefleet.plan.costmodel import Rates, head_s, requests_per_replica

    assert _problem().warm_instances is False and Rates.of(_problem()).unbilled_s == 0.0
    cold, warm = Rates.of(_problem()), Rates.of(_warm())
    assert head_s(cold, 8e6) == pytest.approx(0.17) and head_s(warm, 8e6) == 0.02
    assert _problem().load_s(0) == pytest.approx(0.12) and _warm().load_s(0) == 0.02
    assert warm.unbilled_s == 0.02
    for a, nblk, cold_req in ((1, 5, (10, 12)), (2, 1, (2, 4)), (3, 1, (0, 2))):
        assert requests_per_replica(a, nblk) == cold_req
        assert requests_per_replica(a, nblk, True) == (cold_req[0], cold_req[1] - 2)


def test_warm_storage_method_by_hand() -> None:
    # a=2, 768 MB, 2 replicas, r = 5: t_rep = 0.02 + 2*0.05 + 5*0.03 = 0.27 s;
    # billed 0.27 - 0.02 = 0.25 -> 0.3 s: 0.3 * 0.75 * 1.66667e-5 = 3.75e-6 compute,
    # 2e-7 request, 2 PUT + 2 GET = 1e-5 + 8e-7 = 1.08e-5 -> 1.475e-5; x2 = 2.95e-5;
    # + transfers 1.04e-5 = 3.99e-5.
    # latency = max(0.27, 0.02) + 0.05 + 0.05 = 0.37; e2e 1.37 s.
    est = evaluate(_warm(), _plan("storage", 768, 2))
    assert est.feasible, est.violations
    assert est.cost_usd == pytest.approx(3.99e-5, rel=1e-4)
    assert est.compute_usd == pytest.approx(2 * 3.75e-6, rel=1e-4)
    assert est.request_usd == pytest.approx(4e-7)
    assert est.storage_usd == pytest.approx(2.16e-5)
    assert est.layers[0].max_replica_s == pytest.approx(0.27)
    assert est.layers[0].latency_s == pytest.approx(0.37)
    assert est.latency_s == pytest.approx(1.37)
    # The Meter billing the handlers (t_rep - T_warm = 0.25 s, 2 PUT, 2 GET) agrees.
    meter = Meter(SPEC)
    for k in range(2):
        meter.add(InvocationRecord(function=f"exp-0-0-{k}", kind="expert", memory_mb=768,
                                   start_s=0.0, end_s=0.25, storage_puts=2, storage_gets=2))
    meter.add_storage(2, 1)
    assert meter.bill().total.total == pytest.approx(est.cost_usd, rel=1e-9)


def test_warm_pipelined_method_by_hand() -> None:
    # a=1, beta 2, 1536 MB, 1 replica: r = 10, nblk = 5, t_blk 0.08, t_tail 0.06.
    # t_rep = 0.02 + 5*0.08 + 0.06 = 0.48; billed 0.46 -> 0.5 s * 1.5 GB * 1.66667e-5
    # = 1.25e-5; 10 PUT (5e-5) + 10 GET; request 2e-7. The replica now starts at 0.02 s,
    # ahead of the gate: minibatch 0 is up at 0.06 s, asked at 0.02 (waits 0.04 s: asks
    # after 2, 4, 8, 16, 32 ms = 5 empty), minibatch 1 up at 0.12, asked at 0.10 (0.02 s:
    # 4 empty), minibatch 2 up and asked at 0.18 (none): 19 GET = 7.6e-6 -> 7.03e-5;
    # + transfers 2.78e-5 = 9.81e-5.
    # latency = max(0.48, 0.02) + 0.05 + 0.05 = 0.58.
    est = evaluate(_warm(), _plan("pipelined", 1536, 1, beta=2))
    assert est.feasible, est.violations
    assert est.cost_usd == pytest.approx(9.81e-5, rel=1e-4)
    assert est.compute_usd == pytest.approx(1.25e-5, rel=1e-4)
    assert est.storage_usd == pytest.approx(5.4e-5)  # the replica's own 10 PUT + 10 GET
    assert est.poll_usd == pytest.approx(9 * 4e-7)  # the 9 empty asks
    assert est.layers[0].max_replica_s == pytest.approx(0.48)
    assert est.layers[0].latency_s == pytest.approx(0.58)


def test_warm_direct_method_by_hand() -> None:
    # a=3, 768 MB, 1 replica: t_rep = 0.02 + 10*(0.008 + 0.02) = 0.30; billed 0.28 ->
    # 0.3 s -> 3.75e-6; no GET; request 2e-7 -> 3.95e-6; + transfers 1.58e-5 = 1.975e-5.
    # latency = 0.30 + 10*0.008 + 0.02 = 0.40; e2e 1.40.
    est = evaluate(_warm(), _plan("direct", 768, 1))
    assert est.feasible, est.violations
    assert est.cost_usd == pytest.approx(1.975e-5, rel=1e-4)
    assert est.storage_usd == 0.0
    assert est.layers[0].max_replica_s == pytest.approx(0.30)
    assert est.layers[0].latency_s == pytest.approx(0.40)
    assert est.latency_s == pytest.approx(1.40)


def test_warm_billing_keeps_the_minimum() -> None:
    # 1 token at 1536 MB, direct: t_rep = 0.02 + 0.008 + 0.01 = 0.038; 0.018 s of handler
    # is billed as the 100 ms minimum: 0.1 * 1.5 * 1.66667e-5 + 2e-7 = 2.7e-6; the batch
    # still has 10 tokens, so the direct transfers (1.58e-5) stay -> 1.85e-5.
    est = evaluate(_warm().with_counts([[1, 0]]), _plan("direct", 1536, 1))
    assert est.cost_usd == pytest.approx(1.85e-5, rel=1e-4)
    assert est.transfer_usd == pytest.approx(1.58e-5)
