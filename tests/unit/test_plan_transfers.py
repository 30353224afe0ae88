"""Segment and coordinator store requests (plan.transfers) by hand, and the shared rules.

Problem: aws-lambda-2020 (inline budget (6,291,456 - 1024)*3//4 = 4,717,824 B; spill
budget 4,717,824 - 4096 - 1024 = 4,712,704 B), one MoE layer of 2 blocks, top-1, 10
tokens, segments of 0.5 s.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moefleet.plan import PlanningProblem
from moefleet.plan.transfers import Requests, batch_requests, layer_requests
from moefleet.platform import load_platform, polling
from moefleet.platform.inline import spill_names


def _problem(bytes_per_token: int) -> PlanningProblem:
    return PlanningProblem.explicit(
        model="hand", platform=load_platform("aws-lambda-2020"), moe_layers=[0],
        num_experts=[2], num_blocks=2, counts_LE=[[6, 4]], expert_param_bytes=8_000_000,
        bytes_per_token=bytes_per_token, memory_options_mb=[768], per_token_s=[0.01],
        slo_s=10.0, segment_time_s=0.5)


def test_everything_spills_when_one_activation_exceeds_the_budget() -> None:
    # 10 tokens x 500,000 B = 5e6 B per activation > 4,712,704 B.
    p = _problem(500_000)
    # pre: residual and x spill (2 PUT), ids + w stay. Direct: the coordinator GETs x,
    # sends x + routed (both spill: 2 PUT), the post GETs residual, x, routed (3 GET);
    # h spills (PUT, GET by the next segment). 5 PUT + 5 GET.
    assert layer_requests(p, 0, 3) == Requests(5, 5)
    # Storage: residual and x stay references (GET by post), ids fits: 3 PUT + 3 GET.
    assert layer_requests(p, 0, 2) == Requests(3, 3)
    # Pipelined adds the routing PUT, its GET, the found ask and the asks while the gate
    # runs 0.02 + 0.5 s (2, 4, 8, 16 ms, then every 20 ms: 29).
    assert layer_requests(p, 0, 1) == Requests(4, 3 + 2 + 29)
    assert batch_requests(p) == Requests(1, 0)  # the clean-up LIST


def test_small_activations_move_inline() -> None:
    p = _problem(100_000)  # 1e6 B each: the pre packet (2e6 B) fits
    assert layer_requests(p, 0, 3) == Requests(0, 0)
    assert layer_requests(p, 0, 2) == Requests(0, 0)
    off = dataclasses.replace(_problem(500_000), storage_requests=False)
    assert layer_requests(off, 0, 3) == Requests() and batch_requests(off) == Requests()


def test_spill_rule_is_largest_first_in_packet_order() -> None:
    sizes = [("a", 5), ("b", 9), ("c", 9), ("d", 1)]
    assert spill_names(sizes, 24) == []
    assert spill_names(sizes, 23) == ["b"]
    assert spill_names(sizes, 6) == ["b", "c"]
    assert spill_names(sizes, 0) == ["b", "c", "a", "d"]


def test_poll_counts_follow_the_runtime_schedule() -> None:
    first, cap = polling.MINIBATCH_POLL
    assert list(np.cumsum([next(d) for d in [polling.delays(first, cap)] * 7])) == \
        pytest.approx([0.002, 0.006, 0.014, 0.030, 0.062, 0.112, 0.162])
    assert polling.failed_asks(0.0, first, cap) == 0
    assert polling.failed_asks(0.002, first, cap) == 1
    assert polling.failed_asks(0.04, first, cap) == 5
    assert polling.failed_asks(0.52, *polling.ROUTE_POLL) == 29
    waits = np.random.default_rng(0).uniform(-0.1, 3.0, 200)
    want = [polling.failed_asks(w, first, cap) for w in waits]
    assert polling.failed_asks_array(waits, first, cap).tolist() == want
