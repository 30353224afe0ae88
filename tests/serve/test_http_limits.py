"""Raw HTTP against real servers: metrics, API key, load shedding, body limits, malformed
input, and a client that disconnects mid-stream."""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import pytest

from tests.serve.conftest import MODEL, Server, running, tiny_engine

prom_parser = pytest.importorskip("prometheus_client.parser")


def request(url: str, method: str, path: str, body: Any = None, *,
            headers: dict[str, str] | None = None, raw: bytes | None = None
            ) -> tuple[int, dict[str, str], bytes]:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    h = {"Content-Type": "application/json", **(headers or {})}
    conn.request(method, path, body=data, headers=h)
    r = conn.getresponse()
    out = r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    conn.close()
    return out


def metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    _, _, text = request(url, "GET", "/metrics")
    out = {}
    for fam in prom_parser.text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def wait_for(cond: Callable[[], bool], what: str, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.05)


def complete(url: str, **kw: Any) -> tuple[int, dict[str, Any]]:
    status, _, body = request(url, "POST", "/v1/completions",
                              {"model": MODEL, "prompt": "hello world", **kw})
    return status, json.loads(body)


def test_metrics_move_and_expert_tokens_sum_to_routed_slots(server: Server) -> None:
    before = metrics(server.url)
    status, r = complete(server.url, max_tokens=4, ignore_eos=True)
    assert status == 200
    after = metrics(server.url)

    def delta(name: str, labels: tuple = ()) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert delta("moefleet:generation_tokens_total") == 4
    assert delta("moefleet:prompt_tokens_total") == r["usage"]["prompt_tokens"]
    assert delta("moefleet:request_success_total", (("finished_reason", "length"),)) == 1
    assert delta("moefleet:time_to_first_token_seconds_count") == 1
    assert delta("moefleet:inter_token_latency_seconds_count") == 3
    assert delta("moefleet:e2e_request_latency_seconds_count") == 1
    billed = sum(delta("moefleet:billed_cost_usd_total", (
        ("basis", "in-process-estimate"), ("function", "main"), ("part", p)))
        for p in ("compute", "requests", "storage"))
    assert billed == pytest.approx(r["usage"]["billed_cost"]["usd"])
    # Every token row through the model is routed to top_k experts in every MoE layer.
    adapter = server.engine.runner.adapter
    rows = after[("moefleet:model_tokens_total", ())]
    assert rows > 0
    for layer in adapter.moe_layers:
        per_layer = sum(v for (name, lab), v in after.items()
                        if name == "moefleet:expert_tokens_total"
                        and dict(lab)["layer"] == str(layer))
        assert per_layer == rows * adapter.top_k
    assert after[("moefleet:num_requests_running", ())] == 0
    assert after[("moefleet:kv_cache_usage_perc", ())] == 0


def test_open_routes_and_tokenizer(server: Server) -> None:
    assert request(server.url, "GET", "/health")[0] == 200
    s, _, b = request(server.url, "POST", "/tokenize", {"prompt": "hello world"})
    ids = json.loads(b)["tokens"]
    assert s == 200 and ids == [31373, 995]
    s, _, b = request(server.url, "POST", "/detokenize", {"tokens": ids})
    assert json.loads(b)["prompt"] == "hello world"
    assert request(server.url, "POST", "/detokenize", {"tokens": [10**7]})[0] == 400
    s, _, b = request(server.url, "GET", "/tokenizer_info")
    assert s == 200 and json.loads(b)["vocab_size"] == 50257


@pytest.mark.parametrize("raw,headers", [
    (b"{not json", {}),
    (b'{"model": "tiny-mixtral", "prompt": "x"', {}),
    (b"[]", {}),
    (b"", {}),
    (b'{"model": "tiny-mixtral", "prompt": "x"}', {"Content-Type": "text/plain"}),
    (b'{"model": "tiny-mixtral", "prompt": "x", "temperature": NaN}', {}),
    (b'{"model": "tiny-mixtral", "prompt": "x", "max_tokens": 1e400}', {}),
    (b'{"model": "tiny-mixtral", "prompt": "\\ud800 lone surrogate"}', {}),
    (b'{"model": "tiny-mixtral", "prompt": [99999999999999999999], "echo": true}', {}),
    (b'{"model": "tiny-mixtral", "messages": [{"role": "user", "content": '
     b'[{"type": "image_url"}]}]}', {}),
])
def test_malformed_bodies_are_400(server: Server, raw: bytes, headers: dict) -> None:
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    status, _, body = request(server.url, "POST", path, raw=raw, headers=headers)
    assert status == 400, body
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}


def test_oversized_body_is_413_before_parsing(server: Server) -> None:
    limit = server.app.state.serve.max_body_bytes
    status, _, body = request(server.url, "POST", "/v1/completions",
                              {"model": MODEL, "prompt": "x" * (limit + 1)})
    assert status == 413 and json.loads(body)["error"]["code"] == "body_too_large"


def test_api_key_guards_v1_only() -> None:
    with running(api_key="s3cret") as s:
        assert complete(s.url, max_tokens=1)[0] == 401
        st, _, body = request(s.url, "GET", "/v1/models", headers={"Authorization": "Bearer no"})
        assert st == 401 and json.loads(body)["error"]["type"] == "authentication_error"
        st, _, _ = request(s.url, "GET", "/v1/models",
                           headers={"Authorization": "Bearer s3cret"})
        assert st == 200
        assert request(s.url, "GET", "/health")[0] == 200
        assert request(s.url, "GET", "/metrics")[0] == 200


def _open_stream(url: str, max_tokens: int) -> tuple[http.client.HTTPConnection, Any]:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({
        "model": MODEL, "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True,
        "stream": True}), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def test_load_shedding_and_disconnect_abort() -> None:
    """One running slot, one waiting slot: the third request is shed with 503; closing the
    streams aborts both requests and frees the whole cache."""
    with running(tiny_engine(max_num_seqs=1), max_waiting=1, admission_wait_s=0.5) as s:
        a_conn, a = _open_stream(s.url, 400)
        assert a.readline().startswith(b"data: ")  # A is running
        b_conn, _ = _open_stream(s.url, 400)
        wait_for(lambda: metrics(s.url)[("moefleet:num_requests_waiting", ())] == 1,
                 "B waiting")
        status, headers, body = request(s.url, "POST", "/v1/completions",
                                        {"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert status == 503 and headers["retry-after"] == "1"
        assert json.loads(body)["error"]["code"] == "overloaded"
        assert metrics(s.url)[("moefleet:num_requests_rejected_total", ())] == 1
        a_conn.close()
        b_conn.close()

        def freed() -> bool:
            m = metrics(s.url)
            return (m[("moefleet:num_requests_aborted_total", ())] == 2
                    and m[("moefleet:kv_cache_usage_perc", ())] == 0
                    and m[("moefleet:num_requests_running", ())] == 0)

        wait_for(freed, "both streams aborted and the cache freed")
        assert not s.engine.has_unfinished
        assert complete(s.url, max_tokens=1)[0] == 200  # and the server still serves


def test_engine_death_is_503_and_an_in_stream_error() -> None:
    with running(tiny_engine()) as s:
        conn, resp = _open_stream(s.url, 400)
        assert resp.readline().startswith(b"data: ")

        def boom() -> list:
            raise RuntimeError("simulated engine fault")

        s.engine.step = boom  # the engine thread's next step raises
        lines = [ln for ln in resp.read().decode().splitlines() if ln.startswith("data: ")]
        conn.close()
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2][6:])["error"]
        assert err["code"] == "engine_dead" and "simulated engine fault" in err["message"]
        assert request(s.url, "GET", "/health")[0] == 503
        assert complete(s.url, max_tokens=1)[0] == 503


def test_non_streaming_client_that_leaves_is_aborted() -> None:
    with running(tiny_engine(max_num_seqs=1)) as s:
        u = urllib.parse.urlsplit(s.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({
            "model": MODEL, "prompt": "hello", "max_tokens": 400, "ignore_eos": True}),
            headers={"Content-Type": "application/json"})
        wait_for(lambda: metrics(s.url)[("moefleet:num_requests_running", ())] == 1,
                 "the request running")
        conn.close()  # leave without reading the answer
        wait_for(lambda: metrics(s.url)[("moefleet:num_requests_aborted_total", ())] == 1
                 and metrics(s.url)[("moefleet:kv_cache_usage_perc", ())] == 0,
                 "the request aborted and its cache freed")
        assert metrics(s.url)[("moefleet:generation_tokens_total", ())] < 400
