"""Shared fixtures: an isolated model cache per test session, tiny models."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

FAMILIES = ["mixtral", "qwen2_moe", "olmoe", "deepseek_v2"]
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    # Zoo builds land in a per-session cache unless the caller pinned one (CI may reuse).
    if "MOEFLEET_CACHE_DIR" not in os.environ:
        os.environ["MOEFLEET_CACHE_DIR"] = str(tmp_path_factory.mktemp("moefleet-cache"))
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The local backend's emulated memory/CPU limits (runtime/local_limits.py) would fail
    # the many small debug functions other tests deploy, and stretch every call; the tests
    # of the limits, and of plans running under them, pass limits=True explicitly.
    os.environ.setdefault("MOEFLEET_LOCAL_LIMITS", "off")


# ---- moto: a real HTTP AWS API (S3, Lambda, ...) on 127.0.0.1 (platform layer, runtime) ----


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """URL of a moto server (all AWS services) on a free local port, for this session.

    Skips when moto/boto3 are not installed (``pip install 'moefleet[aws,dev]'``).
    """
    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("boto3")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def aws_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake credentials so boto3 never looks for (or uses) real ones."""
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)


@pytest.fixture(scope="session")
def small_mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-mixtral trimmed to 2 blocks of 4 experts (``small_mixtral``, GPT-2 BPE), saved
    as a checkpoint directory a plan can name (the ``serve --plan`` and CLI backend tests)."""
    from moefleet.models.tiny import small_mixtral
    from moefleet.models.tokenizers import gpt2_tokenizer

    tok = gpt2_tokenizer()
    model = small_mixtral(vocab_size=len(tok))
    out = tmp_path_factory.mktemp("models") / "tiny-mixtral-2x4"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def bf16_olmoe() -> Any:
    """A tiny OLMoE (8 experts, top-2, hidden 64) in bfloat16, for the CPU bf16 paths'
    tests (the blocked float32 path, the per-pair kernel, the AVX512-BF16 kernel)."""
    import torch

    from moefleet.models.hf import HFMoEAdapter
    from moefleet.models.tiny import tiny_model

    return HFMoEAdapter(tiny_model("olmoe", vocab_size=256, seed=2).to(torch.bfloat16),
                        name="olmoe")


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op torch thread for a test module (its module-scoped fixtures included:
    ``usefixtures`` names come first): on tiny tensors a second thread only adds hand-off
    waits, which grow to seconds per op on an oversubscribed 2-core machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
