"""The findings list (shared/findings/bad-input-2026-11.md), one test per class of bad
input: each asserts a clean one-line ``error:`` (no traceback), a non-zero exit and no
partial output files. Inputs are hand-built (no model weights), so the file runs fast."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from moefleet.cli import app
from moefleet.cli.plan import plan_table
from moefleet.io import write_text_atomic
from moefleet.plan import DeploymentPlan
from tests.reliability.hostile import (
    EXPERTS,
    LAYERS,
    binary_file,
    files_under,
    make_trace,
    seed_files,
    umask,
    write,
    write_json,
)

runner = CliRunner()
SYN = "synthetic:blocks=4,experts=8,top_k=2"


def invoke(args: list[str], cwd: Path) -> tuple[int, str]:
    old = Path.cwd()
    os.chdir(cwd)
    try:
        res = runner.invoke(app, args)
    finally:
        os.chdir(old)
    return res.exit_code, res.output


def assert_clean_failure(code: int, output: str, needle: str = "") -> None:
    assert code != 0, output
    assert "Traceback" not in output and "Aborted" not in output, output
    assert ("error:" in output) or ("Invalid value" in output) or ("No such option"
                                                                      in output), output
    assert needle in output.replace("\n", " ").replace("│", " "), output


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("seeds")
    paths = seed_files(folder)
    code, out = invoke(["plan", "--profile", str(paths["profile"]), "--counts",
                        str(paths["trace"]), "--slo", "30", "-o", str(folder / "plan.yaml")],
                       folder)
    assert code == 0, out
    paths["plan"] = folder / "plan.yaml"
    return paths


def _plan_args(s: dict[str, Path], out: str) -> list[str]:
    return ["plan", "--profile", str(s["profile"]), "--counts", str(s["trace"]), "--slo", "30",
            "-o", out]


# ---- class 1: output paths that are directories / unwritable; no partial outputs -------
@pytest.mark.parametrize("case", ["plan-dir", "plan-proc", "sim-png-dir", "sim-out-dir",
                                  "traces-png-dir", "fit-dir", "fit-json", "same-file"])
def test_bad_output_paths_fail_before_work(case: str, seeds: dict[str, Path],
                                           tmp_path: Path) -> None:
    (tmp_path / "adir").mkdir()
    sim = ["simulate", "--model", SYN, "--memory", "2048", "--duration", "5"]
    args = {
        "plan-dir": _plan_args(seeds, "adir"),
        "plan-proc": _plan_args(seeds, "/proc/nope/p.yaml"),
        "sim-png-dir": [*sim, "-o", "r.json", "--png", "adir"],
        "sim-out-dir": [*sim, "-o", "adir"],
        "traces-png-dir": ["traces", "show", str(seeds["trace"]), "--png", "adir"],
        "fit-dir": ["predict", "fit", "--train", str(seeds["trace"]), "-o", "adir"],
        "fit-json": ["predict", "fit", "--train", str(seeds["trace"]), "-o", "x.json"],
        "same-file": [*sim, "-o", "r.json", "--png", "r.json"],
    }[case]
    before = files_under(tmp_path)
    code, out = invoke(args, tmp_path)
    assert_clean_failure(code, out)
    assert files_under(tmp_path) == before  # nothing written, not even the first output


def test_outputs_honour_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        write_text_atomic(tmp_path / "a.txt", "x")
        assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o640
    finally:
        os.umask(old)
    assert umask() == old


# ---- class 2: corrupt, binary, truncated, NaN and inconsistent input files ---------------
def _corrupt_cases(s: dict[str, Path], d: Path) -> dict[str, list[str]]:
    t = make_trace()
    bad_ids = t.table.column("expert_ids").to_pylist()
    bad_ids[0] = [99, 1]
    import pyarrow as pa

    from moefleet.traces.schema import Trace, write_trace

    def trace_with(name: str, table: object = None, **meta: object) -> str:
        tr = Trace(table if table is not None else t.table, {**t.meta, **meta})
        return str(write_trace(tr, d / name))

    idx = t.table.schema.get_field_index("expert_ids")
    bad_table = t.table.set_column(idx, t.table.schema.field(idx),
                                   pa.array(bad_ids, type=t.table.schema.field(idx).type))
    gw = t.table.column("gate_weights").to_pylist()
    gw[3] = [float("nan"), 1.0]
    gidx = t.table.schema.get_field_index("gate_weights")
    nan_table = t.table.set_column(gidx, t.table.schema.field(gidx),
                                   pa.array(gw, type=t.table.schema.field(gidx).type))
    raw = s["trace"].read_bytes()
    (d / "trunc.parquet").write_bytes(raw[: len(raw) // 2])
    prof = json.loads(s["profile"].read_text())
    neg = json.loads(json.dumps(prof))
    neg["experts"]["0"]["batch"]["overhead_s"] = -5.0
    np.save(d / "nan.npy", np.full((LAYERS, EXPERTS), np.nan))
    np.save(d / "huge.npy", np.full((LAYERS, EXPERTS), 1e15))
    np.save(d / "str.npy", np.array([["a"] * EXPERTS] * LAYERS))
    (d / "empty.npy").write_bytes(b"")
    (d / "empty.npz").write_bytes(b"")
    plan = yaml.safe_load(s["plan"].read_text())
    plan["predicted"]["cost_usd"] = float("nan")
    plan_kw = ["--profile", str(s["profile"]), "--slo", "30", "-o", "p.yaml"]
    sim = ["simulate", "--model", SYN, "--memory", "2048", "--duration", "5"]
    return {
        "plan-binary": ["plan", "show", str(binary_file(d / "b.yaml"))],
        "plan-nan-prediction": ["plan", "show", str(write(d / "n.yaml", yaml.safe_dump(plan)))],
        "platform-binary": ["platforms", "show", str(binary_file(d / "p.yaml"))],
        "trace-bad-expert": ["traces", "show", trace_with("be.parquet", bad_table)],
        "trace-nan-gates": ["traces", "show", trace_with("ng.parquet", nan_table)],
        "trace-zero-rows": ["traces", "show", trace_with("z.parquet", t.table.slice(0, 0))],
        "trace-neg-experts": ["traces", "show", trace_with("ne.parquet", num_experts=[-8, -8])],
        "trace-truncated": ["traces", "show", str(d / "trunc.parquet")],
        "profile-list": ["plan", "--counts", str(s["trace"]), "--slo", "2", "-o", "p.yaml",
                         "--profile", str(write(d / "l.json", "[1,2,3]"))],
        "profile-neg-overhead": [*sim, "--profile", str(write_json(d / "no.json", neg))],
        "counts-nan": ["plan", "--counts", str(d / "nan.npy"), *plan_kw],
        "counts-huge": ["plan", "--counts", str(d / "huge.npy"), *plan_kw],
        "counts-str": ["plan", "--counts", str(d / "str.npy"), *plan_kw],
        "counts-empty": ["plan", "--counts", str(d / "empty.npy"), *plan_kw],
        "counts-other-model": ["plan", "--counts",
                               trace_with("om.parquet", model="other-model"), *plan_kw],
        "predictor-empty": ["plan", "bo", "--profile", str(s["profile"]), "--predictor",
                            str(d / "empty.npz"), "--bo-trace", str(s["trace"]), "--slo", "2",
                            "-o", "p.yaml"],
        "workload-binary": [*sim, "--workload", str(binary_file(d / "a.csv"))],
        "deployment-list": ["run", "--deployment", str(write(d / "dep.json", "[1]"))],
    }


CORRUPT = ["plan-binary", "plan-nan-prediction", "platform-binary", "trace-bad-expert",
           "trace-nan-gates", "trace-zero-rows", "trace-neg-experts", "trace-truncated",
           "profile-list", "profile-neg-overhead", "counts-nan", "counts-huge", "counts-str",
           "counts-empty", "counts-other-model", "predictor-empty", "workload-binary",
           "deployment-list"]


@pytest.mark.parametrize("case", CORRUPT)
def test_corrupt_inputs_are_clean_errors(case: str, seeds: dict[str, Path],
                                         tmp_path: Path) -> None:
    args = _corrupt_cases(seeds, tmp_path)[case]
    before = files_under(tmp_path)
    code, out = invoke(args, tmp_path)
    assert_clean_failure(code, out)
    assert files_under(tmp_path) == before


# ---- class 3: option values a library model rejects; class 4: numbers that size work ---
OPTIONS = {
    "memory-0": ["simulate", "--model", SYN, "--memory", "0"],
    "method-bogus": ["simulate", "--model", SYN, "--memory", "2048", "--method", "bogus"],
    "replicas-neg": ["simulate", "--model", SYN, "--memory", "2048", "--replicas", "-1"],
    "top-k-0": ["simulate", "--model", SYN, "--memory", "2048", "--top-k", "0"],
    "slo-0": ["simulate", "--model", SYN, "--memory", "2048", "--slo", "0"],
    "seed-neg": ["simulate", "--model", SYN, "--memory", "2048", "--seed", "-1"],
    "workers-neg": ["run", "--plan", "p.yaml", "--workers", "-1"],
    "workers-0": ["run", "--plan", "p.yaml", "--workers", "0"],
    "workers-huge": ["run", "--plan", "p.yaml", "--workers", "100000"],
    "time-limit-neg": ["plan", "--counts", "c.npy", "--slo", "2", "--time-limit", "-1"],
    "tokens-0": ["plan", "--counts", "c.npy", "--slo", "2", "--tokens", "0"],
    "store-empty": ["deploy", "p.yaml", "--store", ""],
    # bounded inputs: refused up front, before any allocation
    "rate-1e9": ["simulate", "--model", SYN, "--memory", "2048", "--duration", "60",
                 "--workload", "poisson:rate=1e9"],
    "duration-1e12": ["simulate", "--model", SYN, "--memory", "2048", "--duration", "1e12"],
    "output-tokens-1e9": ["simulate", "--model", SYN, "--memory", "2048", "--decoder",
                          "--output-tokens", "1000000000"],
    "max-replicas-1e9": ["plan", "--counts", "c.npy", "--slo", "2", "--max-replicas",
                         "1000000000"],
    "pairs-1e8": ["plan", "bo", "--predictor", "x.npz", "--bo-trace", "t.parquet", "--slo", "2",
                  "--pairs", "100000000"],
    "batch-size-1e8": ["profile-compute", "--batch-sizes", "1,100000000"],
    "batch-sizes-empty": ["profile-compute", "--batch-sizes", ""],
    "batch-sizes-one": ["profile-compute", "--batch-sizes", "16"],
}


@pytest.mark.parametrize("case", sorted(OPTIONS))
def test_bad_numbers_are_refused_up_front(case: str, tmp_path: Path) -> None:
    # The pytest timeout guards against doing the work instead of refusing it.
    code, out = invoke(OPTIONS[case], tmp_path)
    assert_clean_failure(code, out)
    assert files_under(tmp_path) == set()


def test_platform_with_a_huge_memory_range_is_refused(tmp_path: Path) -> None:
    from importlib import resources

    spec = yaml.safe_load((resources.files("moefleet") / "embedded/platforms/aws-lambda.yaml")
                          .read_text())
    spec["memory"]["max_mb"] = 10**12
    code, out = invoke(["platforms", "show", str(write(tmp_path / "h.yaml",
                                                       yaml.safe_dump(spec)))], tmp_path)
    assert_clean_failure(code, out, "memory options")


# ---- class 5: silent wrong results are now errors or visible ----------------------------
def test_model_mismatches_are_errors(seeds: dict[str, Path], tmp_path: Path) -> None:
    code, out = invoke(["plan", "--model", "minilm-moe-e8", "--profile", str(seeds["profile"]),
                        "--counts", str(seeds["trace"]), "--slo", "30", "-o", "p.yaml"],
                       tmp_path)
    assert_clean_failure(code, out, "measured on")
    other = json.loads(seeds["profile"].read_text())
    other["model"] = "minilm-moe-e8"
    code, out = invoke(["simulate", "--plan", str(seeds["plan"]), "--duration", "5",
                        "--profile", str(write_json(tmp_path / "o.json", other))], tmp_path)
    assert_clean_failure(code, out, "measured on")
    assert files_under(tmp_path) == {"o.json"}


def test_json_output_is_strict(seeds: dict[str, Path], tmp_path: Path) -> None:
    plan = DeploymentPlan.load(seeds["plan"])
    plan.meta["r2"] = float("nan")
    plan.save(tmp_path / "p.yaml")
    res = runner.invoke(app, ["plan", "show", str(tmp_path / "p.yaml"), "--json"])
    assert res.exit_code == 0, res.output

    def reject(name: str) -> None:
        raise AssertionError(f"bare {name} in JSON output")

    assert json.loads(res.stdout, parse_constant=reject)["meta"]["r2"] is None


def test_solver_time_limit_is_flagged_in_the_table(seeds: dict[str, Path]) -> None:
    from rich.console import Console

    plan = DeploymentPlan.load(seeds["plan"])
    plan.meta.update(status="timelimit", gap=0.5)
    con = Console(record=True, width=200)
    con.print(plan_table(plan))
    text = con.export_text()
    assert "WARNING" in text and "timelimit" in text


# ---- class 6: environment and lifecycle ("Also seen") -----------------------------------
def test_models_info_never_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOEFLEET_CACHE_DIR", str(tmp_path))
    code, out = invoke(["models", "info", "tiny-mixtral-random"], tmp_path)
    assert_clean_failure(code, out, "moefleet models build tiny-mixtral-random")
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


@pytest.mark.parametrize("var", ["MOEFLEET_CACHE_DIR", "MOEFLEET_DATA_DIR"])
def test_bad_env_dirs_are_clean_errors(var: str, seeds: dict[str, Path], tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(var, str(seeds["trace"]) if var == "MOEFLEET_CACHE_DIR" else "/nonexist")
    args = (["models", "info", "tiny-mixtral-random"] if var == "MOEFLEET_CACHE_DIR"
            else ["profile", "-m", "tiny-mixtral-random", "-d", "wikitext2", "-o", "t.parquet"])
    code, out = invoke(args, tmp_path)
    assert_clean_failure(code, out, var if var == "MOEFLEET_DATA_DIR" else "cache")


def test_sigterm_unwinds_temporary_stores(tmp_path: Path) -> None:
    """The CLI's SIGTERM handler turns the signal into SystemExit, so the temporary store
    of ``moefleet run --plan`` (a TemporaryDirectory) is removed as on Ctrl-C."""
    script = (
        "import signal, sys, tempfile, time\n"
        "from moefleet.cli import _exit_on_sigterm\n"
        "signal.signal(signal.SIGTERM, _exit_on_sigterm)\n"
        f"with tempfile.TemporaryDirectory(prefix='moefleet-store-', dir={str(tmp_path)!r}) as t:\n"
        "    open(t + '/weights.bin', 'wb').write(b'x' * 1000)\n"
        "    print(t, flush=True)\n"
        "    time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stdout is not None
    store = Path(proc.stdout.readline().strip())
    assert store.is_dir()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert not store.exists() and list(tmp_path.iterdir()) == []
