"""The Remoe simulator against the analytical model (eqs. 1-10): exact with routing that
has no randomness, close in expectation with sampled routing; pools and cold starts."""

from __future__ import annotations

import numpy as np
import pytest

from moefleet.plan.remoe import Layout, RemoeProblem, TimeLaw, evaluate, plan_policy
from moefleet.platform.spec_blocks import Billing
from moefleet.sim.config import SimError
from moefleet.sim.remoe import RemoeSimulator
from tests.unit.remoe_helpers import GB, remoe_problem


def _problem(s_LE: np.ndarray, top_k: int = 1, **kw: object) -> RemoeProblem:
    return remoe_problem(**{"s_LE": s_LE, "top_k": top_k, "n_out": 3, "ttft_slo_s": 1e3,
                            "tpot_slo_s": 1e3, "prefill_factor": 0.5,
                            "load_bytes_s": float(GB), **kw})


def test_deterministic_routing_reproduces_the_equations_exactly() -> None:
    # top-1 onto one expert per layer: the routing has no randomness. Layer 0's token
    # expert is remote, layer 1's is local (its remote expert never gets a token).
    s = np.array([[1.0, 0.0], [0.0, 1.0]])
    p = _problem(s)
    lay = Layout("remoe", 1024, np.array([[True, False], [False, False]]), (2048, 0),
                 (((0,),), ()))
    est = evaluate(p, lay)
    got = RemoeSimulator(p, lay).run([0.0])
    assert got.prefill_s[0] == pytest.approx(est.pt_s)
    assert got.tpot_s[0] == pytest.approx(est.tpot_s)
    # main cold start 3 s + (0.5 GB + 3 local experts x 0.25 GB) / 1 GB/s, as evaluate's
    assert got.cold_s[0] == pytest.approx(est.cold_s) and est.cold_s == pytest.approx(4.25)
    assert got.ttft_s[0] == pytest.approx(est.ttft_s)
    assert got.main_cost == pytest.approx(est.c_loc)
    assert got.remote_prefill_cost == pytest.approx(est.pc_rem)
    assert got.remote_decode_cost == pytest.approx(est.gc_rem)
    assert got.remote_calls == 1 + 3  # one prefill call, one per decode token


def test_sampled_routing_matches_the_expectation() -> None:
    rng = np.random.default_rng(3)
    s = rng.dirichlet(np.full(8, 0.6), size=3)
    p = _problem(s, top_k=2, n_in=24, n_out=40, law=TimeLaw(0.02, 0.7, 0.004),
                 invoke_overhead_s=0.002, nonexpert_token_s=1e-3, swap_bytes_s=1e9,
                 transfer_bytes_s=1e7, main_memory_mb=tuple(range(1024, 8193, 1024)),
                 remote_memory_mb=(1024, 2048, 4096), expert_bytes=0.02 * GB,
                 tpot_slo_s=0.2)
    res = plan_policy(p, "remoe", check_slo=False)
    est = res.estimate
    # one replica per layer so that eq. 5's serial remote path is what the pools do
    lay = Layout("remoe", res.layout.main_mb, res.layout.remote_LE, res.layout.remote_mb,
                 tuple((tuple(int(e) for e in np.flatnonzero(res.layout.remote_LE[li])),)
                       if res.layout.remote_LE[li].any() else ()
                       for li in range(p.num_layers)))
    est = evaluate(p, lay)
    got = RemoeSimulator(p, lay, seed=1).run([100.0 * i for i in range(40)])
    assert np.mean(got.tpot_s) == pytest.approx(est.tpot_s, rel=0.05)
    assert np.mean(got.prefill_s) == pytest.approx(est.pt_s, rel=0.05)
    assert got.cost_usd / 40 == pytest.approx(est.cost, rel=0.05)
    # requests 100 s apart with a 600 s keep-alive: one main and one instance per remote
    # function start cold, every later request finds them warm
    assert got.main_cold_starts == 1
    assert got.remote_cold_starts == sum(1 for g in lay.groups if g)
    assert got.cold_s[0] > 0 and max(got.cold_s[1:]) == 0.0


def test_concurrent_requests_start_more_instances_and_bad_input_is_refused() -> None:
    s = np.array([[1.0, 0.0], [0.0, 1.0]])
    p = _problem(s)
    lay = Layout("remoe", 1024, np.array([[True, False], [False, False]]), (2048, 0),
                 (((0,),), ()))
    got = RemoeSimulator(p, lay, keep_alive_s=0.0).run([0.0, 0.0, 0.0])
    assert got.main_cold_starts == 3 and len(got.ttft_s) == 3
    assert got.remote_cold_starts >= 2  # the remote function is busy: more instances
    rule = Billing(granularity_ms=10_000, min_billed_ms=0, init_billed=False)
    billed = RemoeSimulator(p, lay, billing=rule).run([0.0])
    assert billed.remote_decode_cost == pytest.approx(3 * 2.0 * 10.0)  # 3 calls of 10 s
    # the meter's minimum applies too (the simulator once rounded without it)
    floor = Billing(granularity_ms=1, min_billed_ms=50_000, init_billed=False)
    assert RemoeSimulator(p, lay, billing=floor).run([0.0]).remote_billed_s == 4 * 50.0  # 1 + 3
    with pytest.raises(SimError, match="arrival times"):
        RemoeSimulator(p, lay).run([-1.0])
    with pytest.raises(SimError, match="does not match"):
        RemoeSimulator(_problem(np.array([[0.5, 0.5]])), lay)


def test_cold_starts_are_billed_where_the_platform_bills_init() -> None:
    """INIT is billed per cold start, at the instance's rate, only where the billing block
    says so (aws-lambda today); the paper's model (no billing block) bills none."""
    s = np.array([[1.0, 0.0], [0.0, 1.0]])
    p = _problem(s)
    lay = Layout("remoe", 1024, np.array([[True, False], [False, False]]), (2048, 0),
                 (((0,),), ()))
    exact = Billing(granularity_ms=1, min_billed_ms=0, init_billed=False)
    paid = Billing(granularity_ms=1, min_billed_ms=0, init_billed=True)
    free = RemoeSimulator(p, lay, billing=exact).run([0.0, 0.0])
    init = RemoeSimulator(p, lay, billing=paid).run([0.0, 0.0])
    assert free.main_init_cost == free.remote_init_cost == 0.0
    assert RemoeSimulator(p, lay).run([0.0]).main_init_cost == 0.0
    cold_main = init.cold_s[0]  # both mains cold: each waited its whole cold start
    main_rate = init.main_cost / init.main_billed_s
    assert init.main_init_cost == pytest.approx(2 * cold_main * main_rate)
    assert init.remote_init_cost > 0.0
    assert init.cost_usd == pytest.approx(free.cost_usd + init.main_init_cost
                                          + init.remote_init_cost)


def test_the_time_law_follows_the_platforms_vcpu_rule() -> None:
    """A function gets the vCPUs its platform gives its memory (the paper assumed 1 GB =
    1 vCPU): on aws-lambda 1 GB is 0.58 vCPU, so an expert runs 1769/1024 times slower
    there than with one vCPU, and the planner's CPU price is the meter's."""
    from moefleet.plan.remoe import TimeLaw
    from moefleet.plan.remoe.shapes import gb_per_vcpu
    from moefleet.platform import load_platform

    aws = load_platform("aws-lambda")
    g = gb_per_vcpu(aws)
    assert g == pytest.approx(1769 / 1024)
    law = TimeLaw(0.0, 0.0, 1.0, gb_per_vcpu=g)
    assert law(1.0) == pytest.approx(g) and law(g) == law(3 * g) == pytest.approx(1.0)
    assert law.array(np.array([1.0, g]))[0] == pytest.approx(g)
    assert TimeLaw(0.0, 0.0, 1.0)(0.5) == pytest.approx(2.0)  # the paper's rule
    assert gb_per_vcpu(load_platform("gcp-cloud-run-functions")) > 0
