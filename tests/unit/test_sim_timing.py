"""Transfer/handler formulas against ODS/BO's t_rep (READING-NOTES), routing, statistics,
and the simulator's billing shortcut against the platform's own rule."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moefleet.sim.metrics import StreamStats, percentile
from moefleet.sim.routing import DistributionRouter
from moefleet.sim.timing import (
    Links,
    expert_handler_s,
    expert_response_s,
    expert_storage_ops,
    payload_s,
    split_tokens,
    store_io_s,
)
from tests.unit.sim_helpers import spec

T_ACC, B_S, B_F, D = 0.05, 80e6, 50e6, 3072
LINKS = Links(access_s=T_ACC, storage_bps=B_S, function_bps=B_F, bytes_per_token=D,
              payload_limit=6 * 2**20)
U = 2e-4  # ODS's t: seconds per token at the chosen memory (linear compute)


def compute(m: int) -> float:
    return m * U


@pytest.mark.parametrize("r", [1, 7, 64, 1000])
def test_direct_and_storage_match_ods(r: int) -> None:
    # a=3: t_rep - T_head = r (D_in/B_f + t); a=2: 2 T_acc + r (D_in/B_s + t + D_out/B_s)
    assert expert_handler_s("direct", r, 1, compute, LINKS) == pytest.approx(r * (D / B_F + U))
    assert expert_handler_s("storage", r, 1, compute, LINKS) == pytest.approx(
        2 * T_ACC + r * (D / B_S + U + D / B_S))
    assert expert_response_s("direct", r, LINKS) == pytest.approx(r * D / B_F)
    assert expert_response_s("storage", r, LINKS) == 0.0


@pytest.mark.parametrize(("r", "beta"), [(8, 4), (64, 16), (100, 10), (5, 5)])
def test_pipelined_matches_ods_when_beta_divides_r(r: int, beta: int) -> None:
    # a=1: ceil(r/beta) t_blk + t_tail, t_blk = T_acc + max(beta (D/B_s + t), beta D/B_s),
    # t_tail = T_acc + beta D/B_s.
    t_blk = T_ACC + max(beta * (D / B_S + U), beta * D / B_S)
    ods = math.ceil(r / beta) * t_blk + T_ACC + beta * D / B_S
    assert expert_handler_s("pipelined", r, beta, compute, LINKS) == pytest.approx(ods)


def test_pipelined_remainder_and_upload_bound() -> None:
    # r=10, beta=4: blocks 4, 4, 2; compute 0.01/token, store 0.001/token, T_acc 0.01.
    links = Links(0.01, 1e6, 2e6, 1000, 10**9)
    total = expert_handler_s("pipelined", 10, 4, lambda m: 0.01 * m, links)
    assert total == pytest.approx(0.054 + 0.054 + 0.032 + 0.012)
    # When compute is free, the last (small) block waits for the previous upload.
    fast = expert_handler_s("pipelined", 10, 4, lambda m: 0.0, links)
    assert fast == pytest.approx((0.01 + 0.004) * 2 + (0.01 + 0.004) + (0.01 + 0.002))
    assert expert_storage_ops("pipelined", 10, 4) == (3, 3)
    assert expert_storage_ops("storage", 10, 4) == (1, 1)
    assert expert_storage_ops("direct", 10, 4) == (0, 0)


def test_executor_transfers() -> None:
    n, k = 100, 2
    assert payload_s(n, LINKS) == (pytest.approx(n * D / B_F), False)
    big = LINKS.payload_limit // D + 1
    assert payload_s(big, LINKS) == (pytest.approx(T_ACC + big * D / B_S), True)
    # ODS's gather term: T_acc + (sum_i d_i) D_out / B_s with sum_i d_i = n k.
    assert store_io_s(n * k, LINKS) == pytest.approx(T_ACC + n * k * D / B_S)
    assert LINKS.fits_payload(2048) and not LINKS.fits_payload(2049)


def test_split_tokens() -> None:
    assert split_tokens(10, 3) == [4, 4, 2]  # chunks of ceil(d/g), as the runtime's
    assert split_tokens(10, 4) == [3, 3, 3, 1]
    assert split_tokens(2, 4) == [1, 1]
    assert split_tokens(0, 4) == []
    assert split_tokens(8, 1) == [8]


def test_distribution_router_keeps_top_k_per_token() -> None:
    rng = np.random.default_rng(0)
    router = DistributionRouter([[0.97, 0.01, 0.01, 0.01]], top_k=2)
    for n in (1, 3, 50):
        c = router.counts(0, n, rng)
        assert c.sum() == 2 * n and c.max() <= n
    uni = DistributionRouter.uniform([8], 2)
    total = sum(uni.counts(0, 100, rng) for _ in range(200))
    assert np.allclose(total / total.sum(), 1 / 8, atol=0.01)


def test_stream_stats_percentiles_within_tolerance() -> None:
    rng = np.random.default_rng(1)
    xs = rng.lognormal(0.0, 1.0, 20000)
    st = StreamStats()
    for x in xs:
        st.add(float(x))
    assert st.mean == pytest.approx(xs.mean())
    assert st.max == xs.max() and st.min == xs.min()
    for q in (0.5, 0.95, 0.99):
        exact = percentile(xs.tolist(), q)
        assert st.quantile(q) == pytest.approx(exact, rel=0.002)
    assert len(st._bins) < 5000  # bounded, not one entry per sample


def test_billing_shortcut_equals_platform_rule() -> None:
    from moefleet.platform import load_platform
    from moefleet.sim import SimConfig, Simulator
    from tests.unit.sim_helpers import plan, profile

    rng = np.random.default_rng(2)
    for name in ("aws-lambda", "aws-lambda-2020", "gcp-cloud-run-functions", "sim-test"):
        s = spec() if name == "sim-test" else load_platform(name)
        mem = s.memory_options_mb()[1] if s.memory and s.memory.options_mb else 1024
        p = plan(memory_mb=mem, segment_mb=mem).model_copy(update={"platform": s.name})
        sim = Simulator(p, profile(), s, top_k=1, config=SimConfig())
        sim.run([], 0.0)
        pool = sim.pipe.segments[0]
        for dur, init in zip(rng.exponential(0.3, 300), rng.choice([0.0, 1.234], 300),
                             strict=True):
            assert pool.billed_s(float(dur), float(init)) == s.invocation_billed_s(
                float(dur), float(init))


def test_trace_router_replays_recorded_requests() -> None:
    import pyarrow as pa

    from moefleet.sim import TraceRowRouter
    from moefleet.traces.schema import Trace, arrow_schema

    # Request "a": 3 tokens on layer 0, experts (0,1), (0,2), (1,2); request "b": 1 token.
    rows = [("a", [0, 1]), ("a", [0, 2]), ("a", [1, 2]), ("b", [3, 2])]
    table = pa.table({
        "request_id": [r for r, _ in rows], "layer": [0] * 4, "position_id": [0, 1, 2, 0],
        "token_id": [5] * 4, "attention_id": [-1] * 4, "expert_ids": [e for _, e in rows],
        "gate_weights": [[0.5, 0.5]] * 4}, schema=arrow_schema(2))
    trace = Trace(table, {"model": "m", "moe_layers": [0], "num_experts": [4], "top_k": 2})
    router = TraceRowRouter(trace)
    rng = np.random.default_rng(0)
    assert router.counts(0, 3, rng, "a").tolist() == [2, 2, 2, 0]
    assert router.counts(0, 1, rng, "b").tolist() == [0, 0, 1, 1]
    sampled = router.counts(0, 50, rng, "a")  # other length: sampled rows
    assert sampled.sum() == 100 and sampled.max() <= 50


def test_router_from_predicted_counts() -> None:
    router = DistributionRouter.from_counts([[30.0, 10.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]],
                                            [2, 4], top_k=1)
    assert router.num_experts == [2, 4]
    rng = np.random.default_rng(3)
    c = sum(router.counts(0, 100, rng) for _ in range(50))
    assert c[0] / c.sum() == pytest.approx(0.75, abs=0.02)
