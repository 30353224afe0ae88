"""Remoe's planner: eqs. 1-10 by hand, Theorem 1, MMP, the dual vs brute force, LPT."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from moefleet.plan.remoe import (
    Layout,
    RemoeError,
    RemoeProblem,
    TimeLaw,
    evaluate,
    fit_time_law,
    lpt,
    mmp,
    select_remote,
    solve_memory,
    theorem1_bound,
)
from moefleet.plan.remoe.problem import InfeasibleError
from moefleet.plan.remoe.solve import worst_case
from tests.unit.remoe_helpers import GB, remoe_problem


def tiny(**kw: object) -> RemoeProblem:
    return remoe_problem(**kw)


def test_equations_by_hand() -> None:
    p = tiny()
    x = np.array([[False, True]])
    est = evaluate(p, Layout("remoe", 1024, x, (2048,), (((1,),),)))
    # prefill tokens: 4·1·0.75 = 3 local, 1 remote; T = 2 s at any memory.
    # local 3·2 = 6; remote replica ZT = 1·(2 + 2·100/1000) + 0.5 = 2.7 (eq. 3)
    # τ_sw(4) = 4·100/200 = 2, twice (eq. 2); non-experts 4·1 (eq. 1)
    assert est.pt_s == pytest.approx(4 + 6 + 2 * 2)
    # decode per token: 1 + 2·τ_sw(1) (=1) + max(0.75·2, r) with r = 0.25·2.2 + 0.25·0.5
    r = 0.25 * 2.2 + 0.25 * 0.5
    assert est.gt_s == pytest.approx(2 * (1 + 1 + max(1.5, r)))
    assert est.ttft_s == pytest.approx(est.pt_s + 3.0)
    assert est.tpot_s == pytest.approx(est.gt_s / 2)
    # M_g: 0.5 GB of non-experts + 6 tokens x 100 B, rounded up to a 1 GB slice (eq. 7)
    assert est.gpu_gb == 1.0
    assert est.c_loc == pytest.approx((est.pt_s + est.gt_s) * (3.0 * 1 + 1.0 * 1))  # eq. 6
    assert est.pc_rem == pytest.approx(1.0 * 2 * 2.7)  # eq. 8: c_c·y·ΣZT
    assert est.gc_rem == pytest.approx(1.0 * 2 * 2 * r)  # eq. 9: c_c·y·n_out·r
    assert est.cost == pytest.approx(est.c_loc + est.pc_rem + est.gc_rem)


def test_cpu_and_gpu_layouts_by_hand() -> None:
    p = tiny()
    none = np.zeros((1, 2), bool)
    cpu = evaluate(p, Layout("cpu", 2048, none, (0,), ((),)))
    t = 2.0  # the law is flat: 2 GB runs like 1 GB
    assert cpu.pt_s == pytest.approx(4 * 4.0 + 4 * t)  # non-experts on CPU, no swaps
    assert cpu.gt_s == pytest.approx(2 * (4.0 + t))
    assert cpu.gpu_gb == 0 and cpu.c_loc == pytest.approx((cpu.pt_s + cpu.gt_s) * 2.0)
    gpu = evaluate(p, Layout("gpu", 1024, none, (0,), ((),)))
    assert gpu.gt_s == pytest.approx(2 * (1.0 + 0.1))
    assert gpu.gpu_gb == 2.0  # 0.5 + 2 x 0.25 GB of experts + 600 B of tokens: 2 slices


def test_theorem1_bound_holds_on_uniform_routing() -> None:
    assert theorem1_bound(100, 10) == pytest.approx(math.sqrt(300) / 2 + 10)
    assert theorem1_bound(100, 10, 10) == 100  # never more than n
    rng = np.random.default_rng(0)
    n, k = 400, 16
    counts = rng.multinomial(n, np.full(k, 1 / k), size=2000)
    assert np.mean(counts.max(axis=1) <= theorem1_bound(n, k)) >= 0.95


def test_fit_time_law_recovers_parameters() -> None:
    mem = np.array([1024, 2048, 3072, 4096, 6144, 8192])
    true = TimeLaw(0.02, 0.7, 0.003)
    law = fit_time_law(mem, [true(m / 1024) for m in mem])
    for m in mem:
        assert law(m / 1024) == pytest.approx(true(m / 1024), rel=1e-3)
    with pytest.raises(RemoeError, match="memory points"):
        fit_time_law([0, 1024], [1.0, 0.5])


def _deep(L: int = 3, E: int = 8, **kw: object) -> RemoeProblem:
    rng = np.random.default_rng(1)
    base: dict[str, object] = dict(
        model="d", s_LE=rng.dirichlet(np.full(E, 0.5), size=L), top_k=2, n_in=32,
        n_out=16, ttft_slo_s=30.0, tpot_slo_s=0.5,
        main_memory_mb=tuple(range(1024, 16385, 512)), remote_memory_mb=(1024, 2048, 3072,
                                                                           4096),
        cpu_price_gb_s=1.4e-5, gpu_price_gb_s=1.5e-5, token_bytes=4096.0,
        transfer_bytes_s=5e7, invoke_overhead_s=0.005, law=TimeLaw(0.016, 0.65, 0.002),
        expert_bytes=0.02 * GB, nonexpert_bytes=0.3 * GB, kv_bytes_per_token=1e4,
        nonexpert_token_s=1e-4, nonexpert_cpu_token_s=5e-3, gpu_expert_token_s=5e-5,
        swap_bytes_s=1.2e10, cold_main_s=2.0, cold_remote_s=1.0, prefill_factor=0.2)
    base.update(kw)
    return RemoeProblem(**base)  # type: ignore[arg-type]


def test_mmp_returns_the_largest_feasible_ratio() -> None:
    p = _deep(tpot_slo_s=0.2)
    m = mmp(p)
    ttft, tpot = worst_case(p, m.remote_per_layer, m.main_mb)
    assert ttft <= p.ttft_slo_s and tpot <= p.tpot_slo_s
    # every larger ratio on the ε grid fails with its own main memory
    for r in range(m.remote_per_layer + 1, p.num_experts + 1):
        x = np.zeros((p.num_layers, p.num_experts), bool)
        x[:, :r] = True
        from moefleet.plan.remoe.model import main_need_mb
        mb = p.round_main(max(main_need_mb(p, "remoe", x), p.remote_memory_mb[-1]))
        t2, g2 = worst_case(p, r, mb)
        assert t2 > p.ttft_slo_s or g2 > p.tpot_slo_s
    with pytest.raises(InfeasibleError, match=r"the fastest layout gives TTFT .* s / TPOT"):
        mmp(_deep(tpot_slo_s=1e-4))


def test_select_remote_takes_the_lowest_utility() -> None:
    p = _deep()
    x = select_remote(p, 3)
    for li in range(p.num_layers):
        u = p.utility_LE[li]
        assert x[li].sum() == 3 and u[x[li]].max() <= u[~x[li]].min()


@pytest.mark.parametrize("frac", [2.0, 0.6, 0.1])
def test_dual_matches_brute_force(frac: float) -> None:
    """frac places the TPOT SLO between the fastest remote memory (0) and the
    unconstrained optimum (1): above 1 the constraint is slack, below it binds."""
    from moefleet.plan.remoe.model import remote_decode_s

    law = TimeLaw(0.016, 2.0, 0.002)  # θ2 large enough for Theorem 2 here
    main_mb, gpu_gb = 8192, 1.0
    probe = _deep(L=2, law=law, tpot_slo_s=10.0)
    x = select_remote(probe, 6)
    share = np.sum(probe.s_LE * x, axis=1)
    loc = probe.top_k * np.sum(probe.s_LE * ~x, axis=1) * law(main_mb / 1024)
    fixed = 2 * (probe.nonexpert_token_s + 2 * probe.swap_s(probe.top_k))

    def tpot_at(y: np.ndarray) -> float:
        return fixed + float(np.sum(np.maximum(loc, remote_decode_s(probe, share, y))))

    free = solve_memory(probe, x, main_mb, gpu_gb)
    t_fast, t_free = tpot_at(np.array([4.0, 4.0])), tpot_at(free.y_gb)
    p = _deep(L=2, law=law, tpot_slo_s=t_fast + frac * (t_free - t_fast))
    res = solve_memory(p, x, main_mb, gpu_gb)
    assert (res.lam > 0) == (frac < 1)
    assert res.convex
    hw = p.gpu_price_gb_s * gpu_gb + p.cpu_price_gb_s * main_mb / 1024
    budget = p.tpot_slo_s - p.num_layers * (p.nonexpert_token_s + 2 * p.swap_s(p.top_k))

    def objective(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # y: (..., L) GB
        r = remote_decode_s(p, share, y)
        f = np.sum((1 + p.eta) * p.n_out * r * (hw + p.cpu_price_gb_s * y), axis=-1)
        return f, np.sum(np.maximum(loc, r), axis=-1) <= budget + 1e-12

    grid = np.linspace(1.0, 4.0, 601)
    Y = np.stack(np.meshgrid(grid, grid, indexing="ij"), -1).reshape(-1, 2)
    f, ok = objective(Y)
    cont_best = float(f[ok].min())
    assert res.primal == pytest.approx(cont_best, rel=2e-3)
    assert res.primal <= cont_best * (1 + 1e-9)
    assert res.dual <= res.primal * (1 + 1e-9)  # weak duality
    opts = np.array(p.remote_memory_mb) / 1024
    D = np.array(list(itertools.product(opts, opts)))
    fd, okd = objective(D)
    rounded = np.array(res.remote_mb) / 1024
    fr, okr = objective(rounded[None, :])
    assert okr[0]  # rounding up keeps TPOT
    assert res.primal <= fd[okd].min() * (1 + 1e-9) <= fr[0] * (1 + 1e-9)


def test_dual_reports_infeasible_tpot() -> None:
    p = _deep(L=2, tpot_slo_s=0.01)
    with pytest.raises(InfeasibleError, match="largest remote memory"):
        solve_memory(p, select_remote(p, 8), 8192, p.gpu_memory_gb())


def _makespan(sizes: list[float], bins: list[list[int]]) -> float:
    return max(sum(sizes[i] for i in b) for b in bins)


def test_lpt_within_grahams_bound() -> None:
    rng = np.random.default_rng(3)
    for _ in range(60):
        n = int(rng.integers(3, 8))
        z = int(rng.integers(2, 4))
        sizes = [float(v) for v in rng.integers(1, 20, size=n)]
        opt = min(max(sum(sizes[i] for i in range(n) if a[i] == j) for j in range(z))
                  for a in itertools.product(range(z), repeat=n))
        bins = lpt(sizes, z)
        assert sorted(i for b in bins for i in b) == list(range(n))
        assert _makespan(sizes, bins) <= (4 / 3 - 1 / (3 * z)) * opt + 1e-9
    # Graham's tight case: 2z+1 jobs reach the bound exactly
    sizes = [5.0, 5.0, 4.0, 4.0, 3.0, 3.0, 3.0]
    assert _makespan(sizes, lpt(sizes, 3)) == pytest.approx((4 / 3 - 1 / 9) * 9)


def test_problem_validation() -> None:
    with pytest.raises(RemoeError, match="sum to 1"):
        tiny(s_LE=np.array([[2.0, 1.0]]))
    with pytest.raises(RemoeError, match="strictly increasing"):
        tiny(main_memory_mb=(2048, 1024))
    with pytest.raises(RemoeError, match="top_k"):
        tiny(top_k=3)


def test_planner_end_to_end_and_sweep() -> None:
    from moefleet.plan.remoe import plan_policy

    p = _deep(L=3, tpot_slo_s=0.2)
    paper = plan_policy(p, "remoe")
    swept = plan_policy(p, "remoe-sweep")
    assert paper.estimate.meets(p) and swept.estimate.meets(p)
    assert swept.estimate.cost <= paper.estimate.cost * (1 + 1e-12)
    assert paper.meta["mmp"]["b"] * p.num_experts == paper.layout.remote_LE[0].sum()
    z = paper.layout.replicas
    assert all(1 <= zl <= p.max_replicas for zl, has in
               zip(z, paper.layout.remote_LE.any(axis=1), strict=True) if has)
    plan = paper.to_plan(p)
    assert plan.main is not None and plan.main.memory_mb == paper.layout.main_mb
    mix = plan_policy(p, "mix", check_slo=False)
    assert swept.estimate.cost <= mix.estimate.cost * (1 + 1e-9) or not mix.estimate.meets(p)


def test_main_memory_holds_the_runtimes_a_real_function_needs() -> None:
    """(10f) plus the runtime's host memory, and the CUDA runtime's for a GPU main: the
    paper's constraint alone sized a GPU main that did not start on a real GPU."""
    from moefleet.plan.remoe.model import main_need_mb, remote_need_mb

    none = np.zeros((1, 2), bool)
    bare = remoe_problem()
    real = remoe_problem(runtime_mb=300.0, gpu_runtime_mb=900.0)
    for kind in ("gpu", "mix", "fetch", "remoe"):  # fetch: once through plan_baseline too
        assert main_need_mb(real, kind, none) == pytest.approx(
            main_need_mb(bare, kind, none) + 1200.0)
    assert main_need_mb(real, "cpu", none) == pytest.approx(main_need_mb(bare, "cpu", none)
                                                            + 300.0)
    assert bare.has_gpu and not remoe_problem(gpu_price_gb_s=0.0, gpu_runtime_mb=900.0,
                                              runtime_mb=0.0).has_gpu
    one = np.array([False, True])
    assert remote_need_mb(real, one, 0) == pytest.approx(remote_need_mb(bare, one, 0) + 300)
    assert remote_need_mb(real, none[0], 0) == 0.0  # no remote experts, no function
    cpu_only = remoe_problem(gpu_price_gb_s=0.0, gpu_runtime_mb=900.0)
    assert main_need_mb(cpu_only, "gpu", none) == main_need_mb(bare, "gpu", none)
    from moefleet.plan.remoe.planner import plan_policy

    plan = plan_policy(real, "gpu", check_slo=False)
    assert plan.layout.main_mb == 2048  # 1200 MB of runtimes do not fit the 1024 MB option
    assert plan_policy(bare, "gpu", check_slo=False).layout.main_mb == 1024
    fetch = plan_policy(real, "fetch", check_slo=False).layout.main_mb
    assert fetch >= main_need_mb(real, "fetch", none) > 1200
