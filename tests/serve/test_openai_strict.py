"""Strict OpenAI semantics on a real server: every parameter takes effect or is a 400
naming it, JSON types are not coerced, and the model card is retrievable."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.serve.conftest import MODEL, Server
from tests.serve.test_http_limits import request

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client(server: Server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok():
    from moefleet.models.tokenizers import gpt2_tokenizer

    return gpt2_tokenizer()


PROMPT = [464, 3797, 373]  # "The castle was"


def greedy_ids(client, n: int, **kw: Any) -> list[int]:
    """Greedy token ids (through legacy logprobs' token strings, re-tokenized: the test
    keeps to tokens whose text round-trips)."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=n, temperature=0,
                                  logprobs=0, extra_body={"ignore_eos": True, **kw})
    return [t for s in r.choices[0].logprobs.tokens for t in _ids(s)]


def _ids(s: str) -> list[int]:
    from moefleet.models.tokenizers import gpt2_tokenizer

    return list(gpt2_tokenizer().encode(s))


def test_models_retrieve_and_unknown_model_is_openai_404(client) -> None:
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model" and m.owned_by == "moefleet"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4")
    e = err.value.body
    assert e["code"] == "model_not_found" and e["param"] == "model" and "gpt-4" in e["message"]


def test_head_health_is_200_without_a_body(server: Server) -> None:
    status, _, body = request(server.url, "HEAD", "/health")
    assert status == 200 and body == b""


def test_logit_bias_bans_the_greedy_token_and_forces_another(client, tok) -> None:
    first = greedy_ids(client, 1)[0]
    banned = greedy_ids(client, 1, logit_bias={str(first): -100})[0]
    assert banned != first
    forced = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                       temperature=0, logit_bias={"464": 100},
                                       extra_body={"ignore_eos": True})
    assert forced.choices[0].text == tok.decode([464] * 3)
    # the same through chat, where the bias applies to every choice of n
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=2,
        temperature=1.0, seed=1, logit_bias={"464": 100})
    assert [c.message.content for c in chat.choices] == [tok.decode([464] * 2)] * 2


def _repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


def test_penalties_change_repetition_both_ways(client) -> None:
    plain = greedy_ids(client, 24)
    for kw in ({"frequency_penalty": -2.0}, {"presence_penalty": -2.0}):
        assert _repeats(greedy_ids(client, 24, **kw)) > _repeats(plain), kw  # rewards repeats
    # a +10 bias makes token 464 greedy forever; a frequency penalty of 2 per occurrence
    # outweighs it after a few repeats, and then other tokens win
    biased = greedy_ids(client, 16, logit_bias={"464": 10})
    assert biased == [464] * 16
    pen = greedy_ids(client, 16, logit_bias={"464": 10}, frequency_penalty=2.0)
    assert pen[0] == 464 and 1 < pen.count(464) < 16


@pytest.mark.parametrize("endpoint,kw,param", [
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"suffix": " end"}, "suffix"),
    ("completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("completions", {"min_p": 0.1}, "min_p"),
    ("completions", {"repetition_penalty": 1.3}, "repetition_penalty"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"tool_choice": "auto"}, "tool_choice"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
])
def test_unimplemented_parameters_are_400_naming_them(client, endpoint, kw, param) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        if endpoint == "completions":
            client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body=kw)
        else:
            client.chat.completions.create(model=MODEL, max_tokens=1, extra_body=kw,
                                           messages=[{"role": "user", "content": "hi"}])
    e = err.value.body
    assert e["param"] == param and e["code"] == "unsupported_parameter"
    assert param in e["message"] and e["type"] == "invalid_request_error"


@pytest.mark.parametrize("kw", [{"best_of": 1}, {"suffix": ""}, {"suffix": None},
                                {"response_format": {"type": "text"}}, {"min_p": 0}])
def test_neutral_values_of_unimplemented_parameters_are_fine(client, kw) -> None:
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body=kw)
    assert r.usage.completion_tokens == 1


def test_neutral_tools_on_chat_are_fine(client) -> None:
    r = client.chat.completions.create(model=MODEL, max_tokens=1, tools=[], tool_choice="none",
                                       messages=[{"role": "user", "content": "hi"}])
    assert r.usage.completion_tokens == 1


@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "max_tokens", "10"), ("/v1/completions", "max_tokens", 2.0),
    ("/v1/completions", "max_tokens", True), ("/v1/completions", "stream", "yes"),
    ("/v1/completions", "stream", 1), ("/v1/completions", "logprobs", True),
    ("/v1/completions", "prompt", [True]), ("/v1/completions", "prompt", [[1, False]]),
    ("/v1/completions", "temperature", "0.5"), ("/v1/completions", "temperature", True),
    ("/v1/completions", "n", True), ("/v1/completions", "seed", "7"),
    ("/v1/completions", "echo", 1), ("/v1/completions", "top_k", 1.0),
    ("/v1/completions", "logit_bias", {"464": "5"}),
    ("/v1/completions", "logit_bias", {"abc": 1}),
    ("/v1/completions", "logit_bias", {"464": 101}),
    ("/v1/completions", "logit_bias", {"99999999": 1}),
    ("/v1/completions", "frequency_penalty", 2.5),
    ("/v1/completions", "presence_penalty", "1"),
    ("/v1/completions", "best_of", True), ("/v1/completions", "stop", 5),
    ("/v1/chat/completions", "logprobs", 1), ("/v1/chat/completions", "stream", "true"),
    ("/v1/chat/completions", "max_completion_tokens", "3"),
    ("/v1/chat/completions", "top_logprobs", 2.0),
    ("/v1/chat/completions", "stream_options", {"include_usage": "yes"}),
])
def test_loose_json_types_are_400_naming_the_field(server: Server, path, field, value) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 1}
    body.update({"prompt": "hi"} if path == "/v1/completions"
                else {"messages": [{"role": "user", "content": "hi"}]})
    if field == "stream_options":
        body["stream"] = True
    body[field] = value
    status, _, raw = request(server.url, "POST", path, body)
    assert status == 400, raw
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] is not None and err["param"].split(".")[0] == field, err
    assert err["type"] == "invalid_request_error"


def test_chat_message_fields_are_strict(server: Server) -> None:
    for msg in ({"role": "user", "content": 5}, {"role": 1, "content": "x"},
                {"role": "user", "content": "x", "name": 3}):
        status, _, raw = request(server.url, "POST", "/v1/chat/completions",
                                 {"model": MODEL, "messages": [msg]})
        assert status == 400 and json.loads(raw)["error"]["param"].startswith("messages"), raw
