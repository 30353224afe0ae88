"""The analytical model (READING-NOTES eqs. 3-12) against hand calculations.

Platform aws-lambda-2020: T_warm 0.02 s, T_acc 0.05 s, B_s 80e6 B/s, B_f 50e6 B/s,
payload 6,291,456 B, billing 100 ms (min 100 ms), $1.66667e-5 per GB-s, $2e-7 per request,
$5e-6 per PUT, $4e-7 per GET.
Problem: one MoE layer (block 0) of 2 blocks, 2 experts with d = [10, 0],
P = 8e6 B (P/B_s = 0.1 s), D = 400,000 B per token (D/B_s = 0.005 s, D/B_f = 0.008 s),
U = 0.02 s at 768 MB and 0.01 s at 1536 MB, segment 0.5 s each (Σ T^NE = 1.0 s),
segment parameters 4e6 B -> T_load = 0.02 + 0.05 + 4e6/80e6 = 0.12 s.
T_head = 0.02 + 0.05 + 0.1 = 0.17 s.
"""

from __future__ import annotations

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
    #   2 PUT + 3 GET = 1e-5 + 1.2e-6 = 1.12e-5 storage  -> 1.765e-5; x2 = 3.53e-5.
    # layer latency = max(0.42, 0.12) + 0.05 + 10*400000/80e6 = 0.52; e2e = 1.52 s.
    est = evaluate(_problem(), _plan("storage", 768, 2))
    assert est.feasible, est.violations
    assert est.cost_usd == pytest.approx(3.53e-5, rel=1e-4)
    assert est.compute_usd == pytest.approx(2 * 6.25e-6, rel=1e-4)
    assert est.request_usd == pytest.approx(4e-7)
    assert est.storage_usd == pytest.approx(2.24e-5)
    assert est.layers[0].max_replica_s == pytest.approx(0.42)
    assert est.layers[0].latency_s == pytest.approx(0.52)
    assert est.latency_s == pytest.approx(1.52)
    assert est.layers[0].invocations == 2  # expert 1 has no tokens: not invoked


def test_pipelined_method_by_hand() -> None:
    # a=1, beta 2, 1536 MB, 1 replica: r = 10, nblk = 5.
    # t_blk = 0.05 + 2*max(0.005 + 0.01, 0.005) = 0.08; t_tail = 0.05 + 2*0.005 = 0.06.
    # t_rep = 0.17 + 5*0.08 + 0.06 = 0.63 -> billed 0.7 s * 1.5 GB * 1.66667e-5 = 1.75e-5.
    # storage: 10 PUT (5e-5) + 11 GET (4.4e-6); request 2e-7 -> 7.21e-5.
    # latency = max(0.63, 0.12) + 0.05 + 0.05 = 0.73.
    est = evaluate(_problem(), _plan("pipelined", 1536, 1, beta=2))
    assert est.feasible, est.violations
    assert est.cost_usd == pytest.approx(7.21e-5, rel=1e-4)
    assert est.layers[0].latency_s == pytest.approx(0.73)


def test_direct_method_by_hand_and_payload_rule() -> None:
    # a=3, 768 MB, 1 replica: r = 10, payload 4e6 B <= 6,291,456 B.
    # t_rep = 0.17 + 10*(0.008 + 0.02) = 0.45 -> billed 0.5 s -> 6.25e-6;
    # 1 GET (parameters) 4e-7, request 2e-7 -> 6.85e-6.
    # latency = 0.45 + 10*0.008 + 0.12 = 0.65.
    est = evaluate(_problem(), _plan("direct", 768, 1))
    assert est.feasible, est.violations
    assert est.cost_usd == pytest.approx(6.85e-6, rel=1e-4)
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
    # The same two replica invocations billed by moefleet.platform.Meter.
    est = evaluate(_problem(), _plan("storage", 768, 2))
    meter = Meter(SPEC)
    for k in range(2):
        meter.add(InvocationRecord(function=f"exp-0-0-{k}", kind="expert", memory_mb=768,
                                   start_s=0.0, end_s=0.42, storage_puts=2, storage_gets=3))
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
    # Two segments of 0.5 s at 3008 MB: 2 * (0.5 * 3008/1024 * 1.66667e-5 + 2e-7).
    est = evaluate(_problem(), _plan("storage", 768, 2))
    assert est.segment_cost_usd == pytest.approx(2 * (0.5 * 3008 / 1024 * 1.66667e-5 + 2e-7))
    assert est.as_predicted()["cost_usd"] == est.cost_usd
