"""Eq. 12c with the measured runtime footprint and intermediate memory; eq. 12f against
the strictest backend's inline budget (profiles/footprint.py, platform/inline.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moefleet.plan.costmodel import direct_fits, evaluate, memory_need_bytes
from moefleet.plan.problem import MB, PlanningProblem
from moefleet.plan.registry import get_planner
from moefleet.platform import load_platform
from moefleet.platform.inline import base64_inline_bytes
from moefleet.profiles.footprint import intermediate_per_token, measure_runtime_footprint
from moefleet.profiles.model import ComputeProfile
from tests.plan_helpers import bert_profile, skewed_counts

FOOTPRINT = {"local": 340 * MB, "aws": 352 * MB}  # what the probes measure on this repo


def _problem(footprint: dict[str, int], tokens: int = 2048) -> PlanningProblem:
    prof = bert_profile(layers=2)
    prof.runtime_bytes = dict(footprint)
    prof.intermediate_bytes_per_token = dict.fromkeys(prof.moe_layers, 3072 * 4 * 2)
    counts = skewed_counts(2, 8, tokens, seed=3)
    return PlanningProblem.from_profile(prof, load_platform("aws-lambda-2020"), counts,
                                        slo_s=60.0)


@pytest.mark.parametrize("planner", ["ods", "ods-paper", "random", "lambdaml"])
def test_no_plan_goes_below_the_runtime_footprint(planner: str) -> None:
    problem = _problem(FOOTPRINT)
    assert problem.runtime_bytes == FOOTPRINT["aws"]  # the largest over backends
    plan = get_planner(planner).plan(problem, seed=0)
    assert evaluate(problem, plan).feasible
    for li, lp in enumerate(plan.layers):
        d = problem.counts(li)
        for i, ec in enumerate(lp.experts):
            r = -(-int(d[i]) // ec.replicas)
            assert ec.memory_mb * MB >= memory_need_bytes(problem, li, r)
            assert ec.memory_mb * MB > FOOTPRINT["aws"]


def test_the_footprint_is_what_rules_out_small_functions() -> None:
    # Without it the same problem takes 128 MB functions (the finding), with it
    # none; so the test above fails if eq. 12c drops the footprint again.
    free = get_planner("ods").plan(_problem({}), seed=0)
    assert min(ec.memory_mb for lp in free.layers for ec in lp.experts) == 128
    est = evaluate(_problem(FOOTPRINT), free)
    assert not est.feasible and any("12c" in v for v in est.violations)


def test_intermediate_memory_is_measured_from_the_forward() -> None:
    d, f = 32, 128
    mlp = torch.nn.Sequential(torch.nn.Linear(d, f), torch.nn.GELU(), torch.nn.Linear(f, d))
    # Peak: the first linear's output and the GELU's (2 f floats a token), less the
    # output row eq. 12c counts as D_out.
    assert intermediate_per_token(mlp, d) == pytest.approx(2 * f * 4 - d * 4, rel=0.05)


def test_runtime_footprints_are_measured_and_kept_in_the_profile(tmp_path) -> None:
    local = measure_runtime_footprint("local")
    assert local > 100 * MB  # a fresh interpreter with torch imported
    prof = bert_profile(layers=2)
    assert not prof.has_memory and prof.footprint_bytes == 0
    prof.runtime_bytes = {"local": local, "aws": local + 1}
    prof.intermediate_bytes_per_token = {0: 10, 1: 20}
    back = ComputeProfile.load(prof.save(tmp_path / "p.json"))
    assert back.has_memory and back.footprint_bytes == local + 1
    assert back.intermediate_bytes_per_token == {0: 10, 1: 20}


def test_payload_rule_uses_the_base64_inline_budget() -> None:
    problem = _problem(FOOTPRINT)
    limit = load_platform("aws-lambda-2020").limits.sync_payload_bytes
    assert problem.payload_limit_bytes == base64_inline_bytes(limit) < limit
    r = np.arange(1, 5000)
    fits = direct_fits(problem, r)
    last = int(r[fits].max())
    assert fits[: last].all() and not fits[last:].any()
    # The raw 6 MB limit would accept ~4,096 tokens of 1,536 B; the envelope cannot.
    assert last * problem.bytes_in < 0.8 * limit
