"""The cost model's audit fixes, by hand: the platform's vCPU cap (time and price),
cold starts that load the weights (main and remote overlapped), one GPU card's memory."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from moefleet.plan.remoe import Layout, RemoeProblem, TimeLaw, evaluate, plan_policy
from moefleet.plan.remoe.problem import InfeasibleError, RemoeError
from tests.unit.remoe_helpers import GB, remoe_problem


def tiny(**kw: object) -> RemoeProblem:
    return remoe_problem(**{"law": TimeLaw(4.0, 1.0, 1.0), **kw})


def _mix(p: RemoeProblem, main_mb: int) -> Layout:
    return Layout("mix", main_mb, np.zeros((1, 2), bool), (0,), ((),))


def test_vcpu_cap_slows_nothing_below_it_and_bills_only_memory_above_it() -> None:
    t1, t2 = 4 * math.exp(-1) + 1, 4 * math.exp(-2) + 1  # T(1), T(2)
    free = evaluate(tiny(), _mix(tiny(), 2048))
    capped = tiny(max_vcpus=1.0, cpu_mem_price_gb_s=0.25)
    est = evaluate(capped, _mix(capped, 2048))
    # decode per token: 1 + 2·τ_sw(1) (= 1) + the local experts: 1 token x T(vCPUs)
    assert free.gt_s == pytest.approx(2 * (1 + 1 + t2))
    assert est.gt_s == pytest.approx(2 * (1 + 1 + t1))  # 2 GB but only 1 vCPU
    # main rate: GPU 3·1 GB + CPU c_c·1 (the vCPU GB) + 0.25·1 (memory only above the cap)
    assert est.c_loc == pytest.approx((est.pt_s + est.gt_s) * (3.0 + 1.0 + 0.25))
    assert free.c_loc == pytest.approx((free.pt_s + free.gt_s) * (3.0 + 2.0))
    assert capped.cpu_rate(np.array([0.5, 1.0, 3.0])) == pytest.approx([0.5, 1.0, 1.5])
    with pytest.raises(RemoeError, match="exceeds the whole CPU price"):
        tiny(cpu_mem_price_gb_s=2.0)


def test_cold_start_loads_weights_and_overlaps_main_with_remote() -> None:
    p = tiny(load_bytes_s=float(GB))  # 1 GB/s
    remoe = Layout("remoe", 1024, np.array([[False, True]]), (1024,), (((1,),),))
    # main: 3 s + (0.5 GB non-experts + 1 local expert of 0.25 GB) / 1 GB/s = 3.75 s;
    # remote: 1 s + 0.25 GB = 1.25 s, in parallel: the main's 3.75 s counts.
    est = evaluate(p, remoe)
    assert est.cold_s == pytest.approx(3.75)
    assert est.ttft_s == pytest.approx(est.pt_s + 3.75)
    # monolithic layouts load both experts: 3 + 0.5 + 0.5
    for kind in ("mix", "gpu", "cpu", "fetch"):
        lay = Layout(kind, 2048, np.zeros((1, 2), bool), (0,), ((),))  # type: ignore[arg-type]
        assert evaluate(p, lay).cold_s == pytest.approx(4.0)
    # a slow remote start dominates: 10 s + 0.25 s
    assert evaluate(tiny(load_bytes_s=float(GB), cold_remote_s=10.0), remoe).cold_s == \
        pytest.approx(10.25)
    # without a load rate the cold start is the platform's constant, as before
    assert evaluate(tiny(), remoe).cold_s == pytest.approx(3.0)


def test_a_gpu_layout_must_fit_on_one_card() -> None:
    # GPU baseline: 0.5 + 2 x 0.25 GB + 6 tokens of 100 B -> two 1 GB slices: fits on 2 GB
    p = tiny(gpu_card_gb=2.0)
    assert plan_policy(p, "gpu").estimate.gpu_gb == 2.0
    big = tiny(gpu_card_gb=2.0, expert_bytes=1.0 * GB)  # 2.5 GB + tokens -> 3 slices
    with pytest.raises(InfeasibleError, match="needs 3 GB of GPU memory, one GPU of the "
                                              "platform has 2 GB"):
        plan_policy(big, "gpu")
    loose = plan_policy(big, "gpu", check_slo=False)
    assert "billed as if it fitted" in loose.meta["gpu_over_one_card"]
    assert plan_policy(p, "mix").estimate.gpu_gb == 1.0  # experts on CPU: one slice


def test_sensitivity_scales_one_input_and_finds_the_factor() -> None:
    from moefleet.plan.remoe.sensitivity import INPUTS, factor_needed, ratio_vs_gpu, scale

    p = tiny()
    q = scale(p, "gpu_time", 2.0)
    assert (q.nonexpert_token_s, q.gpu_expert_token_s) == (2.0, 0.2)
    assert q.law == p.law and q.gpu_price_gb_s == p.gpu_price_gb_s
    q = scale(p, "cpu_expert_time", 0.5)
    assert q.law(1.0) == pytest.approx(p.law(1.0) / 2) and q.nonexpert_cpu_token_s == 2.0
    assert scale(p, "cpu_price", 3.0).cpu_price_gb_s == 3.0
    for name in INPUTS:  # every input changes the problem
        assert scale(p, name, 2.0) != p
    with pytest.raises(RemoeError, match="unknown input"):
        scale(p, "nope", 2.0)
    # MIX vs GPU: a costlier GPU makes MIX (1 GB of GPU) relatively cheaper than GPU-only
    # (2 GB of GPU), so the ratio falls as the GPU price factor grows.
    base = ratio_vs_gpu([p], "mix")
    got = factor_needed([p], "mix", "gpu_price", base * 0.9, lo=0.1, hi=10.0, points=9)
    assert got["ratio_at_1"] == pytest.approx(base)
    assert got["factor"] is not None and got["factor"] > 1.0
    ratios = [q for _, q in got["grid"]]
    assert all(a >= b for a, b in itertools.pairwise(ratios))
    assert factor_needed([p], "mix", "gpu_price", 0.0, lo=0.1, hi=10.0, points=5)[
        "factor"] is None
