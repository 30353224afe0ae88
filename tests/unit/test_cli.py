"""The CLI end to end (in-process): happy paths, --json purity, and error paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moefleet import paths
from moefleet.cli import app
from moefleet.models.tiny import tiny_model

runner = CliRunner()
MODEL = "tiny-mixtral-random"


def run(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def test_models_list_json() -> None:
    res = run("models", "list", "--json")
    assert res.exit_code == 0
    data = json.loads(res.stdout)
    assert MODEL in [m["name"] for m in data["models"]]
    assert "MixtralForCausalLM" in data["supported_architectures"]


def test_building_a_built_model_says_so_without_its_build_report() -> None:
    assert run("models", "build", MODEL).exit_code == 0
    res = run("models", "build", MODEL)
    assert res.exit_code == 0, res.output
    assert "already built" in res.stdout and "--force" in res.stdout
    assert "num_experts" not in res.stdout, res.stdout  # one sentence, wrapped to fit


def test_models_info_json() -> None:
    # `info` never builds (it says how to), so build first: this test must not depend on
    # an earlier one having built the model in the same cache.
    assert run("models", "build", MODEL).exit_code == 0
    res = run("models", "info", MODEL, "--json")
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["family"] == "mixtral" and info["top_k"] == 2
    assert info["num_experts"] == [8, 8, 8]
    assert len(info["bytes_per_segment"]) == info["num_layers"]


def test_profile_then_show(tmp_path: Path) -> None:
    out = tmp_path / "trace.parquet"
    res = run("profile", "--model", MODEL, "--dataset", "wikitext2:test", "--max-tokens", "300",
              "--out", str(out), "--json")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)  # stdout holds JSON only
    assert summary["num_tokens"] == 300 and out.is_file()
    assert [sum(r["counts"]) for r in summary["layers"]] == [600, 600, 600]
    png = tmp_path / "pop.png"
    res = run("traces", "show", str(out), "--png", str(png), "--json")
    assert res.exit_code == 0
    assert json.loads(res.stdout)["layers"] == summary["layers"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    res = run("traces", "show", str(out))
    assert "Expert popularity" in res.stdout


def test_profile_own_prompt_file(tmp_path: Path) -> None:
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "How do serverless functions bill memory?"}\n'
                       '{"prompt": "Explain mixture of experts."}\n')
    out = tmp_path / "t.parquet"
    res = run("profile", "-m", MODEL, "-d", str(prompts), "--max-tokens", "1000", "-o", str(out),
              "--json")
    assert res.exit_code == 0, res.output
    assert 5 < json.loads(res.stdout)["num_tokens"] < 30


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--dataset", "no-such-data"], "unknown dataset 'no-such-data'"),
        (["--max-tokens", "0"], "--max-tokens must be positive"),
    ],
)
def test_profile_errors_are_one_clear_line(args: list[str], needle: str, tmp_path: Path) -> None:
    out = tmp_path / "t.parquet"
    base = ["profile", "--model", MODEL, "--dataset", "wikitext2", "--out", str(out)]
    res = runner.invoke(app, base + args)
    assert res.exit_code == 2
    assert needle in res.stderr.replace("\n", " ")
    assert "hint:" in res.stderr and "Traceback" not in res.output
    assert not out.exists()


def test_empty_dataset(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    res = runner.invoke(app, ["profile", "-m", MODEL, "-d", str(empty), "-o",
                              str(tmp_path / "t.parquet")])
    assert res.exit_code == 2 and "error:" in res.stderr


def test_missing_data_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(paths, "_candidate_data_dirs", lambda: [tmp_path])
    res = runner.invoke(app, ["profile", "-m", MODEL, "-d", "c4", "-o", str(tmp_path / "t.pq")])
    assert res.exit_code == 2
    assert "MOEFLEET_DATA_DIR" in res.stderr.replace("\n", " ")


def test_corrupt_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    tiny_model("olmoe", vocab_size=300).save_pretrained(ckpt)
    (ckpt / "model.safetensors").write_bytes(b"\0" * 64)
    res = runner.invoke(app, ["models", "info", str(ckpt)])
    assert res.exit_code == 2
    assert "corrupt" in res.stderr


def test_traces_show_missing_file(tmp_path: Path) -> None:
    res = runner.invoke(app, ["traces", "show", str(tmp_path / "nope.parquet")])
    assert res.exit_code == 2 and "does not exist" in res.stderr


def test_help_has_examples() -> None:
    for cmd in (["profile"], ["models", "info"], ["traces", "show"], ["demo"]):
        res = run(*cmd, "--help")
        assert res.exit_code == 0 and "Example:" in res.stdout
