"""``moefleet deploy`` / ``moefleet run`` on the ``aws`` and ``ray`` backends, through the CLI.

What a user types, configured the way a user configures it (environment variables, since
the CLI takes no backend options): for ``aws`` a moto server on 127.0.0.1
(tests/aws_helpers.py) reached through ``AWS_ENDPOINT_URL``, fake credentials, the execution
role in ``MOEFLEET_AWS_ROLE_ARN`` and, for ``run``, ``MOEFLEET_AWS_INVOKER=in-process`` (moto
cannot run code without Docker); for ``ray`` a local node of the command itself (no
``RAY_ADDRESS``), on loopback, shut down when the command ends.

The model is tiny-mixtral trimmed to 2 blocks of 4 experts (as in test_runtime_ray.py),
saved as a checkpoint directory the hand-written plan names: 2 segments + 8 experts = 10
functions, where the zoo's tiny model has 27 (each a process on ray and on the in-process
Lambda emulator, and 2 cores to start them).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from moefleet.cli import app
from tests.aws_helpers import REGION, acquire_moto, fake_session, prepare, release_moto

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
runner = CliRunner()
BUCKET = "moefleet-cli"
# Segments, then experts of layer 0 and 1: distinct sizes, so MemorySize is checked per
# function (the platform's minimum is 128 MB).
SEGMENT_MB = [512, 576]
EXPERT_MB = [[256, 320, 384, 448], [256, 320, 384, 448]]
RUN_ARGS = ["--tokens", "64", "--batch-size", "8", "--max-length", "16", "--json"]


def run(*args: str) -> Any:
    return runner.invoke(app, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def model_dir(small_mixtral_dir: Path) -> Path:
    """tiny-mixtral, 2 blocks of 4 experts (top-2), GPT-2 tokenizer (tests/conftest.py)."""
    return small_mixtral_dir


def _plan(tmp_path: Path, model: Path, method: str) -> Path:
    """A hand-written plan (flow style), as a user would type it."""
    layers = "\n".join(
        f"  - {{layer: {i}, method: {method}, beta: 4, experts: ["
        + ", ".join(f"{{memory_mb: {mb}}}" for mb in mbs) + "]}"
        for i, mbs in enumerate(EXPERT_MB))
    path = tmp_path / "plan.yaml"
    path.write_text(f"model: {model}\nplatform: aws-lambda\nsegment_memory_mb: {SEGMENT_MB}\n"
                    f"layers:\n{layers}\n")
    return path


def _expected_memory() -> dict[str, int]:
    """Lambda function name -> MemorySize, as the plan says."""
    out = {f"moefleet-seg-{b}": mb for b, mb in enumerate(SEGMENT_MB)}
    out.update({f"moefleet-exp-{layer}-{i}": mb for layer, mbs in enumerate(EXPERT_MB)
                for i, mb in enumerate(mbs)})
    return out


def _check_results(data: dict[str, Any], method: str) -> None:
    assert data["tokens"] == 64 and data["max_abs_diff"] is not None
    assert data["max_abs_diff"] <= 1e-4  # --check (the default): vs the monolithic model
    assert data["cost_usd"]["total"] > 0 and data["cost_usd"]["per_1k_tokens"] > 0
    assert [row["method"] for row in data["layers"]] == [method] * 2
    functions = [f for f in data["bill"]["by_function"] if not f.startswith("<")]
    assert len(functions) == 2 + 8 and data["cold_starts"] >= len(functions)


# ---- aws ------------------------------------------------------------------------------


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, aws_credentials: None) -> Iterator[Any]:
    """moto on 127.0.0.1 as the AWS endpoint of this process (``AWS_ENDPOINT_URL``: boto3
    sends every service there), a bucket and an execution role; yields a Lambda client.
    Functions left by the test are deleted."""
    endpoint = acquire_moto()
    try:
        role = prepare(endpoint, BUCKET)
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("MOEFLEET_AWS_ROLE_ARN", role)
        for var in ("MOEFLEET_AWS_CODE_BUCKET", "MOEFLEET_AWS_IMAGE_URI",
                    "MOEFLEET_AWS_INVOKER"):
            monkeypatch.delenv(var, raising=False)
        lam = fake_session().client("lambda", endpoint_url=endpoint, region_name=REGION)
        yield lam
        for name in _function_names(lam):
            lam.delete_function(FunctionName=name)
    finally:
        release_moto()


def _function_names(lam: Any) -> list[str]:
    return [f["FunctionName"] for page in lam.get_paginator("list_functions").paginate()
            for f in page["Functions"]]


def test_deploy_on_aws_creates_the_functions(tmp_path: Path, model_dir: Path,
                                             aws_env: Any) -> None:
    plan = _plan(tmp_path, model_dir, "direct")
    dep = tmp_path / "dep.json"
    res = run("deploy", str(plan), "--backend", "aws", "--store", f"s3://{BUCKET}/cli",
              "-o", str(dep), "--json")
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["backend"] == "aws" and info["functions"] == 2 + 8
    assert info["functions_created"] == info["functions"]
    assert info["store"] == f"s3://{BUCKET}/cli" and info["bytes_uploaded"] > 0
    saved = json.loads(dep.read_text())
    assert saved["backend"] == "aws" and len(saved["functions"]) == 10
    # The functions stay after the command: in Lambda (moto), sized as the plan says.
    memory = {f["FunctionName"]: f["MemorySize"]
              for page in aws_env.get_paginator("list_functions").paginate()
              for f in page["Functions"]}
    assert memory == _expected_memory()
    # ... and the weights are in the bucket, under the deployment's prefix.
    s3 = fake_session().client("s3", endpoint_url=aws_env.meta.endpoint_url)
    keys = [o["Key"] for o in s3.list_objects_v2(
        Bucket=BUCKET, Prefix=f"cli/{info['prefix']}/")["Contents"]]
    assert f"cli/{info['prefix']}/model/seg-0.safetensors" in keys


def test_run_plan_on_aws_end_to_end(tmp_path: Path, model_dir: Path, aws_env: Any,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Deploy, run (the in-process invoker runs the uploaded zip), bill, tear down."""
    monkeypatch.setenv("MOEFLEET_AWS_INVOKER", "in-process")
    plan = _plan(tmp_path, model_dir, "storage")
    res = run("run", "--plan", str(plan), "--backend", "aws", "--store",
              f"s3://{BUCKET}/run", *RUN_ARGS)
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["backend"] == "aws"
    _check_results(data, "storage")
    assert _function_names(aws_env) == []  # torn down
    s3 = fake_session().client("s3", endpoint_url=aws_env.meta.endpoint_url)
    assert s3.list_objects_v2(Bucket=BUCKET, Prefix="run/").get("KeyCount") == 0


@pytest.mark.parametrize("args,store,needle", [
    # No MOEFLEET_AWS_ROLE_ARN: nothing can be created.
    (["deploy", "PLAN", "--backend", "aws"], "s3", "MOEFLEET_AWS_ROLE_ARN"),
    # A directory store leaves the aws backend no bucket for its code zip.
    (["deploy", "PLAN", "--backend", "aws"], "dir", "bucket for the code zip"),
    (["run", "--plan", "PLAN", "--backend", "cloud9"], "dir", "unknown backend 'cloud9'"),
    (["run", "--plan", "PLAN", "--backend", "aws"], "s3", "unknown invoker 'docker'"),
    (["run", "--plan", "PLAN", "--backend", "aws", "-d", "nosuchdata"], "s3",
     "unknown dataset 'nosuchdata'"),
])
def test_bad_backend_setup_is_a_clear_error(
    tmp_path: Path, model_dir: Path, aws_env: Any, monkeypatch: pytest.MonkeyPatch,
    args: list[str], store: str, needle: str,
) -> None:
    if needle == "MOEFLEET_AWS_ROLE_ARN":
        monkeypatch.delenv("MOEFLEET_AWS_ROLE_ARN")
    if "invoker" in needle:
        monkeypatch.setenv("MOEFLEET_AWS_INVOKER", "docker")
    plan = _plan(tmp_path, model_dir, "direct")
    url = f"s3://{BUCKET}/bad" if store == "s3" else str(tmp_path / "store")
    res = runner.invoke(app, [str(plan) if a == "PLAN" else a for a in args]
                        + ["--store", url])
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output
    # A failed command leaves nothing behind: no functions, no weights.
    assert _function_names(aws_env) == []
    s3 = fake_session().client("s3", endpoint_url=aws_env.meta.endpoint_url)
    assert s3.list_objects_v2(Bucket=BUCKET, Prefix="bad/").get("KeyCount") == 0
    assert not list((tmp_path / "store").glob("*/*/model/*"))


# ---- ray ------------------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_run_plan_on_local_ray(tmp_path: Path, model_dir: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """One local Ray node of the command (RAY_ADDRESS unset), on loopback, shut down at the
    end; outputs equal the monolithic model's and the run is billed."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (pip install 'moefleet[ray]')")
    if "ray" in sys.modules:  # Ray fixes its binding at import: loopback needs a fresh one
        from ray._private import ray_constants

        if ray_constants.ENABLE_RAY_CLUSTER:
            pytest.skip("ray was imported before without the loopback switch")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    from moefleet.runtime.ray_backend import _LOOPBACK_ENV, RayBackend

    monkeypatch.setenv(_LOOPBACK_ENV, "0")  # as start_local_ray does; undone afterwards
    nodes: list[str] = []
    teardown = RayBackend.teardown

    def spy(self: RayBackend) -> None:  # where the command's node listens, before it stops
        import ray

        if ray.is_initialized():
            nodes.extend(n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive"))
        teardown(self)

    monkeypatch.setattr(RayBackend, "teardown", spy)
    plan = _plan(tmp_path, model_dir, "direct")
    started = time.monotonic()
    res = run("run", "--plan", str(plan), "--backend", "ray", *RUN_ARGS)
    elapsed = time.monotonic() - started
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["backend"] == "ray"
    _check_results(data, "direct")
    assert nodes == ["127.0.0.1"]

    import ray

    assert not ray.is_initialized()  # the command shut its node down
    print(f"moefleet run on ray: {elapsed:.1f} s")  # ~40 s on 2 cores (-s to see)
