"""PlanningProblem: construction from profiles, validation messages, memory candidates."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from moefleet.errors import DataError, MoefleetError
from moefleet.plan import PlanningProblem, candidate_memory_options
from moefleet.platform import load_platform
from moefleet.profiles.model import BatchLaw, FunctionProfile, ThreadLaw
from tests.plan_helpers import BERT_EXPERT, bert_profile, skewed_counts, tiny_problem

SPEC = load_platform("aws-lambda-2020")


def test_from_profile_takes_u_j_at_the_platform_vcpus() -> None:
    prof = bert_profile(3)
    counts = skewed_counts(3, 4, 1000)
    p = PlanningProblem.from_profile(prof, SPEC, counts, slo_s=30.0)
    assert p.memory_options_mb == tuple(SPEC.memory_options_mb())  # 14 options: all of them
    j = p.memory_options_mb.index(1536)
    # eq. 3: U_j = the expert's per-token time at vcpus(1536 MB) = 1536/1792 vCPU.
    assert p.per_token_s_LJ[1, j] == pytest.approx(BERT_EXPERT.per_token_s(1536 / 1792))
    assert p.per_token_s(0, 3008) == pytest.approx(BERT_EXPERT.per_token_s(3008 / 1792))
    assert p.tokens == 1000  # top-1: the largest layer sum
    assert p.expert_param_bytes == (BERT_EXPERT.param_bytes,) * 3
    assert p.bytes_in == p.bytes_out == 3072
    # Segment times at the segment memory (the baseline, 3008 MB) for the batch's tokens.
    seg = prof.segments[1].time_s(1000, SPEC.vcpus(3008))
    assert p.segment_time_s[1] == pytest.approx(seg)
    assert p.fixed_latency_s == pytest.approx(sum(p.segment_time_s))
    # T_load of the last MoE layer uses the last block's segment.
    assert p.load_s(2) == pytest.approx(0.02 + 0.05 + prof.segments[2].param_bytes / 80e6)


def test_nan_and_zero_profiles_are_rejected() -> None:
    prof = bert_profile(2)
    for bad in (float("nan"), 0.0):
        law = FunctionProfile(BatchLaw(0.0, bad), ThreadLaw(0.0, 1.0, 1e-4), 1000)
        broken = dataclasses.replace(prof, experts={0: law, 1: law})
        with pytest.raises(DataError, match="per-token expert times"):
            PlanningProblem.from_profile(broken, SPEC, [[1, 2], [3, 0]], slo_s=10.0)


def test_counts_must_fit_the_model() -> None:
    prof = bert_profile(2)
    with pytest.raises(DataError, match=r"shape \(3, 4\).*2 MoE layers"):
        PlanningProblem.from_profile(prof, SPEC, np.ones((3, 4), int), slo_s=10.0)
    with pytest.raises(DataError, match="counts for more"):
        PlanningProblem.from_profile(prof, SPEC, np.ones((2, 4), int), slo_s=10.0,
                                     num_experts=[4, 2])
    with pytest.raises(DataError, match="non-negative"):
        tiny_problem([[1, -1]], 10.0)
    with pytest.raises(DataError, match="NaN"):
        tiny_problem(np.array([[1.0, math.nan]]), 10.0)  # type: ignore[arg-type]


def test_expected_counts_round_up_and_bad_slo() -> None:
    p = tiny_problem(np.array([[1.2, 0.0], [2.0, 3.5]]), 10.0)  # type: ignore[arg-type]
    assert p.counts_LE.tolist() == [[2, 0], [2, 4]]
    for slo in (0.0, -1.0, math.inf):
        with pytest.raises(DataError, match="SLO"):
            tiny_problem([[1, 2]], slo)


def test_only_faas_platforms() -> None:
    with pytest.raises(MoefleetError, match="cluster"):
        PlanningProblem.from_profile(bert_profile(1), load_platform("cpu-cluster"),
                                     [[1, 2]], slo_s=10.0)


def test_memory_candidates_on_a_1mb_step_platform() -> None:
    spec = load_platform("aws-lambda")  # 128..10240 MB in 1 MB steps
    opts = candidate_memory_options(spec)
    assert len(opts) <= 24 and opts == sorted(set(opts))
    assert opts[0] == 128 and opts[-1] == 10240
    assert 1769 in opts and 3538 in opts  # where AWS reaches 1 and 2 whole vCPUs
    assert all(spec.is_valid_memory(m) for m in opts)
    assert candidate_memory_options(SPEC) == SPEC.memory_options_mb()


def test_with_slo_shares_everything_else() -> None:
    p = tiny_problem([[1, 2]], 10.0)
    q = p.with_slo(5.0)
    assert q.slo_s == 5.0 and q.counts_LE is p.counts_LE and q.platform is p.platform


def test_warm_instances_is_opt_in_in_every_constructor() -> None:
    from types import SimpleNamespace

    prof = bert_profile(3)
    counts = skewed_counts(3, 4, 1000)
    assert not PlanningProblem.from_profile(prof, SPEC, counts, slo_s=30.0).warm_instances
    assert not tiny_problem([[1, 2]], 10.0).warm_instances
    p = PlanningProblem.from_profile(prof, SPEC, counts, slo_s=30.0, warm_instances=True)
    assert p.warm_instances and p.with_slo(20.0).warm_instances
    assert p.load_s(0) == SPEC.startup.warm_start_s  # type: ignore[union-attr]
    summary = SimpleNamespace(name="bert-moe-hand", moe_layers=[0, 1, 2], num_layers=3,
                              num_experts=[4] * 3, top_k=1)
    assert PlanningProblem.from_summary(summary, prof, SPEC, counts, 30.0,
                                        warm_instances=True).warm_instances
    assert tiny_problem([[1, 2]], 10.0, warm_instances=True).warm_instances
