"""The engine on real (tiny) models: greedy output equals HF ``generate`` token for token on
every decoder family, with both expert kernels, under chunked prefill and preemption;
prompt logprobs equal the model's own; sampling is reproducible per seed."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moefleet.engine import EngineError, SamplingParams
from moefleet.models.hf import HFMoEAdapter
from moefleet.models.tiny import tiny_model
from tests.contracts.test_adapter_contract import DECODER_FAMILIES, tiny_bert_moe
from tests.engine_helpers import build_engine, opened_engine

LENS = [7, 3, 12, 5]


@pytest.fixture(params=DECODER_FAMILIES, scope="module")
def model(request: pytest.FixtureRequest) -> Any:
    m = tiny_model(request.param, vocab_size=512, seed=2)
    m.generation_config.eos_token_id = None  # fixed lengths: nothing stops early
    return m


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in (5, 12, 3, 20)]


def _hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kernel", ["stacked", "loop"])
def test_greedy_equals_hf_generate_with_chunks_and_preemption(model: Any, kernel: str) -> None:
    adapter = HFMoEAdapter(model)
    per_token = adapter.kv_layout().bytes_per_token
    # 10 blocks of 4 tokens: too few for all four requests at once -> preemption;
    # a 16-token budget chunks the 20-token prompt
    opened = opened_engine(adapter, kernel=kernel, kv_budget_bytes=per_token * 4 * 10,
                           block_size=4, max_num_batched_tokens=16)
    engine, runner = opened.engine, opened.runner
    outs = engine.generate(_prompts(), [SamplingParams(max_tokens=n, temperature=0,
                                                       ignore_eos=True) for n in LENS])
    for p, n, o in zip(_prompts(), LENS, outs, strict=True):
        assert o.new_token_ids == _hf_greedy(model, p, n)
        assert o.finished and o.finish_reason == "length"
    assert engine.scheduler.num_preemptions > 0
    assert runner.cache.num_free_blocks == runner.cache.num_blocks  # nothing leaked
    counts = engine.stats.expert_tokens
    assert sorted(counts) == adapter.moe_layers
    computed = sum(s.num_tokens for s in engine.stats.steps)
    assert all(int(c.sum()) == computed * adapter.top_k for c in counts.values())


def test_prompt_logprobs_equal_the_models_own(model: Any) -> None:
    adapter = HFMoEAdapter(model)
    engine = build_engine(adapter, max_num_batched_tokens=8)  # chunked prompt
    prompt = _prompts()[3]
    out = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0,
                                                   prompt_logprobs=True, logprobs=3))[0]
    lp = torch.log_softmax(adapter.reference_forward(torch.tensor([prompt]))[0], -1)
    want = [lp[t - 1, prompt[t]].item() for t in range(1, len(prompt))]
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert out.prompt_logprobs[1:] == pytest.approx(want, abs=1e-4)
    # the 3 best alternatives at each prompt position, across prefill chunks
    tops = out.prompt_top_logprobs
    assert tops is not None and tops[0] is None and len(tops) == len(prompt)
    for t in range(1, len(prompt)):
        top = tops[t]
        assert top is not None and len(top) == 3
        # each is the model's own log-probability, and no better token was left out
        # (compared by value: near-ties may order differently across kernels)
        assert [lp[t - 1, i].item() for i in top] == pytest.approx(list(top.values()),
                                                                   abs=1e-4)
        assert min(top.values()) >= lp[t - 1].topk(3).values[-1].item() - 1e-4
    assert out.logprobs is not None and len(out.logprobs) == 2
    first = out.logprobs[0]
    assert first.logprob == pytest.approx(lp[-1].max().item(), abs=1e-4)
    assert len(first.top) == 3 and max(first.top.values()) == pytest.approx(first.logprob)


def test_sampling_is_reproducible_per_seed_whatever_the_batch() -> None:
    adapter = HFMoEAdapter(tiny_model("mixtral", vocab_size=512, seed=2))
    p = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=11,
                       ignore_eos=True)
    alone = build_engine(adapter).generate([[1, 2, 3]], p)[0].new_token_ids
    others = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    batched = build_engine(adapter).generate(
        [[9, 9], [1, 2, 3], [4]], [others, p, others])[1].new_token_ids
    assert alone == batched
    other_seed = SamplingParams(max_tokens=8, temperature=0.9, seed=12, ignore_eos=True)
    assert build_engine(adapter).generate([[1, 2, 3]], other_seed)[0].new_token_ids \
        != alone


def test_abort_frees_the_cache_at_once_and_timings_are_ordered() -> None:
    clock = iter(float(i) for i in range(10_000))
    adapter = HFMoEAdapter(tiny_model("olmoe", vocab_size=512))
    opened = opened_engine(adapter, clock=lambda: next(clock))
    engine, runner = opened.engine, opened.runner
    a = engine.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    b = engine.add_request([4, 5], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    assert runner.cache.num_free_blocks < runner.cache.num_blocks
    assert engine.abort(a) and not engine.abort(a)
    finished = []
    while engine.has_unfinished:
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == [b]
    t = finished[0].times
    assert t is not None and t.ttft_s is not None and t.tpot_s is not None
    assert t.arrival <= t.scheduled <= t.first_token <= t.finished  # type: ignore[operator]
    assert len(t.token_times) == 3 and t.tpot_s > 0
    assert runner.cache.num_free_blocks == runner.cache.num_blocks


@pytest.mark.parametrize(("prompt", "params", "match"), [
    ([], SamplingParams(), "empty"),
    ([1] * 500, SamplingParams(max_tokens=20), "exceeds the model's context"),
    ([600], SamplingParams(), "outside the vocabulary"),
])
def test_bad_requests_are_refused_and_nothing_is_left_behind(prompt, params, match) -> None:
    engine = build_engine(HFMoEAdapter(tiny_model("mixtral", vocab_size=512)))
    with pytest.raises(EngineError, match=match):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished


def test_an_encoder_cannot_generate() -> None:
    with pytest.raises(EngineError, match="encoder"):
        build_engine(tiny_bert_moe())


def test_step_hooks_see_every_step_before_and_after() -> None:
    seen: list[tuple[str, bool, int]] = []

    class Spy:
        def before_step(self, out, now: float) -> None:
            seen.append(("before", out.has_prefill, len(out.rows)))

        def after_step(self, outputs, now: float) -> None:
            seen.append(("after", False, len(outputs)))

    adapter = HFMoEAdapter(tiny_model("mixtral", vocab_size=512))
    engine = build_engine(adapter, hooks=[Spy()])
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert seen == [("before", True, 1), ("after", False, 1),
                    ("before", False, 1), ("after", False, 1),
                    ("before", False, 1), ("after", False, 1)]

