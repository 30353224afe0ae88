"""``moefleet generate``: JSON output with latency figures, clean one-line errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moefleet.cli import app

runner = CliRunner()
MODEL = "tiny-mixtral-random"  # GPT-2 BPE, builds in seconds


def test_generate_json_reports_outputs_and_latency() -> None:
    r = runner.invoke(app, ["generate", "-m", MODEL, "--prompt", "The castle was",
                            "--max-tokens", "5", "--ignore-eos", "--json"],
                      catch_exceptions=False)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert len(out["outputs"]) == 1 and len(out["outputs"][0]["token_ids"]) == 5
    assert out["outputs"][0]["finish_reason"] == "length"
    m = out["metrics"]
    assert m["output_tokens"] == 5 and m["ttft_p50_s"] > 0 and m["tpot_p50_s"] > 0


def test_generate_streams_text_to_the_terminal() -> None:
    r = runner.invoke(app, ["generate", "-m", MODEL, "--prompt", "Hello", "--max-tokens", "4",
                            "--ignore-eos", "--stream"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "4 tokens" in r.stderr


@pytest.mark.parametrize(("args", "needle"), [
    (["--prompt", "x", "--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--prompt", "x", "--temperature", "-1"], "temperature"),
    (["--prompt", "x", "--top-p", "1.5"], "top_p"),
    (["--prompt", "x", "--max-tokens", "100000"], "context"),
    (["--prompt", ""], "--prompt is empty"),
    ([], "exactly one of --prompt and --dataset"),
    (["--prompt", "x", "--device", "cuda:7"], "cuda"),
    (["--dataset", "nope-dataset"], "unknown dataset"),
])
def test_bad_input_is_one_clean_error(args: list[str], needle: str) -> None:
    r = runner.invoke(app, ["generate", "-m", MODEL, *args])
    assert r.exit_code != 0
    assert needle in r.stderr and "Traceback" not in r.output


def test_an_encoder_model_cannot_generate() -> None:
    from moefleet.models import zoo

    if not zoo.is_built("minilm-moe-e4"):
        pytest.skip("minilm-moe-e4 is not built in this cache")
    r = runner.invoke(app, ["generate", "-m", "minilm-moe-e4", "--prompt", "x"])
    assert r.exit_code != 0 and "encoder" in r.stderr
