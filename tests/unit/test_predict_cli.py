"""``moefleet predict`` sub-app: happy paths on trace files and a tiny model, error paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moefleet.cli.predict import app
from moefleet.predict import BayesPredictor, load_predictor
from moefleet.predict.synthetic import synthetic_trace
from moefleet.traces.schema import write_trace

runner = CliRunner()


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("traces")
    return {
        "train": write_trace(synthetic_trace(60, seed=0), d / "train.parquet"),
        "test": write_trace(synthetic_trace(20, seed=1, request_prefix="t"), d / "test.parquet"),
        "other": write_trace(synthetic_trace(5, moe_layers=(0, 1, 2), seed=2),
                             d / "other.parquet"),
    }


def test_eval_on_trace_files_json_out_and_png(traces, tmp_path: Path) -> None:
    out, png = tmp_path / "res.json", tmp_path / "chart.png"
    res = runner.invoke(app, [
        "eval", "--train", str(traces["train"]), "--test", f"{traces['test']},{traces['test']}",
        "--predictors", "bayes,lina,dop,ef,sps", "--embed", "random", "--batch-tokens", "200",
        "--json", "-o", str(out), "--png", str(png),
    ])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report == json.loads(out.read_text())
    assert png.read_bytes()[:4] == b"\x89PNG"
    # Trace files are labelled by their stem (no dataset in the metadata); repeats get #2.
    assert set(report["tests"]) == {"test", "test#2"}
    preds = report["tests"]["test"]["predictors"]
    assert set(preds) == {"bayes", "lina", "dop", "ef", "sps"}
    assert report["predictors"] == ["bayes", "lina", "dop", "ef", "sps"]  # order kept here
    assert preds["lina"]["ratio"] == 1.0 and preds["bayes"]["fit_s"] >= 0


def test_eval_table_output(traces) -> None:
    res = runner.invoke(app, ["eval", "--train", str(traces["train"]),
                              "--test", str(traces["test"]), "--predictors", "bayes,ef"])
    assert res.exit_code == 0, res.output
    assert "bayes" in res.stdout and "abs diff" in res.stdout


def test_fit_writes_a_loadable_predictor(traces, tmp_path: Path) -> None:
    out = tmp_path / "p.npz"
    res = runner.invoke(app, ["fit", "--train", str(traces["train"]), "--predictor",
                              "bayes-pos", "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["kind"] == "bayes" and summary["out"] == str(out)
    pred = load_predictor(out)
    assert isinstance(pred, BayesPredictor) and pred.mode == "position"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["eval", "--test", "TEST", "--predictors", "bayes,oracle"], "unknown predictor"),
        (["eval", "--test", "/nonexistent/t.parquet"], "does not exist"),
        (["eval", "--test", "OTHER", "--predictors", "dop"], "different models"),
        (["eval", "--test", "TEST", "--predictors", "sps", "--embed", "glove"],
         "unknown embedding source"),
        (["fit", "--predictor", "bayes,lina"], "one predictor"),
    ],
)
def test_error_paths(traces, args: list[str], message: str) -> None:
    args = [a.replace("TEST", str(traces["test"])).replace("OTHER", str(traces["other"]))
            for a in args]
    res = runner.invoke(app, [*args, "--train", str(traces["train"])])
    assert res.exit_code == 2, res.output
    assert message in res.output and "hint:" in res.output
    assert "Traceback" not in res.output


def test_dataset_errors_before_any_model_loads(traces) -> None:
    res = runner.invoke(app, ["eval", "--train", "wikitext2:train", "--max-tokens", "0",
                              "--test", str(traces["test"])])
    assert res.exit_code == 2 and "must be positive" in res.output
    res = runner.invoke(app, ["eval", "--train", "no-such-dataset",
                              "--test", str(traces["test"])])
    assert res.exit_code == 2 and "unknown dataset" in res.output


def test_eval_profiles_a_dataset_on_a_tiny_model(tmp_path_factory, monkeypatch) -> None:
    monkeypatch.setenv("MOEFLEET_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    saved = tmp_path_factory.mktemp("saved")
    res = runner.invoke(app, [
        "eval", "--model", "tiny-mixtral-random", "--train", "wikitext2:train",
        "--test", "wikitext2:test", "--max-tokens", "400", "--test-tokens", "160",
        "--batch-tokens", "80", "--predictors", "bayes,bayes-pos,lina,bf",
        "--save-traces", str(saved), "--json",
    ])
    assert res.exit_code == 0, res.output
    result = json.loads(res.stdout)["tests"]["wikitext2:test"]
    assert result["test"]["tokens"] == 160 and result["train"]["tokens"] == 400
    assert result["predictors"]["bf"]["hit_rate"] is None
    assert 0 <= result["predictors"]["bayes"]["hit_rate"] <= 1
    assert len(list(saved.glob("*.parquet"))) == 2
