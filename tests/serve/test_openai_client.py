"""The official ``openai`` client against a real server on loopback."""

from __future__ import annotations

import math

import pytest

from tests.serve.conftest import MODEL, Server

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client(server: Server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_completion_text_usage_and_billed_cost(client) -> None:
    r = client.completions.create(model=MODEL, prompt="The castle was", max_tokens=5,
                                  temperature=0, extra_body={"ignore_eos": True})
    (choice,) = r.choices
    assert choice.finish_reason == "length" and choice.text
    assert r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens == 3  # "The", " castle", " was" in GPT-2 BPE
    assert r.usage.total_tokens == 8
    billed = r.usage.model_extra["billed_cost"]
    assert billed["basis"] == "in-process-estimate" and billed["platform"] == "aws-lambda"
    assert billed["usd"] == pytest.approx(billed["compute"] + billed["requests"])
    assert billed["requests"] > 0 and billed["compute"] > 0


def test_greedy_is_deterministic_and_n_gives_choices(client) -> None:
    a = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=6, temperature=0)
    b = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=6, temperature=0,
                                  n=2)
    assert [c.index for c in b.choices] == [0, 1]
    assert {c.text for c in b.choices} == {a.choices[0].text}
    assert b.usage.prompt_tokens == 2 * a.usage.prompt_tokens


def test_batch_of_prompts_and_token_id_prompt(client) -> None:
    r = client.completions.create(model=MODEL, prompt=["a b", "c d e"], max_tokens=2)
    assert [c.index for c in r.choices] == [0, 1]
    ids = client.completions.create(model=MODEL, prompt=[464, 3797], max_tokens=2)
    assert ids.usage.prompt_tokens == 2


def test_echo_logprobs_score_the_prompt(client) -> None:
    """lm-eval's local-completions loglikelihood call: echo + logprobs, one new token."""
    r = client.completions.create(model=MODEL, prompt="The cat sat on the mat", max_tokens=1,
                                  temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("The cat sat on the mat")
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == n_prompt + 1
    assert lp.token_logprobs[0] is None  # nothing predicts the first token
    assert all(v is not None and v <= 0 and math.isfinite(v) for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_and_streaming_with_usage(client) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=4, logprobs=True, top_logprobs=2)
    msg = r.choices[0].message
    assert msg.role == "assistant" and r.usage.completion_tokens == 4
    assert len(r.choices[0].logprobs.content) == 4
    assert all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 4 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert text
    stream = list(client.completions.create(model=MODEL, prompt="x", max_tokens=3,
                                            temperature=0, stream=True))
    assert len(stream) == 3 and stream[-1].choices[0].finish_reason == "length"
    assert stream[-1].usage is None  # only with include_usage


@pytest.mark.parametrize("kwargs,param", [
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"stop": [""]}, "stop"),
    ({"logprobs": 21}, "logprobs"),
    ({"stream_options": {"include_usage": True}}, None),
    ({"max_tokens": 600}, None),  # prompt + max_tokens beyond the 512-token context
    ({"prompt": [50_257]}, None),  # token id outside the vocabulary
    ({"extra_body": {"stop_token_ids": [10**6]}}, "stop_token_ids"),
])
def test_bad_fields_are_400_naming_the_value(client, kwargs, param) -> None:
    body = {"model": MODEL, "prompt": "hi", **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**body)
    e = err.value.body
    assert err.value.status_code == 400 and e["type"] == "invalid_request_error"
    if param:
        assert e["param"] == param
    assert e["message"]


def test_unknown_fields_are_ignored(client) -> None:
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=1,
                                  extra_body={"no_such_field": 1, "best_of": 1})
    assert r.usage.completion_tokens == 1


def test_unknown_model_is_404_and_models_lists_ours(client) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="hi")
    assert err.value.body["code"] == "model_not_found"
    assert [m.id for m in client.models.list()] == [MODEL]
