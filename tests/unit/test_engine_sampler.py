"""Sampler and detokenizer: no model, hand-made logits and the GPT-2 BPE tokenizer."""

from __future__ import annotations

import pytest
import torch

from moefleet.engine import SamplingParams
from moefleet.engine.detok import Detokenizer
from moefleet.engine.sampler import Sampler, prompt_logprobs, prompt_top_logprobs


def _logits() -> torch.Tensor:
    return torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 4.0]])


def test_greedy_takes_the_arg_max_and_reports_model_logprobs() -> None:
    p = SamplingParams(temperature=0, logprobs=2)
    tokens, lps = Sampler().sample(_logits(), [0, 1], [p, p])
    assert tokens == [1, 0]
    lp = torch.log_softmax(_logits(), -1)
    assert lps[0] is not None and lps[0].logprob == pytest.approx(float(lp[0, 1]))
    assert list(lps[0].top) == [1, 3]  # the two most likely, best first


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_greedy_over_half_precision_logits_is_their_own_arg_max(dtype: torch.dtype) -> None:
    """(Widened to float32 on the CPU for speed: exact, ties to the first index.)"""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1000, generator=g).to(dtype)
    logits[2, [7, 900]] = 50.0  # a tie: the first wins, as in the half-precision argmax
    tokens, _ = Sampler().sample(logits, list(range(5)), [SamplingParams(temperature=0)] * 5)
    assert tokens == logits.argmax(-1).tolist() and tokens[2] == 7


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    s = Sampler()
    for p in (SamplingParams(temperature=1.5, top_k=1, seed=1),
              SamplingParams(temperature=1.5, top_p=0.01, seed=1)):
        assert s.sample(_logits(), [0, 1], [p, p])[0] == [1, 0]


def test_top_k_never_picks_outside_the_k_best() -> None:
    s = Sampler()
    p = SamplingParams(temperature=5.0, top_k=2)  # unseeded: one shared generator
    picks = {s.sample(_logits()[:1], [i], [p])[0][0] for i in range(200)}
    assert picks <= {1, 3} and len(picks) == 2


def test_seeded_draws_repeat_and_differ_across_seeds() -> None:
    logits = torch.zeros(1, 50)
    def draw(seed: int) -> list[int]:
        s = Sampler()
        p = SamplingParams(temperature=1.0, seed=seed)
        return [s.sample(logits, [0], [p])[0][0] for _ in range(10)]
    assert draw(4) == draw(4)
    assert draw(4) != draw(5)


def test_prompt_logprobs_pick_the_next_tokens() -> None:
    lp = prompt_logprobs(_logits(), [3, 0])
    ref = torch.log_softmax(_logits(), -1)
    assert lp == pytest.approx([float(ref[0, 3]), float(ref[1, 0])])


def test_prompt_top_logprobs_rank_alternatives_and_equal_the_chosen_exactly() -> None:
    chosen, tops = prompt_top_logprobs(_logits(), [1, 3], 2)
    assert [list(t) for t in tops] == [[1, 3], [0, 3]]  # best first
    assert chosen[0] == max(tops[0].values())  # greedy token: bit-equal, as lm-eval checks
    assert chosen[1] == tops[1][3] and chosen[1] < max(tops[1].values())
    assert prompt_top_logprobs(_logits(), [1, 3], 0)[1] == [{}, {}]
    with pytest.raises(ValueError, match="21"):
        prompt_top_logprobs(_logits(), [1, 3], 21)


@pytest.fixture(scope="module")
def tok():
    from moefleet.models.tokenizers import gpt2_tokenizer

    return gpt2_tokenizer()


def test_incremental_text_equals_full_decode_even_across_split_characters(tok) -> None:
    text = "Caf\u00e9 na\u00efve \u4e2d\u6587 text, and more words."
    ids = tok.encode(text)
    d = Detokenizer(tok)
    got = "".join(d.add(t, (), final=i == len(ids) - 1)[0] for i, t in enumerate(ids))
    assert got == tok.decode(ids)


def test_stop_string_cuts_text_and_nothing_after_it_is_streamed(tok) -> None:
    ids = tok.encode("Hello world. STOP here and beyond")
    d = Detokenizer(tok)
    streamed, hit_at = "", None
    for i, t in enumerate(ids):
        out, hit = d.add(t, ("STOP",), final=False)
        streamed += out
        if hit:
            streamed += d.flush_before_stop()
            hit_at = i
            break
    assert hit_at is not None
    assert streamed == "Hello world. "


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-40])
def test_a_vanishing_temperature_samples_the_arg_max_instead_of_failing(temperature) -> None:
    # logits / T overflows to inf and softmax to NaN; the limit of T -> 0 is greedy
    # (found by the schema fuzzer: the engine thread died on torch.multinomial)
    p = SamplingParams(temperature=temperature, max_tokens=1)
    tokens, _ = Sampler().sample(_logits(), [0, 1], [p, p])
    assert tokens == _logits().argmax(-1).tolist()
