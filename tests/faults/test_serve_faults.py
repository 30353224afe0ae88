"""Faults under the HTTP server (real uvicorn on 127.0.0.1): requests in flight when an
expert call fails complete or fail with a clear error, never hang and never vanish; a
stalled step turns into 503s instead of a hang, and the server recovers after it."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
import torch

pytest.importorskip("aiohttp")

from moefleet.experiments.serve_faults import run_http_under_faults
from moefleet.experts.faults import FaultyExperts
from moefleet.experts.kernels import in_process_experts
from moefleet.runtime.faults import FaultPlan
from tests.engine_helpers import build_engine, opened_engine
from tests.serve.conftest import running, tiny_adapter

pytestmark = pytest.mark.timeout(300)

PROMPTS = [f"request {i} about mixtures of experts" for i in range(8)]


def _engine(plan: FaultPlan) -> tuple[Any, FaultyExperts]:
    faulty = FaultyExperts(in_process_experts(tiny_adapter()), plan)
    return opened_engine(tiny_adapter(), max_num_seqs=4, experts=faulty), faulty


def _get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.parametrize("kind", ["crash", "error"])
def test_http_requests_complete_or_fail_clearly_under_expert_faults(kind: str) -> None:
    # seed 1: the dice's first 400 draws hold no run of 4 hits, so at most 3 attempts of
    # one call fail and the engine policy's 4 attempts always get a transient one through
    engine, faulty = _engine(FaultPlan(kind, 0.2, seed=1))
    with running(engine) as s:
        run, health = run_http_under_faults(s.url, faulty.plan, PROMPTS, max_tokens=8,
                                            concurrency=4, timeout_s=60)
    assert faulty.injected >= 1
    assert run.lost == 0, run.errors
    assert run.completed + run.failed == run.accepted == len(PROMPTS)
    assert health == "200"  # one failed step never takes the server down
    if kind == "crash":  # transient: every request completes, the retries are counted
        assert run.failed == 0 and run.retries >= faulty.injected
    else:  # not transient: the step's requests fail with the injected cause, in OpenAI shape
        assert run.failed >= 1
        assert all("handler error (injected)" in e for e in run.errors), run.errors
        assert any(e.startswith("HTTP 500") for e in run.errors) or any(
            e.startswith("in-stream error") for e in run.errors)
    assert run.cost_usd > 0  # failed requests are billed too (their steps ran)


class _StallOnce:
    """The real experts; the first call after ``armed`` is set sleeps ``seconds``."""

    def __init__(self, inner: Any, seconds: float) -> None:
        self.inner, self.seconds = inner, seconds
        self.armed, self.stalled = threading.Event(), threading.Event()

    def __call__(self, layer: int, x_ND: torch.Tensor, ids_NK: torch.Tensor,
                 w_NK: torch.Tensor) -> torch.Tensor:
        if self.armed.is_set() and not self.stalled.is_set():
            self.stalled.set()
            time.sleep(self.seconds)
        return self.inner(layer, x_ND, ids_NK, w_NK)


def test_a_stalled_step_is_a_503_not_a_hang_and_the_server_recovers() -> None:
    stall = _StallOnce(in_process_experts(tiny_adapter()), seconds=3.0)
    engine = build_engine(tiny_adapter(), max_num_seqs=4, experts=stall)
    with running(engine, step_timeout_s=0.5) as s:
        body = {"model": "tiny-mixtral", "prompt": "hello", "max_tokens": 4, "temperature": 0}
        assert _post(s.url + "/v1/completions", body)[0] == 200
        stall.armed.set()
        # engine_stalled is only ever answered while the step is still running
        status, err = _post(s.url + "/v1/completions", body)
        assert status == 503 and err["error"]["code"] == "engine_stalled", err
        assert "step timeout 0.5 s" in err["error"]["message"]
        health = _get(s.url + "/health")
        assert health[0] == 503 and health[1]["error"]["code"] == "engine_stalled"
        deadline = time.monotonic() + 60
        while _get(s.url + "/health")[0] != 200:  # the stall ends: healthy again
            assert time.monotonic() < deadline, "server did not recover from the stall"
            time.sleep(0.1)
        status, ok = _post(s.url + "/v1/completions", body)
        assert status == 200 and ok["choices"][0]["finish_reason"] == "length"
        assert not s.engine.has_unfinished  # the stalled request was aborted, not leaked
