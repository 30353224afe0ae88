"""A real server on 127.0.0.1: a tiny random Mixtral (GPT-2 BPE) behind uvicorn in a
thread. One server per session; tests that need other settings start their own."""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

MODEL = "tiny-mixtral"


@dataclass
class Server:
    url: str
    app: Any

    @property
    def engine(self) -> Any:
        return self.app.state.serve.worker.engine


@functools.cache
def tiny_adapter() -> Any:
    """Built once per session (random init of a 50k vocabulary is the slow part)."""
    from moefleet.models.hf import HFMoEAdapter
    from moefleet.models.tiny import tiny_model
    from moefleet.models.tokenizers import gpt2_tokenizer

    tok = gpt2_tokenizer()
    return HFMoEAdapter(tiny_model("mixtral", vocab_size=len(tok)), tok, name=MODEL)


def tiny_engine(max_num_seqs: int = 8) -> Any:
    """A fresh engine (own KV cache and stats) over the shared weights."""
    from tests.engine_helpers import build_engine

    return build_engine(tiny_adapter(), max_num_seqs=max_num_seqs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def running(engine: Any = None, *, limits: Any = None, **kw: Any) -> Iterator[Server]:
    """A server in a thread, as ``serve`` builds it (``limits``: ConnectionLimits)."""
    import uvicorn

    from moefleet.serve import create_app
    from moefleet.serve.connections import uvicorn_config

    if limits is not None:  # the body timeout is the app's (BodyLimit), the rest uvicorn's
        kw.setdefault("body_timeout_s", limits.body_timeout_s)
    app = create_app(engine or tiny_engine(), model_name=MODEL, **kw)
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, port=port, limits=limits))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield Server(f"http://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    # Requests without max_tokens get 16, not the whole context: fuzzing stays fast.
    with running(default_max_tokens=16) as s:
        yield s


# -- the deployed-plan servers' requests (serve --plan, ODS and Remoe) -------------------
PLAN_PROMPTS = ["The old castle stood", "A river ran", "Nobody lived in the"]


def complete_plan_prompts(url: str) -> dict[str, Any]:
    """PLAN_PROMPTS, 5 greedy tokens each, in one /v1/completions request."""
    import requests

    r = requests.post(url + "/v1/completions", json={
        "model": MODEL, "prompt": PLAN_PROMPTS, "max_tokens": 5, "temperature": 0,
        "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def billed_series(url: str) -> dict[tuple[str, str, str], float]:
    """(function, part, basis) -> value of every billed_cost_usd_total series."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(requests.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name == "moefleet:billed_cost_usd_total":
                out[(s.labels["function"], s.labels["part"], s.labels["basis"])] = s.value
    return out
