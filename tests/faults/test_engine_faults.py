"""Faults under the generation engine: transient expert failures are retried exactly (same
tokens as without faults), a step that fails for good ends exactly its own requests with
a clear error while the others finish, and the harness loses nothing."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from moefleet.engine import SamplingParams
from moefleet.errors import MoefleetError
from moefleet.experiments.serve_faults import run_engine_under_faults
from moefleet.experts.faults import FaultyExperts
from moefleet.experts.kernels import in_process_experts
from moefleet.models.hf import HFMoEAdapter
from moefleet.models.tiny import tiny_model
from moefleet.runtime.faults import FaultPlan, parse_fault
from tests.engine_helpers import build_engine, opened_engine

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 1000 for j in range(4 + i)] for i in range(4)]


@functools.cache
def adapter() -> HFMoEAdapter:
    return HFMoEAdapter(tiny_model("mixtral"))


@functools.cache
def reference() -> tuple[tuple[int, ...], ...]:
    outs = build_engine(adapter(), max_num_seqs=2).generate(PROMPTS, GREEDY)
    return tuple(tuple(o.new_token_ids) for o in outs)


@pytest.mark.parametrize("kind", ["crash", "timeout", "throttle", "straggler"])
def test_transient_expert_faults_are_retried_and_change_nothing(kind: str) -> None:
    # seed 2: no run of 4 hits in the first 400 draws, so every call gets through
    faulty = FaultyExperts(in_process_experts(adapter()),
                           FaultPlan(kind, 0.2, seed=2, timeout_s=0.01, straggle_s=0.01,
                                     retry_after_s=0.01))
    opened = opened_engine(adapter(), max_num_seqs=2, experts=faulty)
    engine = opened.engine
    run = run_engine_under_faults(opened, PROMPTS, GREEDY, reference())
    assert faulty.injected >= 1
    assert run.lost == 0 and run.failed == 0, run.errors
    assert run.completed == run.outputs_equal == len(PROMPTS)
    assert run.retries == (0 if kind == "straggler" else faulty.injected)
    assert engine.runner.cache.num_free_blocks == engine.runner.cache.num_blocks


class _FailCall:
    """The real experts, except that call number ``at`` raises a non-transient error."""

    def __init__(self, inner: Any, at: int) -> None:
        self.inner, self.at, self.calls = inner, at, 0

    def __call__(self, layer: int, x_ND: torch.Tensor, ids_NK: torch.Tensor,
                 w_NK: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("expert handler bug (injected)")
        return self.inner(layer, x_ND, ids_NK, w_NK)


@pytest.mark.parametrize("at", [1, 8])  # the first prefill step, a later decode step
def test_a_failed_step_ends_only_its_own_requests_with_a_clear_error(at: int) -> None:
    fail = _FailCall(in_process_experts(adapter()), at)
    engine = build_engine(adapter(), max_num_seqs=2, experts=fail)
    outs = engine.generate(PROMPTS, GREEDY)
    errored = [i for i, o in enumerate(outs) if o.finish_reason == "error"]
    # max_num_seqs=2: the first two requests share every step until they finish
    assert errored == [0, 1]
    for i in errored:
        assert outs[i].finished and "RuntimeError: expert handler bug" in (outs[i].error or "")
        assert len(outs[i].new_token_ids) < GREEDY.max_tokens
    for i in (2, 3):  # the others never shared the failed step: untouched
        assert outs[i].finish_reason == "length" and outs[i].error is None
        assert tuple(outs[i].new_token_ids) == reference()[i]
    assert engine.stats.failed_steps == 1 and engine.stats.failed_requests == 2
    assert not engine.has_unfinished
    assert engine.runner.cache.num_free_blocks == engine.runner.cache.num_blocks


def test_errors_past_the_retries_fail_requests_and_the_harness_loses_none() -> None:
    faulty = FaultyExperts(in_process_experts(adapter()), FaultPlan("error", 0.3, seed=1))
    opened = opened_engine(adapter(), max_num_seqs=2, experts=faulty)
    run = run_engine_under_faults(opened, PROMPTS * 2, GREEDY)
    assert run.failed >= 1 and run.lost == 0
    assert run.completed + run.failed == run.accepted == 2 * len(PROMPTS)
    assert all("handler error (injected)" in e for e in run.errors)
    assert run.retries == 0  # a handler error is not transient: never retried


def test_fault_spec_parsing_names_the_bad_value() -> None:
    assert parse_fault("crash:0.05:3") == FaultPlan("crash", 0.05, seed=3)
    assert parse_fault("stall:0.01:1:5").stall_s == 5.0
    for bad in ("crash", "boom:0.1", "crash:x", "crash:1.5", "crash:nan", "crash:0.1:y",
                "store-503:0.1", "stall:0.1:1:1e9", "stall:0.1:1:x:2"):
        with pytest.raises(MoefleetError) as info:
            parse_fault(bad)
        msg = str(info.value)
        assert bad in msg or f"'{bad.split(':')[1]}'" in msg or "'1e9'" in msg


def test_a_sampling_failure_ends_its_step_requests_not_the_engine() -> None:
    engine = build_engine(adapter(), max_num_seqs=2)
    real, calls = engine.sampler.sample, [0]

    def sample(*args: Any, **kw: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:  # a decode step of the first two requests
            raise RuntimeError("invalid multinomial distribution (injected)")
        return real(*args, **kw)

    engine.sampler.sample = sample  # type: ignore[method-assign]
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.finish_reason for o in outs] == ["error", "error", "length", "length"]
    assert "invalid multinomial" in (outs[0].error or "")
    assert [tuple(o.new_token_ids) for o in outs[2:]] == list(reference()[2:])
    assert engine.stats.failed_requests == 2 and not engine.has_unfinished
    assert engine.runner.cache.num_free_blocks == engine.runner.cache.num_blocks
