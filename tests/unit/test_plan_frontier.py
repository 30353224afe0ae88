"""The decomposition: per-layer frontiers and the knapsack, against brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from moefleet.plan.base import Frontiers
from moefleet.plan.combine import choose
from moefleet.plan.frontier import LayerTables, choose_experts, layer_frontier
from tests.plan_helpers import layer_configs, tiny_problem


def _pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for lat, cost in sorted(points):
        if not out or cost < out[-1][1]:
            out.append((lat, cost))
    return out


@pytest.mark.parametrize("bytes_per_token", [400_000, 1_500_000])
def test_layer_frontier_equals_enumeration(bytes_per_token: int) -> None:
    p = tiny_problem([[5, 0, 9], [3, 7, 2]], 100.0, bytes_per_token=bytes_per_token)
    for li in range(2):
        configs = layer_configs(p, li)
        tab = LayerTables(p, li)
        for a in (1, 2, 3):
            want = _pareto([(lat, c) for lat, c, cfg in configs if cfg[0] == a])
            got = layer_frontier(tab, a)
            assert got.exact
            assert len(got) == len(want), (li, a)
            np.testing.assert_allclose(got.latency_s, [w[0] for w in want], rtol=1e-9)
            np.testing.assert_allclose(got.cost_usd, [w[1] for w in want], rtol=1e-9)


def test_reconstructed_choice_has_the_frontier_point_cost() -> None:
    from moefleet.plan.base import build_plan

    p = tiny_problem([[5, 0, 9], [3, 7, 2]], 100.0, bytes_per_token=1_500_000)
    fr = Frontiers(p)
    for a in (1, 2, 3):
        f0, f1 = fr.get(0, a), fr.get(1, a)
        for k0, k1 in itertools.product(range(len(f0)), range(len(f1))):
            _, est = build_plan(p, [fr.choice(0, a, k0), fr.choice(1, a, k1)], "t")
            assert est.layers[0].cost_usd == pytest.approx(f0.cost_usd[k0], rel=1e-9)
            assert est.layers[1].latency_s == pytest.approx(f1.latency_s[k1], rel=1e-9)


def test_idle_experts_get_the_smallest_memory_holding_parameters() -> None:
    p = tiny_problem([[4, 0]], 100.0, param_bytes=300 * 2**20)  # 300 MB: not 128 MB
    _, experts = choose_experts(LayerTables(p, 0), 2, np.inf, 0)
    assert experts[1].memory_mb == 768 and experts[1].replicas == 1


def _random_frontier(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    lat = np.sort(rng.uniform(0.1, 5.0, n))
    cost = np.sort(rng.uniform(1.0, 10.0, n))[::-1]
    keep = np.concatenate([[True], np.diff(lat) > 0]) & np.concatenate(
        [[True], np.diff(cost) < 0])
    return lat[keep], cost[keep]


@pytest.mark.parametrize("seed", range(6))
def test_knapsack_is_exact_and_the_fallback_is_bounded(seed: int) -> None:
    rng = np.random.default_rng(seed)
    fronts = [_random_frontier(rng, int(rng.integers(1, 7))) for _ in range(4)]
    lats, costs = [f[0] for f in fronts], [f[1] for f in fronts]
    budget = float(sum(lat[0] for lat in lats) + rng.uniform(0.0, 6.0))
    best = min(
        sum(c[k] for c, k in zip(costs, ks, strict=True))
        for ks in itertools.product(*[range(len(x)) for x in lats])
        if sum(lat[k] for lat, k in zip(lats, ks, strict=True)) <= budget
    )
    sel = choose(lats, costs, budget)
    assert sel is not None and sel.exact
    assert sel.cost == pytest.approx(best, rel=1e-12)
    assert sel.latency <= budget + 1e-9
    # pair_cap=0 forces the Lagrangian + greedy path: feasible, bounded by its dual.
    lag = choose(lats, costs, budget, pair_cap=0)
    assert lag is not None and lag.latency <= budget + 1e-9
    assert lag.lower_bound <= best * (1 + 1e-9) <= lag.cost * (1 + 1e-9)
    # No combination fits: None.
    assert choose(lats, costs, float(sum(lat[0] for lat in lats)) * 0.99) is None


def test_experts_too_big_for_any_memory_are_infeasible() -> None:
    from moefleet.plan import InfeasibleError, OdsPlanner

    for counts in ([[4, 0]], [[0, 0]]):  # active or idle, 2 GB of parameters fit nowhere
        p = tiny_problem(counts, 100.0, param_bytes=2 << 30)
        with pytest.raises(InfeasibleError, match="no configuration holds"):
            OdsPlanner().plan(p)
