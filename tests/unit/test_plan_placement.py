"""Placement: the one derivation of function names and what each function holds."""

from __future__ import annotations

import pytest

from moefleet.plan import DeploymentPlan, PlacedFunction, Placement


def test_plan_placement_one_function_per_expert() -> None:
    plan = DeploymentPlan.uniform("m", "aws-lambda", [1, 2], [2, 3], 3, 1024, replicas=2,
                                  segment_memory_mb=512)
    pl = plan.placement()
    assert pl.names == ["seg-0", "seg-1", "seg-2", "exp-1-0", "exp-1-1",
                        "exp-2-0", "exp-2-1", "exp-2-2"]
    assert plan.function_names() == pl.names and pl.main is None
    assert pl.segment(2).memory_mb == 512 and pl.segment(2).layer == 2
    e = pl.holder(2, 1)
    assert (e.name, e.role, e.layer, e.experts, e.memory_mb, e.replicas) == (
        "exp-2-1", "expert", 2, (1,), 1024, 2)
    assert [f.experts for f in pl.expert_functions(2)] == [(0,), (1,), (2,)]
    with pytest.raises(KeyError, match="expert 3 of layer 2"):
        pl.holder(2, 3)


def test_groups_and_main_are_expressible() -> None:
    pl = Placement.build([256], [(0, (0, 1), 2048, 1), (0, (2,), 1024, 1)],
                         main_memory_mb=4096)
    assert pl.holder(0, 1).name == "exp-0-0_1" and pl.holder(0, 2).name == "exp-0-2"
    assert pl.main is not None and pl.main.layer is None and pl.main.experts == ()


@pytest.mark.parametrize("fns, match", [
    ((PlacedFunction("seg-1", "segment", 1, 256),), "blocks 0..n-1"),
    ((PlacedFunction("a", "expert", 0, 256, (0,)), PlacedFunction("b", "expert", 0, 256, (0,))),
     "expert 0 of layer 0 is in a and b"),
    ((PlacedFunction("a", "expert", 0, 256, (0,)), PlacedFunction("a", "expert", 0, 256, (1,))),
     "repeat"),
])
def test_inconsistent_placements_are_refused(fns: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Placement(fns)


def test_function_fields_are_checked() -> None:
    with pytest.raises(ValueError, match="only expert functions hold experts"):
        PlacedFunction("seg-0", "segment", 0, 256, (1,))
    with pytest.raises(ValueError, match="main has none"):
        PlacedFunction("main", "main", 0, 256)
    with pytest.raises(ValueError, match=">= 1"):
        PlacedFunction("exp-0-0", "expert", 0, 0, (0,))


def test_group_names_stay_short_and_distinct() -> None:
    from moefleet.plan.placement import MAX_NAME, expert_name

    assert expert_name(0, (2, 3)) == "exp-0-2_3"
    assert expert_name(0, tuple(range(32))) == "exp-0-0to31"
    assert expert_name(1, (0, 1, 2, 5, 7, 8, 9)) == "exp-1-0to2_5_7to9"
    evens, odds = tuple(range(0, 64, 2)), tuple(range(1, 64, 2))
    names = {expert_name(3, evens), expert_name(3, odds), expert_name(3, evens[:-1])}
    assert len(names) == 3 and all(len(n) <= MAX_NAME for n in names)
