"""Brownout routing: Alg. 1's split (worked example, special case, full brownout), gate
weights kept for united experts (eqs. 5-7), zero brownout equals the inner ExpertFn."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from moefleet.brownout.groups import BrownoutError, Grouping, index_groups, plan_layer
from moefleet.brownout.united import UnitedExperts
from moefleet.experts.brownout import BrownoutExperts
from moefleet.models.base import combine_experts

COUNTS = [2, 4, 1, 5, 2, 1, 2, 3]  # the paper's worked example, experts E0..E7


def _group_of(ways: int) -> list[int]:
    return Grouping(ways, "index", {0: index_groups(8, ways)}).group_of(0)


def test_worked_example_keeps_e3_e1_e7_and_unites_the_rest_by_group() -> None:
    plan = plan_layer(COUNTS, 0.6, _group_of(4), "partial")
    assert plan.original == (3, 1, 7)
    assert dict(plan.united) == {0: (0, 2), 1: (4, 5, 6)}
    assert plan.special == () and plan.dropped == ()


def test_a_group_with_one_brownout_expert_runs_that_expert_itself() -> None:
    plan = plan_layer(COUNTS, 0.6, _group_of(3), "partial")  # groups 012 | 345 | 67
    assert plan.original == (3, 1, 7)
    assert dict(plan.united) == {0: (0, 2), 1: (4, 5)}
    assert plan.special == (6,)


def test_full_brownout_drops_s2_and_threshold_ends_are_zero_and_all() -> None:
    assert plan_layer(COUNTS, 0.6, _group_of(4), "full").dropped == (0, 2, 4, 5, 6)
    assert sorted(plan_layer(COUNTS, 1.0, _group_of(4), "partial").original) == list(range(8))
    everything = plan_layer(COUNTS, 0.0, _group_of(2), "partial")
    assert everything.original == ()
    assert dict(everything.united) == {0: (0, 1), 1: (2, 3), 2: (4, 5), 3: (6, 7)}
    assert plan_layer([0, 3, 0, 0], 1.0, [0, 0, 1, 1], "partial").original == (1,)


@pytest.mark.parametrize("bad", [1.5, -0.1, math.nan])
def test_threshold_outside_0_1_is_a_clear_error(bad: float) -> None:
    with pytest.raises(BrownoutError, match=f"threshold {bad!r}"):
        plan_layer(COUNTS, bad, _group_of(2), "partial")


@pytest.mark.parametrize("ways", [1, 9, 0])
def test_ways_outside_2_to_experts_is_a_clear_error(ways: int) -> None:
    with pytest.raises(BrownoutError, match=f"ways={ways}"):
        index_groups(8, ways)


def _setup(ways: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    experts = [nn.Linear(6, 6, bias=False) for _ in range(8)]
    united_mods = [nn.Linear(6, 6, bias=False) for _ in range(8 // ways)]
    grouping = Grouping(ways, "index", {5: index_groups(8, ways)})
    united = UnitedExperts("m", "k", grouping, {5: list(united_mods)})

    def inner(layer: int, x_ND, ids_NK, w_NK):
        assert layer == 5
        return combine_experts(experts, x_ND, ids_NK, w_NK)

    return experts, united_mods, united, inner


def _reference(experts, united_mods, group_of, plan, x_ND, ids_NK, w_NK):
    """Eq. 5 written pair by pair: original, united (gate weight kept) or dropped."""
    keep = set(plan.original) | set(plan.special)
    to_united = {e for members in plan.united.values() for e in members}
    y = torch.zeros_like(x_ND)
    for n in range(x_ND.shape[0]):
        for k in range(ids_NK.shape[1]):
            e, w = int(ids_NK[n, k]), w_NK[n, k]
            if e in keep:
                y[n] += w * experts[e](x_ND[n])
            elif e in to_united:
                y[n] += w * united_mods[group_of[e]](x_ND[n])
    return y


@pytest.mark.parametrize("mode", ["partial", "full"])
@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.6, 0.9])
def test_wrapper_matches_the_pairwise_reference(mode: str, threshold: float) -> None:
    experts, united_mods, united, inner = _setup()
    gen = torch.Generator().manual_seed(3)
    x_ND = torch.randn(40, 6, generator=gen)
    # skewed routing so that S1 / S2 are both non-trivial; top-2 distinct experts
    ids_NK = torch.stack([torch.multinomial(torch.tensor([8., 6, 5, 4, 3, 2, 1, 1]), 2,
                                            generator=gen) for _ in range(40)])
    w_NK = torch.rand(40, 2, generator=gen).softmax(-1)
    fn = BrownoutExperts(inner, united, threshold, mode)
    with torch.no_grad():
        got = fn(5, x_ND, ids_NK, w_NK)
        plan = fn.stats.last_plan[5]
        ref = _reference(experts, united_mods, united.grouping.group_of(5), plan, x_ND,
                         ids_NK, w_NK)
    assert torch.allclose(got, ref, atol=1e-5)
    assert fn.stats.original_pairs + fn.stats.united_pairs + fn.stats.dropped_pairs == 80


def test_zero_brownout_is_exactly_the_inner_and_threshold_is_settable() -> None:
    _, _, united, inner = _setup()
    x_ND, ids_NK = torch.randn(10, 6), torch.randint(0, 8, (10, 2))
    w_NK = torch.rand(10, 2)
    fn = BrownoutExperts(inner, united, 1.0)
    with torch.no_grad():
        assert torch.equal(fn(5, x_ND, ids_NK, w_NK), inner(5, x_ND, ids_NK, w_NK))
    fn.threshold = 0.2
    with pytest.raises(BrownoutError, match="threshold 2"):
        fn.threshold = 2


def test_two_experts_of_one_group_give_one_united_output_with_summed_weights() -> None:
    _, united_mods, united, inner = _setup(ways=4)
    x_ND = torch.randn(1, 6)
    ids_NK, w_NK = torch.tensor([[0, 1]]), torch.tensor([[0.7, 0.2]])  # both in group 0
    with torch.no_grad():
        y = BrownoutExperts(inner, united, 0.0)(5, x_ND, ids_NK, w_NK)
        assert torch.allclose(y, 0.9 * united_mods[0](x_ND), atol=1e-6)


def test_full_brownout_at_zero_drops_everything_and_partial_needs_united() -> None:
    _, _, united, inner = _setup()
    x_ND, ids_NK, w_NK = torch.randn(7, 6), torch.randint(0, 8, (7, 2)), torch.rand(7, 2)
    assert torch.count_nonzero(
        BrownoutExperts(inner, united.grouping, 0.0, "full")(5, x_ND, ids_NK, w_NK)) == 0
    with pytest.raises(BrownoutError, match="partial brownout needs united experts"):
        BrownoutExperts(inner, united.grouping, 0.5, "partial")
    with pytest.raises(BrownoutError, match="mode 'half'"):
        BrownoutExperts(inner, united, 0.5, "half")
    with pytest.raises(BrownoutError, match="layer 4"):
        BrownoutExperts(inner, united, 0.5)(4, x_ND, ids_NK, w_NK)


@pytest.mark.parametrize(("args", "needle"), [
    (["--ways", "1"], "ways=1 is not in [2, 8]"),
    (["--ways", "2,x"], "--ways '2,x' is not a list of integers"),
    (["--grouping", "cosine"], "grouping 'cosine' is unknown"),
])
def test_distill_cli_rejects_bad_values_with_one_line(args: list[str], needle: str) -> None:
    from typer.testing import CliRunner

    from moefleet.cli import app

    res = CliRunner().invoke(app, ["brownout", "distill", "--model", "tiny-olmoe-random", *args])
    assert res.exit_code == 2
    assert needle in res.output.replace("\n", " ")


def test_stacked_united_experts_equal_the_loop_and_need_gated_experts() -> None:
    """The stacked united kernel (two batched matmuls per layer) computes what the loop
    over united modules does; modules that are not gated experts fall back to the loop."""
    from moefleet.models.experts import GatedExpert

    gen = torch.Generator().manual_seed(4)

    def gated() -> GatedExpert:
        return GatedExpert(torch.randn(10, 6, generator=gen), torch.randn(6, 5, generator=gen),
                           nn.functional.silu)

    experts = [gated() for _ in range(8)]
    grouping = Grouping(2, "index", {5: index_groups(8, 2)})
    united = UnitedExperts("m", "k", grouping, {5: [gated() for _ in range(4)]})

    def inner(layer: int, x_ND, ids_NK, w_NK):
        return combine_experts(experts, x_ND, ids_NK, w_NK)

    x_ND = torch.randn(30, 6, generator=gen)
    ids_NK = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(30)])
    w_NK = torch.rand(30, 2, generator=gen).softmax(-1)
    loop = BrownoutExperts(inner, united, 0.3, united_kernel="loop")
    stacked = BrownoutExperts(inner, united, 0.3, united_kernel="stacked")
    with torch.no_grad():
        want, got = loop(5, x_ND, ids_NK, w_NK), stacked(5, x_ND, ids_NK, w_NK)
    assert stacked.stats.united_pairs > 0 and stacked._stacked[5] is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    _, _, linear_united, linear_inner = _setup()
    fallback = BrownoutExperts(linear_inner, linear_united, 0.3, united_kernel="stacked")
    with torch.no_grad():
        fallback(5, x_ND, ids_NK, w_NK)
    assert fallback._stacked[5] is None  # nn.Linear united experts: the loop ran
    with pytest.raises(BrownoutError, match="united kernel"):
        BrownoutExperts(inner, united, 0.3, united_kernel="fused")
