"""logit_bias and the frequency/presence penalties: hand-made logits, exact effects."""

from __future__ import annotations

import pytest
import torch

from moefleet.engine import EngineError, SamplingParams
from moefleet.engine.sampler import Sampler, adjusted


def _logits() -> torch.Tensor:
    return torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 4.0]])


def test_bias_minus_100_moves_greedy_off_its_token_and_plus_100_forces_one() -> None:
    s = Sampler()
    plain = SamplingParams(temperature=0, logprobs=0)
    ban = SamplingParams(temperature=0, logprobs=0, logit_bias=((1, -100.0),))
    force = SamplingParams(temperature=0, logit_bias=((2, 100.0),))
    tokens, lps = s.sample(torch.cat([_logits()[:1]] * 3), [0, 1, 2], [plain, ban, force])
    assert tokens == [1, 3, 2]
    # reported log-probabilities are the model's own, not the biased distribution's
    lp = torch.log_softmax(_logits()[0], -1)
    assert lps[1] is not None and lps[1].logprob == pytest.approx(float(lp[3]))


def test_bias_applies_to_sampling_too() -> None:
    s = Sampler()
    p = SamplingParams(temperature=1.0, logit_bias=((1, -100.0), (3, -100.0)))
    picks = {s.sample(_logits()[:1], [i], [p])[0][0] for i in range(100)}
    assert picks <= {0, 2} and len(picks) == 2


def test_penalties_count_generated_tokens_per_row() -> None:
    logits = torch.zeros(2, 4)
    freq = SamplingParams(temperature=0, frequency_penalty=0.5)
    pres = SamplingParams(temperature=0, presence_penalty=1.5)
    out = adjusted(logits, [freq, pres], [[1, 1, 2], [1, 1, 2]])
    assert out[0].tolist() == [0.0, -1.0, -0.5, 0.0]  # 0.5 per occurrence
    assert out[1].tolist() == [0.0, -1.5, -1.5, 0.0]  # 1.5 once per token present
    assert logits.abs().sum() == 0  # the input is not changed in place


def test_penalty_changes_the_greedy_choice_once_a_token_repeats() -> None:
    s = Sampler()
    p = SamplingParams(temperature=0, frequency_penalty=2.0)
    row = _logits()[:1]  # greedy picks 1 (3.0), then 3 (2.0) once 1 has been generated
    assert s.sample(row, [0], [p], [[]])[0] == [1]
    assert s.sample(row, [0], [p], [[1]])[0] == [3]
    negative = SamplingParams(temperature=0, presence_penalty=-2.0)  # encourages repeats
    assert s.sample(row, [0], [negative], [[3]])[0] == [3]


def test_rows_without_adjustments_are_untouched() -> None:
    logits = _logits()
    assert adjusted(logits, [SamplingParams(), SamplingParams()], None) is logits


@pytest.mark.parametrize("kw", [
    {"frequency_penalty": 2.5}, {"presence_penalty": float("nan")},
    {"presence_penalty": True}, {"logit_bias": ((1, 101.0),)},
    {"logit_bias": ((-1, 1.0),)}, {"logit_bias": ((True, 1.0),)},
    {"logit_bias": ((1, float("inf")),)},
])
def test_out_of_range_adjustments_are_refused(kw) -> None:
    with pytest.raises(EngineError):
        SamplingParams(**kw)
