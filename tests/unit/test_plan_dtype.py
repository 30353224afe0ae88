"""``moefleet plan --dtype`` (and ``profile-compute --dtype``, a plan input): the model's
weights in the dtype asked for, in both planners (Remoe: the sizes its functions hold;
ODS: the profile measured from ``--model``, cached per dtype); never accepted and ignored
(with ``--profile`` it is refused)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from moefleet.cli import app
from moefleet.models.dtypes import concrete_cpu_dtype
from moefleet.plan import DeploymentPlan
from moefleet.profiles.cache import profile_for, profile_path
from tests.plan_helpers import bert_profile, skewed_counts

ROOT = Path(__file__).resolve().parents[2]
TIMING = ROOT / "benchmarks" / "results" / "remoe_timing.json"
runner = CliRunner()


def _remoe(tmp_path: Path, *extra: str) -> DeploymentPlan:
    act = tmp_path / "uniform.npy"
    np.save(act, np.full((12, 8), 1 / 8))  # gpt2-moe: 12 MoE layers x 8 experts
    out = tmp_path / f"remoe{len(extra)}.yaml"
    res = runner.invoke(app, ["plan", "--policy", "cpu", "--model", "gpt2-moe",
                              "--platform", "aws-lambda", "--ttft", "600", "--tpot", "5",
                              "--activation", str(act), "--timing", str(TIMING), "-o",
                              str(out), *extra])
    assert res.exit_code == 0, res.output
    return DeploymentPlan.load(out)


def test_remoe_plan_holds_the_weights_in_the_dtype_asked_for(tmp_path: Path) -> None:
    bf16 = _remoe(tmp_path)  # the published shape's own: bf16
    fp32 = _remoe(tmp_path, "--dtype", "float32")
    assert bf16.main is not None and fp32.main is not None
    # twice the bytes per parameter: the main that holds the non-experts needs more memory
    assert fp32.main.memory_mb > bf16.main.memory_mb
    assert _remoe(tmp_path, "--dtype", "bfloat16").main == bf16.main


def test_dtype_with_a_profile_file_is_refused(tmp_path: Path) -> None:
    profile = bert_profile(4).save(tmp_path / "profile.json")
    counts = tmp_path / "counts.npy"
    np.save(counts, skewed_counts(4, 4, 2048, seed=3))
    res = runner.invoke(app, ["plan", "--platform", "aws-lambda-2020", "--slo", "30",
                              "--counts", str(counts), "--profile", str(profile), "--dtype",
                              "bfloat16", "-o", str(tmp_path / "p.yaml")])
    assert res.exit_code != 0
    assert "--dtype bfloat16" in res.output and "--profile" in res.output
    assert not (tmp_path / "p.yaml").exists()


def test_unknown_dtype_is_one_line_before_any_work(tmp_path: Path) -> None:
    res = runner.invoke(app, ["plan", "--policy", "cpu", "--model", "deepseek-v2-lite",
                              "--ttft", "1", "--tpot", "1", "--activation", "none.npy",
                              "--dtype", "float64", "-o", str(tmp_path / "p.yaml")])
    assert res.exit_code != 0 and "unknown --dtype 'float64'" in res.output
    assert "Traceback" not in res.output


def test_profiles_are_cached_per_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOEFLEET_CACHE_DIR", str(tmp_path))
    name = "some/checkpoint"
    assert profile_path(name) != profile_path(name, "bfloat16") != profile_path(name,
                                                                             "float32")
    assert profile_path(name, "bfloat16").name.endswith("-bfloat16.json")
    assert concrete_cpu_dtype("auto") in ("bfloat16", "float32")
    assert concrete_cpu_dtype(None) is None and concrete_cpu_dtype("float16") == "float16"


def test_ods_profile_is_measured_in_the_dtype_asked_for() -> None:
    from moefleet.models import zoo

    name = "tiny-mixtral-random"
    if not zoo.is_built(name):
        zoo.build(name)
    prof = profile_for(name, dtype="bfloat16")
    assert profile_path(name, "bfloat16").is_file()
    default = profile_for(name)
    layer = prof.moe_layers[0]
    # parameters in bf16 are half the bytes of the checkpoint's fp32
    assert prof.expert(layer).param_bytes * 2 == default.expert(layer).param_bytes


def test_profile_compute_in_bfloat16(tmp_path: Path) -> None:
    """It used to feed fp32 activations to bf16 experts (a RuntimeError traceback)."""
    out = tmp_path / "p.json"
    res = runner.invoke(app, ["profile-compute", "-m", "tiny-mixtral-random", "--dtype",
                              "bfloat16", "--threads", "1", "--batch-sizes", "1,4",
                              "--repeats", "1", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert out.is_file()
