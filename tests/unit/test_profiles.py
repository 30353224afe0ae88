"""Compute profiles: fitting on synthetic data, measuring a tiny model, files, CLI.

No timed asserts: measured profiles are checked for fit-quality properties with generous
margins (R² ≥ 0.8, positive slopes) because colleagues' tests share this 2-core machine.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from moefleet.cli import app
from moefleet.errors import DataError, MoefleetError
from moefleet.io import dumps_json
from moefleet.models.base import param_bytes
from moefleet.models.hf import HFMoEAdapter
from moefleet.models.tiny import tiny_model
from moefleet.profiles import ComputeProfile
from moefleet.profiles.fit import MIN_PER_TOKEN_S, fit_batch_law, fit_thread_law
from moefleet.profiles.measure import (
    available_cpus,
    measure_profile,
    profile_for,
    profile_path,
    time_cells,
    torch_threads,
)

SIZES = (16, 128, 512, 1024)  # big enough that per-token work dominates the call overhead
R2_MIN = 0.8


# ---- fitting on synthetic timings ----------------------------------------------------------


def test_batch_law_recovers_known_parameters() -> None:
    rng = np.random.default_rng(0)
    n = np.array([1, 2, 4, 8, 16, 64, 256, 1024], dtype=float)
    a, b = 50e-6, 2e-6
    t = (a + b * n) * (1 + 0.02 * rng.standard_normal(len(n)))  # 2 % timing noise
    fit = fit_batch_law(n, t)
    assert fit.law.overhead_s == pytest.approx(a, rel=0.1)
    assert fit.law.per_token_s == pytest.approx(b, rel=0.03)
    assert fit.r2 > 0.99 and not fit.degenerate
    assert len(fit.residuals_s) == len(n)


def test_batch_law_keeps_invariants_on_bad_data() -> None:
    clamped = fit_batch_law([10, 20, 40], [0.5e-3, 1.5e-3, 3.5e-3])  # intercept would be < 0
    assert clamped.law.overhead_s == 0.0 and clamped.law.per_token_s > 0
    flat = fit_batch_law([1, 10, 100], [1e-3, 0.9e-3, 0.8e-3])  # time falls with tokens
    assert flat.degenerate and flat.law.per_token_s == MIN_PER_TOKEN_S
    one = fit_batch_law([64, 64], [6.4e-4, 6.4e-4])
    assert one.law.overhead_s == 0.0 and one.law.per_token_s == pytest.approx(1e-5)


def test_thread_law_recovers_known_parameters() -> None:
    rng = np.random.default_rng(1)
    v = np.arange(1, 9, dtype=float)
    t1, t2, t3 = 2e-6, 0.7, 3e-7
    y = (t1 * np.exp(-t2 * v) + t3) * (1 + 0.01 * rng.standard_normal(len(v)))
    fit = fit_thread_law(v, y)
    assert fit.law.theta1 == pytest.approx(t1, rel=0.15)
    assert fit.law.theta2 == pytest.approx(t2, rel=0.15)
    assert fit.law.theta3 == pytest.approx(t3, rel=0.15)
    assert fit.r2 > 0.99


def test_thread_law_without_scipy_uses_the_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("moefleet.profiles.fit._curve_fit_refine", lambda *a: None)
    v = np.arange(1, 7, dtype=float)
    fit = fit_thread_law(v, 2e-6 * np.exp(-0.7 * v) + 3e-7)
    assert "grid" in fit.method
    assert fit.law.theta2 == pytest.approx(0.7, rel=0.05) and fit.r2 > 0.999


def test_thread_law_two_points_follows_amdahl() -> None:
    fit = fit_thread_law([1, 2], [1e-6, 0.5e-6])  # ideal scaling from 1 to 2 threads
    law = fit.law
    assert law.speed_factor(2) == pytest.approx(0.5, abs=0.05)
    times = [law.per_token_s(v) for v in range(1, 9)]
    assert all(x >= y for x, y in itertools.pairwise(times))  # non-increasing
    # extrapolation stays near ideal 1/v up to Lambda's 6 vCPUs, never beyond it by much
    assert 0.8 / 6 < law.speed_factor(6) < 0.3


def test_thread_law_flat_cases() -> None:
    single = fit_thread_law([1], [1e-6])
    assert (single.law.theta1, single.law.theta3) == (0.0, 1e-6) and math.isnan(single.r2)
    slower = fit_thread_law([1, 2], [1e-6, 1.3e-6])  # a second thread lost to contention
    assert slower.law.theta1 == 0.0 and slower.law.speed_factor(4) == 1.0


@pytest.mark.parametrize("bad", [[1e-6, float("nan")], [1e-6, 0.0], [1e-6, -1.0]])
def test_fits_reject_nan_and_non_positive_times(bad: list[float]) -> None:
    with pytest.raises(DataError):
        fit_batch_law([1, 2], bad)
    with pytest.raises(DataError):
        fit_thread_law([1, 2], bad)


# ---- measuring a tiny model ----------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter() -> HFMoEAdapter:
    return HFMoEAdapter(tiny_model("mixtral"), name="tiny-mixtral")


@pytest.fixture(scope="module")
def measured(adapter: HFMoEAdapter) -> ComputeProfile:
    return measure_profile(adapter, threads=[1], batch_sizes=SIZES, repeats=2)


def test_measured_profile_is_sane(adapter: HFMoEAdapter, measured: ComputeProfile) -> None:
    assert measured.moe_layers == [0, 1, 2] and len(measured.segments) == 3
    assert measured.bytes_per_token == 64 * 4 and measured.hidden_size == 64
    laws = [*measured.experts.values(), *measured.segments]
    for law in laws:
        assert law.batch.per_token_s > 0 and law.batch.overhead_s >= 0
        assert math.isfinite(law.batch.per_token_s) and math.isfinite(law.batch.overhead_s)
        assert law.batch_r2 >= R2_MIN, law  # time grows linearly with tokens
        assert law.time_s(1024, 1) > law.time_s(16, 1) > 0
        assert law.threads.theta1 == 0.0 and math.isnan(law.threads_r2)  # one thread only
    assert measured.experts[0].param_bytes == param_bytes(adapter.expert(0, 0))
    assert [s.param_bytes for s in measured.segments] == [
        param_bytes(adapter.segment(layer)) for layer in range(3)
    ]
    raw = measured.raw["experts"]["0"]
    assert raw["tokens"] == list(SIZES) and len(raw["batch_fit"]["residuals_s"]) == len(SIZES)
    assert len(raw["experts_sampled"]) == 2
    assert measured.raw["segments"][2]["includes"][-1].startswith("finish")


def test_json_round_trip(measured: ComputeProfile, tmp_path: Path) -> None:
    back = ComputeProfile.load(measured.save(tmp_path / "p.json"))
    # NaN R² (one thread) is written as null (strict JSON); compare the serialised forms
    assert dumps_json(back.to_dict()) == dumps_json(measured.to_dict())
    assert back.expert_time_s(1, 100, 2.0) == measured.expert_time_s(1, 100, 2.0)


def test_nan_profile_file_is_a_data_error(measured: ComputeProfile, tmp_path: Path) -> None:
    d = measured.to_dict()
    d["segments"][0]["batch"]["per_token_s"] = float("nan")
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(DataError):
        ComputeProfile.load(tmp_path / "bad.json")


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"batch_sizes": (0, 16)}, "batch size 0"),
        ({"threads": [1, available_cpus() + 1]}, f"thread count {available_cpus() + 1}"),
        ({"threads": [available_cpus()], "batch_sizes": (16, 64)}, "lack 1"),
        ({"repeats": 0}, "repeats"),
    ],
)
def test_invalid_grid_names_the_value(adapter: HFMoEAdapter, kwargs: dict, needle: str) -> None:
    if needle == "lack 1" and available_cpus() == 1:
        pytest.skip("needs a machine with more than one CPU")
    with pytest.raises(MoefleetError) as err:
        measure_profile(adapter, **kwargs)
    assert needle in err.value.message and err.value.hint


def test_thread_setting_is_restored() -> None:
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError), torch_threads(1):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before


def test_time_cells_counts_calls_and_interleaves() -> None:
    order: list[str] = []
    samples = time_cells(
        [lambda: order.append("a"), lambda: order.append("b")], repeats=3, min_repeat_s=0.0
    )
    assert [len(s) for s in samples] == [3, 3] and all(x >= 0 for s in samples for x in s)
    assert "".join(order) == "aabb" + "ababab"  # warm-up + calibration, then rounds


# ---- cache and CLI -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-mixtral")
    tiny_model("mixtral", vocab_size=300).save_pretrained(out)
    return out


def test_profile_for_measures_once(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MOEFLEET_CACHE_DIR", str(tmp_path))
    first = profile_for(str(model_dir), threads=[1], batch_sizes=(16, 64), repeats=1)
    path = profile_path(str(model_dir))
    assert path.is_file() and path.is_relative_to(tmp_path / "profiles")

    def no_measuring(*a: object, **k: object) -> None:
        raise AssertionError("cached profile was measured again")

    monkeypatch.setattr("moefleet.profiles.measure.measure_profile", no_measuring)
    again = profile_for(str(model_dir))
    assert dumps_json(again.to_dict()) == dumps_json(first.to_dict())
    path.write_text("{truncated")  # a broken cache is measured again, not reported
    monkeypatch.undo()
    monkeypatch.setenv("MOEFLEET_CACHE_DIR", str(tmp_path))
    remeasured = profile_for(str(model_dir), threads=[1], batch_sizes=(16, 64), repeats=1)
    assert ComputeProfile.load(path).experts[0].batch == remeasured.experts[0].batch


def test_cli_json_is_pure_and_files_are_written(model_dir: Path, tmp_path: Path) -> None:
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    t0 = time.perf_counter()
    res = CliRunner().invoke(
        app,
        ["profile-compute", "-m", str(model_dir), "--threads", "1", "--batch-sizes", "16,256",
         "--repeats", "1", "-o", str(out), "--png", str(png), "--json"],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)  # stdout carries the JSON and nothing else
    assert summary["out"] == str(out) and len(summary["functions"]) == 3 + 3
    assert all(f["per_token_s"] > 0 for f in summary["functions"])
    assert ComputeProfile.load(out).model == model_dir.name
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert time.perf_counter() - t0 < 120  # a hang guard, not a timing claim


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["--batch-sizes", "0,16"], "batch size 0"), (["--threads", "99"], "thread count 99"),
     (["--threads", "1,x"], "'x'")],
)
def test_cli_bad_grid_is_one_clear_error(args: list[str], needle: str, tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["profile-compute", "-m", "no-such-model", *args,
                                   "-o", str(tmp_path / "p.json")])
    assert res.exit_code == 2 and needle in res.output and "Traceback" not in res.output
    assert not (tmp_path / "p.json").exists()


# ---- zoo models (Done-when: profiles exist for the embedded defaults) ---------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["minilm-moe-e8", "tiny-moe-lm"])
def test_zoo_model_profile_fits_well(name: str) -> None:
    from moefleet.models import zoo

    if not zoo.has_entry(name) or not zoo.is_built(name):
        if name in os.environ.get("MOEFLEET_REQUIRE_ZOO", "").split(","):
            pytest.fail(f"{name} must be built for this run (make test builds it)")
        pytest.skip(f"{name} is not built in this cache (moefleet models build {name})")
    profile = profile_for(name)  # measured once (default grid), then read from the cache
    assert profile_path(name).is_file()
    laws = [*profile.experts.values(), *profile.segments]
    assert len(profile.segments) == len(profile.raw["segments"]) > 0
    for law in laws:
        assert law.batch.per_token_s > 0 and law.batch_r2 >= 0.7, law
        times = [law.per_token_s(v) for v in (1, 2, 4, 6)]
        assert all(x >= y > 0 for x, y in itertools.pairwise(times))
    assert float(np.median([law.batch_r2 for law in laws])) >= 0.9
