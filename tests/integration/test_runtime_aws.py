"""The ``aws`` backend against moto (tests/aws_helpers.py: a server on 127.0.0.1).

What runs for real: every Lambda control-plane call (create/update/configure/reserve/delete)
and all S3 traffic (code zip, weights, tensors) go to moto over HTTP. What is emulated:
moto's invoke needs Docker, so invocations use the backend's ``in-process`` invoker, which
runs the *uploaded zip's* generated entry point in forked processes on the real event JSON.
The shared contract suite (tests/contracts/test_function_backend.py) covers errors,
retries, timeouts, limits and records; this file covers deploy calls, the package and a
real MoE model end to end.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from moefleet.platform import load_platform
from moefleet.runtime import BackendClosedError, FunctionSpec, HandlerRef
from tests.aws_helpers import acquire_moto, fake_session, moto_aws_backend, release_moto

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
DEBUG = HandlerRef("moefleet.runtime.handlers:debug_handler", {"init_sleep_s": 0.0})


@pytest.fixture
def moto() -> Iterator[str]:
    endpoint = acquire_moto()  # kept up between backends of one test
    try:
        yield endpoint
    finally:
        release_moto()


def _lambda(endpoint: str) -> Any:
    return fake_session().client("lambda", endpoint_url=endpoint)


def test_deploy_update_scale_teardown_against_moto(moto: str) -> None:
    from moefleet.runtime.aws_package import CONFIG_VAR, HANDLER, build_lambda_zip

    lam = _lambda(moto)
    backend = moto_aws_backend(load_platform("aws-lambda"), function_prefix="it-")
    try:
        spec = backend.deploy(FunctionSpec("exp-1-3", "expert", DEBUG, memory_mb=512,
                                           timeout_s=2.5, replicas=2, layer=1, experts=(3,)))
        conf = lam.get_function_configuration(FunctionName="it-exp-1-3")
        assert (conf["MemorySize"], conf["Timeout"], conf["Handler"], conf["Runtime"]) == (
            512, 3, HANDLER, "python3.11")  # Lambda's Timeout: whole seconds, rounded up
        cfg = json.loads(conf["Environment"]["Variables"][CONFIG_VAR])
        assert cfg["handler"] == {"factory": DEBUG.factory, "config": DEBUG.config}
        assert cfg["store"] == {"url": backend.store_url} and cfg["vcpus"] == spec.vcpus
        assert cfg["max_inline_bytes"] == backend.max_inline_bytes < 6291456 * 3 // 4
        assert lam.get_function_concurrency(FunctionName="it-exp-1-3")[
            "ReservedConcurrentExecutions"] == 2
        # The code in Lambda is the zip we built (same SHA-256), uploaded to the bucket.
        assert conf["CodeSha256"] == build_lambda_zip().sha256

        backend.deploy(FunctionSpec("exp-1-3", "expert", DEBUG, memory_mb=1024))
        again = lam.get_function_configuration(FunctionName="it-exp-1-3")
        assert again["MemorySize"] == 1024 and again["Timeout"] == 60
        new_cfg = json.loads(again["Environment"]["Variables"][CONFIG_VAR])
        assert new_cfg["deploy_id"] != cfg["deploy_id"]  # a new version: cold again
        assert backend.scale("exp-1-3", replicas=4).replicas == 4
        assert lam.get_function_concurrency(FunctionName="it-exp-1-3")[
            "ReservedConcurrentExecutions"] == 4
        assert "it-exp-1-3" in [f["FunctionName"] for f in lam.list_functions()["Functions"]]
    finally:
        backend.teardown()
    assert "it-exp-1-3" not in [f["FunctionName"] for f in lam.list_functions()["Functions"]]
    backend.teardown()  # idempotent
    with pytest.raises(BackendClosedError):
        backend.deploy(FunctionSpec("late", "aux", DEBUG, memory_mb=256))


def test_dotted_names_and_missing_role_are_clear_errors(moto: str) -> None:
    from moefleet.errors import MoefleetError
    from moefleet.runtime import InvalidFunctionSpecError

    backend = moto_aws_backend(load_platform("aws-lambda"))
    try:
        with pytest.raises(InvalidFunctionSpecError, match=r"without '\.'"):
            backend.deploy(FunctionSpec("a.b", "aux", DEBUG, memory_mb=256))
        backend.role_arn = None
        with pytest.raises(MoefleetError, match="role") as info:
            backend.deploy(FunctionSpec("a-b", "aux", DEBUG, memory_mb=256))
        assert "MOEFLEET_AWS_ROLE_ARN" in info.value.hint
    finally:
        backend.teardown()


def test_zip_holds_the_entry_point_which_imports_and_runs(tmp_path: Path) -> None:
    from moefleet.runtime.aws_package import CONFIG_VAR, build_lambda_zip, encode_event
    from moefleet.runtime.payload import pack

    first, second = build_lambda_zip(tmp_path / "a"), build_lambda_zip(tmp_path / "b")
    assert first.sha256 == second.sha256  # deterministic: the hash depends on sources only
    names = zipfile.ZipFile(first.path).namelist()
    assert "lambda_function.py" in names and "moefleet/runtime/handlers.py" in names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    code = tmp_path / "task"
    zipfile.ZipFile(first.path).extractall(code)
    event = tmp_path / "event.json"
    event.write_bytes(encode_event(pack(meta={"op": "echo"}), "r1"))
    # A fresh interpreter, the unpacked zip first on sys.path, as Lambda's runtime does.
    script = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(code)!r})\n"
        "import lambda_function, moefleet\n"
        f"assert moefleet.__file__.startswith({str(code)!r}), moefleet.__file__\n"
        f"result = lambda_function.lambda_handler(json.load(open({str(event)!r})), None)\n"
        "print(json.dumps(result))\n")
    config = {"function": "probe", "memory_mb": 256, "vcpus": 0.1, "store": None,
              "handler": {"factory": DEBUG.factory, "config": {}},
              "max_inline_bytes": 1 << 20}
    env = {**os.environ, CONFIG_VAR: json.dumps(config)}
    out = subprocess.run([sys.executable, "-I", "-c", script], env=env, capture_output=True,
                         text=True, timeout=120, cwd=code)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["cold"] and json.loads(event.read_text())["payload_b64"] == (
        result["payload_b64"])


def test_container_recipe(tmp_path: Path) -> None:
    from moefleet.runtime.aws_package import container_recipe, write_container_context

    text = container_recipe()
    assert text.splitlines()[3] == "FROM public.ecr.aws/lambda/python:3.11"
    assert 'CMD ["lambda_function.lambda_handler"]' in text
    assert "download.pytorch.org/whl/cpu" in text
    dockerfile = write_container_context(tmp_path / "ctx")
    assert dockerfile.read_text() == text
    reqs = (tmp_path / "ctx" / "requirements.txt").read_text()
    assert "torch==" in reqs and "safetensors==" in reqs and "+cpu" not in reqs
    assert (tmp_path / "ctx" / "lambda_function.py").is_file()
    assert (tmp_path / "ctx" / "moefleet" / "runtime" / "handlers.py").is_file()


def test_report_line_parsing() -> None:
    import base64

    from moefleet.runtime.aws_package import parse_report

    tail = ("START RequestId: x Version: $LATEST\nEND RequestId: x\nREPORT RequestId: x\t"
            "Duration: 12.34 ms\tBilled Duration: 13 ms\tMemory Size: 512 MB\t"
            "Max Memory Used: 88 MB\tInit Duration: 456.70 ms\t\n")
    report = parse_report(base64.b64encode(tail.encode()).decode())
    assert report == {"Duration": 12.34, "Billed Duration": 13.0, "Max Memory Used": 88.0,
                      "Init Duration": 456.7}
    assert parse_report(None) == {} and parse_report("") == {}


def test_moe_model_through_lambda_and_s3(moto: str, aws_credentials: None) -> None:
    """A real MoE model on the aws backend, weights and tensors in moto's S3: layer 0 by
    'storage', layer 1 by 'direct', layer 2 by 'pipelined'; outputs equal the monolithic
    model's. Two batches: the first cold, the second warm."""
    import torch

    from moefleet.models.hf import HFMoEAdapter
    from moefleet.models.tiny import tiny_model
    from moefleet.plan import DeploymentPlan
    from moefleet.platform import open_store
    from moefleet.runtime.deploy import deploy_plan, remove_objects
    from tests.segment_helpers import segment_batches

    platform = load_platform("aws-lambda")
    adapter = HFMoEAdapter(tiny_model("mixtral"))
    plan = DeploymentPlan.uniform("tiny", platform.name, adapter.moe_layers,
                                  [8] * len(adapter.moe_layers), adapter.num_layers, 512)
    methods = ["storage", "direct", "pipelined"]
    plan = plan.model_copy(update={"layers": [
        lp.model_copy(update={"method": m, "beta": 3})
        for lp, m in zip(plan.layers, methods, strict=True)]})
    store = open_store(f"s3://moefleet-model/it?endpoint={moto}&create=1")
    backend = moto_aws_backend(platform, bucket="moefleet-model", store=store.url)
    try:
        dep = deploy_plan(adapter, plan, platform, store, backend=backend)
        assert store.exists(dep.layout.expert_key(1, 3))  # weights went to S3
        torch.manual_seed(0)
        batches = [torch.randint(0, 1000, (2, 6)) for _ in range(2)]
        with segment_batches(adapter, dep, platform, backend, store) as ex:
            results = [ex.run_batch(ids) for ids in batches]
        for res, ids in zip(results, batches, strict=True):
            assert (res.output - adapter.reference_forward(ids)).abs().max() <= 1e-4
        recs = [r for res in results for r in res.records]
        first: dict[str, Any] = {}
        for r in results[0].records:  # in completion order: a function's first call is cold
            first.setdefault(r.function, r)
        assert all(r.cold and r.init_s > 0 for r in first.values())
        assert not any(r.cold for r in results[1].records if r.function in first)  # warm
        by_layer = {layer: [r for r in results[1].records if r.kind == "expert"
                            and r.layer == layer] for layer in adapter.moe_layers}
        assert all(r.storage_gets >= 1 and r.storage_puts >= 1 for r in by_layer[0])
        assert all(r.storage_gets == r.storage_puts == 0 and r.bytes_in > 0
                   for r in by_layer[1])
        assert all(r.storage_gets >= 1 for r in by_layer[2])
        assert all(r.end_s >= r.start_s and r.init_s >= 0 for r in recs)
    finally:
        backend.teardown()
    assert remove_objects(dep, store) == 1 + 3 + 24  # only the model: runs cleaned up


def test_lambda_invoker_reads_report_and_maps_errors(moto: str) -> None:
    """The ``lambda`` invoker's side of Invoke (moto cannot run code without Docker, so
    botocore's Stubber plays Lambda's answers): durations from the REPORT line, errors
    mapped as the contract says, throttling retried then reported."""
    import base64

    from botocore.response import StreamingBody
    from botocore.stub import Stubber

    from moefleet.runtime import (
        FunctionCrashedError,
        HandlerError,
        InvocationTimeoutError,
        ThrottledError,
        UnknownFunctionError,
    )
    from moefleet.runtime.payload import pack

    def answer(body: dict[str, Any], error: bool = False, log: str = "") -> dict[str, Any]:
        data = json.dumps(body).encode()
        out: dict[str, Any] = {"StatusCode": 200,
                               "Payload": StreamingBody(io.BytesIO(data), len(data))}
        if error:
            out["FunctionError"] = "Unhandled"
        if log:
            out["LogResult"] = base64.b64encode(log.encode()).decode()
        return out

    packet = pack(meta={"op": "echo"})
    ok = {"payload_b64": base64.b64encode(packet).decode(), "cold": True, "init_s": 0.5,
          "start": 100.0, "end": 100.2, "puts": 1, "gets": 2}
    report = ("REPORT RequestId: x\tDuration: 800.00 ms\tBilled Duration: 800 ms\t"
              "Memory Size: 256 MB\tMax Memory Used: 90 MB\tInit Duration: 1500.00 ms\n")
    backend = moto_aws_backend(load_platform("aws-lambda"), invoker="lambda",
                               retry_backoff_s=0.001)
    try:
        backend.deploy(FunctionSpec("f", "aux", DEBUG, memory_mb=256, timeout_s=3))
        with Stubber(backend._api.lambda_) as stub:
            stub.add_response("invoke", answer(ok, log=report))
            res = backend.invoke("f", packet)
            assert res.payload == packet
            rec = res.record
            assert rec.cold and rec.init_s == pytest.approx(0.5 + 1.5)
            assert rec.end_s - rec.start_s == pytest.approx(0.8 - 0.5)
            assert (rec.storage_puts, rec.storage_gets) == (1, 2)

            failure = json.dumps({"phase": "run", "type": "ValueError", "message": "boom",
                                  "hint": ""})
            stub.add_response("invoke", answer({"errorType": "MoefleetHandlerError",
                                                "errorMessage": failure}, error=True))
            with pytest.raises(HandlerError, match="boom") as info:
                backend.invoke("f", packet)
            assert (info.value.remote_type, info.value.phase) == ("ValueError", "run")

            stub.add_response("invoke", answer({"errorType": "Sandbox.Timedout",
                                                "errorMessage": "Task timed out after 3.00 "
                                                "seconds"}, error=True))
            with pytest.raises(InvocationTimeoutError, match="timeout_s=3"):
                backend.invoke("f", packet)

            for _ in range(3):
                stub.add_client_error("invoke", "TooManyRequestsException", "Rate exceeded",
                                      429)
            with pytest.raises(ThrottledError, match="moefleet-f"):
                backend.invoke("f", packet)

            crash = {"errorType": "Runtime.ExitError", "errorMessage": "exit status 17"}
            stub.add_response("invoke", answer(crash, error=True))
            stub.add_response("invoke", answer(dict(ok, cold=False, init_s=0.0)))
            assert not backend.invoke("f", packet).record.cold  # retried once
            for _ in range(3):
                stub.add_response("invoke", answer(crash, error=True))
            with pytest.raises(FunctionCrashedError, match="f"):
                backend.invoke("f", packet)

            stub.add_client_error("invoke", "ResourceNotFoundException", "gone", 404)
            with pytest.raises(UnknownFunctionError, match="moefleet-f"):
                backend.invoke("f", packet)
            stub.assert_no_pending_responses()
        assert backend.stats()["retries"] == 2 + 1 + 2
        recs = backend.records()
        assert [r.failed for r in recs].count(False) == 2
        # billed failed attempts: the timeout (its whole Lambda Timeout, 3 s) and the
        # crashes (1 retried, then 3 in a row)
        failed = [r for r in recs if r.failed]
        assert len(failed) == 1 + 1 + 3
        assert sorted(round(r.end_s - r.start_s, 6) for r in failed)[-1] == 3.0
    finally:
        backend.teardown()
