"""The ``aws`` backend: moefleet functions as AWS Lambda functions, weights and tensors in S3.

``deploy`` packages the handlers (:mod:`moefleet.runtime.aws_package`: one zip of the
moefleet sources + a generated ``lambda_function.py``, cached by code hash; or a container
image you built from :func:`~moefleet.runtime.aws_package.container_recipe`), uploads the
zip to the deployment bucket and creates the function, or updates its code and
configuration: ``MemorySize`` = ``memory_mb``, ``Timeout`` = ``timeout_s`` rounded up to
whole seconds, ``Environment`` = the handler's JSON config (``MOEFLEET_CONFIG``, with a
per-deploy id so a redeploy always gets fresh, cold environments) and
``ReservedConcurrentExecutions`` = replicas x concurrency (where the account allows it).

``invoke`` sends the event ``{"payload_b64", "request_id"}`` (the packet, base64 in JSON),
and reads durations from the ``REPORT`` line of the log tail (``Duration``, ``Init
Duration``), falling back to the handler's own timings. Limits are measured on the JSON
event and result, as Lambda does (base64 included): a packet above ~4.5 MB of the 6 MB
limit does not fit, so handlers get :attr:`AwsBackend.max_inline_bytes` as their budget.

Invokers (``invoker=``, default env ``MOEFLEET_AWS_INVOKER``, else ``"lambda"``; the CLI
takes no backend options, so ``moefleet run`` picks one by that variable): ``"lambda"``
calls Lambda's ``Invoke`` API (real AWS, or a Lambda emulator that runs code).
``"in-process"`` (tests; moto's invoke needs Docker) emulates the data plane on this
machine (:mod:`moefleet.runtime.aws_inprocess`): the uploaded zip's entry point runs
in forked processes on the real event JSON, while every deploy call and all S3 traffic go
to the configured endpoint over HTTP (the environments get the caller's credentials and,
where one is set, its endpoint as ``AWS_ENDPOINT_URL``: they live in the same cloud).
Errors (both invokers): ``Unhandled`` -> :class:`HandlerError`; ``Sandbox.Timedout`` ->
:class:`InvocationTimeoutError`; ``Runtime.ExitError`` (the process died) and
throttling/service errors are retried with backoff, then :class:`FunctionCrashedError` /
:class:`ThrottledError` naming the function. Failed attempts are billed as Lambda bills
them: a crash up to the crash (conservatively: the attempt's wall time), a timeout for its
whole Lambda ``Timeout``. ``teardown`` deletes every function deployed (or updated).
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import re
import threading
import time
import uuid
from dataclasses import replace
from typing import Any, Literal

from moefleet.errors import MoefleetError
from moefleet.platform import InvocationRecord, ObjectStore, PlatformSpec, load_platform
from moefleet.platform.inline import base64_inline_bytes
from moefleet.runtime.aws_api import LambdaApi, Retry
from moefleet.runtime.aws_package import (
    CONFIG_VAR,
    ERROR_TYPE,
    HANDLER,
    build_lambda_zip,
    decode_error,
    encode_event,
    json_object,
    parse_report,
)
from moefleet.runtime.base import (
    FunctionBackend,
    FunctionSpec,
    InvokeResult,
    check_payload,
    payload_limit,
    validate_spec,
)
from moefleet.runtime.errors import (
    BackendClosedError,
    FunctionCrashedError,
    FunctionError,
    HandlerError,
    InvalidFunctionSpecError,
    InvocationTimeoutError,
    PayloadTooLargeError,
    ThrottledError,
)
from moefleet.runtime.replies import failed_record
from moefleet.runtime.retry import call_with_retries

log = logging.getLogger(__name__)
_ENV_LIMIT = 4096  # Lambda: all environment variables of a function, in bytes
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CRASH_TYPES = {"Runtime.ExitError", "Runtime.Unknown", "Runtime.OutOfMemory"}


class AwsBackend(FunctionBackend):
    """Lambda functions named ``function_prefix + spec.name`` in ``region``. ``store`` is
    the store URL the handlers use (``s3://bucket/prefix``); the code zip goes to
    ``code_bucket`` (default: the store's bucket) unless ``image_uri`` names a container
    image. ``role_arn`` is the execution role (env ``MOEFLEET_AWS_ROLE_ARN``).
    ``endpoint_url`` points boto3 at another endpoint (moto; default: boto3's own choice,
    e.g. ``AWS_ENDPOINT_URL``). ``invoker``: see the module docstring (env
    ``MOEFLEET_AWS_INVOKER``). ``session`` is a ready ``boto3.Session`` (credentials);
    ``layers`` are layer ARNs for zip functions."""

    name = "aws"

    def __init__(
        self,
        platform: PlatformSpec | str = "aws-lambda",
        *,
        store: str | ObjectStore | None = None,
        region: str = "us-east-1",
        endpoint_url: str | None = None,
        role_arn: str | None = None,
        runtime: str = "python3.11",
        invoker: Literal["lambda", "in-process"] | None = None,
        max_retries: int = 2,
        retry_backoff_s: float = 0.05,
        function_prefix: str = "moefleet-",
        code_bucket: str | None = None,
        image_uri: str | None = None,
        layers: tuple[str, ...] | list[str] = (),
        session: Any | None = None,
        reserve_concurrency: bool = True,
        store_retries: int = 3,
        **_: Any,  # options meant for other backends (e.g. ``workers``) are ignored
    ) -> None:
        import boto3

        self.platform = load_platform(platform) if isinstance(platform, str) else platform
        self._limit = payload_limit(self.platform)
        self.region, self.runtime, self.prefix = region, runtime, function_prefix
        self.max_retries, self.retry_backoff_s = max_retries, retry_backoff_s
        self.role_arn = role_arn or os.environ.get("MOEFLEET_AWS_ROLE_ARN")
        self.image_uri = image_uri or os.environ.get("MOEFLEET_AWS_IMAGE_URI")
        self.layers, self.reserve_concurrency = list(layers), reserve_concurrency
        self.store_url = None if store is None else str(store if isinstance(store, str)
                                                        else store.url)
        self.code_bucket = code_bucket or os.environ.get("MOEFLEET_AWS_CODE_BUCKET") or (
            self.store_url[5:].split("/")[0].split("?")[0]
            if self.store_url and self.store_url.startswith("s3://") else None)
        self.store_retries = store_retries
        chosen = invoker or os.environ.get("MOEFLEET_AWS_INVOKER") or "lambda"
        if chosen not in ("lambda", "in-process"):
            raise MoefleetError(f"unknown invoker {chosen!r}",
                                "use 'lambda' or 'in-process' (invoker= or "
                                "MOEFLEET_AWS_INVOKER)")
        if chosen == "in-process" and self.image_uri:
            raise MoefleetError("the in-process invoker runs the zip, not a container image",
                                "use invoker='lambda' with image_uri, or drop image_uri")
        limits = self.platform.limits
        session = session or boto3.Session(region_name=region)
        self._api = LambdaApi(session, region, endpoint_url,
                              max_retries=max_retries, retry_backoff_s=retry_backoff_s,
                              read_timeout_s=float((limits and limits.timeout_s) or 900) + 60)
        self._lock = threading.Lock()
        self._closed = False
        self._functions: dict[str, FunctionSpec] = {}
        self._deployed: set[str] = set()
        self._records: list[InvocationRecord] = []
        self._code: dict[str, str] | None = None
        self._counters = {"retries": 0, "timeouts": 0, "cold_starts": 0, "crashes": 0}
        self._sandbox: Any = None
        if chosen == "in-process":
            from moefleet.runtime.aws_inprocess import InProcessInvoker

            # Lambda gives an environment its role's credentials; here: the caller's. And
            # the endpoint this backend talks to, if not AWS's: a store URL without
            # ?endpoint= (e.g. with AWS_ENDPOINT_URL set) must reach the same S3 there.
            creds = session.get_credentials()
            frozen = creds.get_frozen_credentials() if creds is not None else None
            env = {"AWS_ACCESS_KEY_ID": frozen.access_key,
                   "AWS_SECRET_ACCESS_KEY": frozen.secret_key,
                   **({"AWS_SESSION_TOKEN": frozen.token} if frozen.token else {}),
                   } if frozen is not None else {}
            endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
            if endpoint:
                env["AWS_ENDPOINT_URL"] = endpoint
            self._sandbox = InProcessInvoker(self._api.lambda_, self._api.s3, region, env)
            from moefleet.runtime.nested import serve_nested

            self._sandbox.on_nested = lambda header, body: serve_nested(self, header, body)

    # -- helpers ---------------------------------------------------------------------------
    def function_name(self, name: str) -> str:
        """The Lambda function name of moefleet function ``name``."""
        return self.prefix + name

    def _check_open(self) -> None:
        if self._closed:
            raise BackendClosedError("the aws backend was torn down", "create a new one")

    def _code_args(self) -> dict[str, str]:
        if self.image_uri:
            return {"ImageUri": self.image_uri}
        if not self.code_bucket:
            raise MoefleetError("the aws backend needs a bucket for the code zip",
                                "pass store='s3://bucket/prefix' or code_bucket=...")
        with self._lock:  # once per backend: every function shares the zip
            if self._code is None:
                self._code = self._api.upload_zip(self.code_bucket, build_lambda_zip())
            return dict(self._code)

    # -- FunctionBackend -----------------------------------------------------------------------
    @property
    def max_inline_bytes(self) -> int:
        """What a packet may weigh so that its base64 JSON event/result fits the limit."""
        return base64_inline_bytes(self._limit)

    def deploy(self, spec: FunctionSpec) -> FunctionSpec:
        self._check_open()
        spec = validate_spec(self.platform, spec)
        fn = self.function_name(spec.name)
        if not _NAME.match(fn):
            raise InvalidFunctionSpecError(
                f"{spec.name}: Lambda function name {fn!r} must be 1-64 letters, digits, "
                "'-' or '_'", "use shorter names without '.' (or a shorter function_prefix)")
        if not self.role_arn:
            raise MoefleetError("the aws backend needs an execution role to create functions",
                                "pass role_arn=... or set MOEFLEET_AWS_ROLE_ARN")
        config = {"function": spec.name, "memory_mb": spec.memory_mb, "vcpus": spec.vcpus,
                  "handler": {"factory": spec.handler.factory, "config": spec.handler.config},
                  "store": {"url": self.store_url} if self.store_url else None,
                  "store_retries": self.store_retries, "max_inline_bytes": self.max_inline_bytes,
                  "deploy_id": uuid.uuid4().hex}  # a config change: fresh environments
        env = {CONFIG_VAR: json.dumps(config, separators=(",", ":"))}
        if sum(len(k) + len(v) for k, v in env.items()) > _ENV_LIMIT:
            raise InvalidFunctionSpecError(
                f"{spec.name}: the handler config is over Lambda's 4 KB environment limit",
                "keep handler configs small: name weights by key, never inline them")
        code = self._code_args()
        settings: dict[str, Any] = {
            "Role": self.role_arn, "MemorySize": spec.memory_mb,
            "Timeout": max(1, math.ceil(spec.timeout_s)), "Environment": {"Variables": env},
            "Description": f"moefleet {spec.kind} function {spec.name}"}
        if not self.image_uri:
            settings.update(Runtime=self.runtime, Handler=HANDLER, Layers=self.layers)
        self._api.put_function(fn, code, settings, {"moefleet": spec.kind})
        with self._lock:
            self._deployed.add(fn)
            self._functions[spec.name] = spec
        self._reserve(spec)
        if self._sandbox is not None:
            self._sandbox.register(fn, code.get("S3Bucket", ""), code.get("S3Key", ""),
                                   spec.replicas * spec.concurrency, spec.keep_alive_s)
        return spec

    def _reserve(self, spec: FunctionSpec) -> None:
        if self.reserve_concurrency:
            fn, n = self.function_name(spec.name), spec.replicas * spec.concurrency
            problem = self._api.reserve(fn, n)
            if problem:  # a cap, not a must: Lambda still runs the function without it
                log.warning("%s: reserved concurrency %d not set: %s", fn, n, problem)

    def functions(self) -> dict[str, FunctionSpec]:
        with self._lock:
            return dict(self._functions)

    def scale(self, name: str, *, replicas: int | None = None,
              concurrency: int | None = None) -> FunctionSpec:
        self._check_open()
        old = self.spec(name)
        spec = validate_spec(self.platform, replace(
            old, replicas=old.replicas if replicas is None else replicas,
            concurrency=old.concurrency if concurrency is None else concurrency))
        self._reserve(spec)
        with self._lock:
            self._functions[name] = spec
        if self._sandbox is not None:
            self._sandbox.set_cap(self.function_name(name), spec.replicas * spec.concurrency)
        return spec

    def records(self) -> list[InvocationRecord]:
        with self._lock:
            return list(self._records)

    def stats(self) -> dict[str, int]:
        """Counters: retries, timeouts, cold starts, crashes (attempts lost to them)."""
        with self._lock:
            return dict(self._counters)

    def invoke(self, name: str, payload: bytes, *, request_id: str | None = None) -> InvokeResult:
        self._check_open()
        spec = self.spec(name)
        fn = self.function_name(name)
        event = encode_event(payload, request_id)
        check_payload(name, len(event), self._limit, "request")

        def failed(err: Retry) -> None:
            with self._lock:
                self._counters["crashes"] += int(err.crashed)
            self._check_open()

        def gave_up(last: Retry | None) -> FunctionError:
            assert last is not None
            if last.crashed:
                return FunctionCrashedError(
                    f"{name}: Lambda function {fn} crashed during {self.max_retries + 1} "
                    f"attempts ({last})",
                    "check the handler for hard crashes (os._exit, out of memory)")
            return ThrottledError(f"{name}: Lambda function {fn} was not invoked after "
                                  f"{self.max_retries + 1} attempts: {last}",
                                  "raise the account's concurrency, or retry later")

        return call_with_retries(
            lambda: self._attempt(name, fn, event, spec, payload, request_id), Retry,
            max_retries=self.max_retries, backoff_s=self.retry_backoff_s,
            on_retry=self._count_retry, on_failure=failed, exhausted=gave_up)

    def _count_retry(self) -> None:
        with self._lock:
            self._counters["retries"] += 1

    def _attempt(self, name: str, fn: str, event: bytes, spec: FunctionSpec, payload: bytes,
                 request_id: str | None) -> InvokeResult:
        """One attempt; a crashed or timed-out one is billed (see the module docstring)."""
        start = time.time()
        try:
            return self._result(name, spec, payload, request_id, self._send(name, fn, event, spec))
        except (Retry, InvocationTimeoutError) as err:
            if not isinstance(err, Retry) or err.crashed:
                lambda_timeout_s = max(1, math.ceil(spec.timeout_s))  # whole seconds
                end = time.time() if isinstance(err, Retry) else start + lambda_timeout_s
                with self._lock:
                    self._records.append(failed_record(spec, start, end, request_id, len(payload)))
            raise

    def worker_pids(self) -> list[int]:  # in-process invoker: environments now invoking
        return self._sandbox.busy_pids() if self._sandbox is not None else []

    def _send(self, name: str, fn: str, event: bytes, spec: FunctionSpec) -> dict[str, Any]:
        """One attempt: a boto3-shaped ``invoke`` response with ``Payload`` as bytes."""
        if self._sandbox is not None:
            response: dict[str, Any] = self._sandbox.invoke(fn, event, spec.timeout_s + 60.0)
            return response
        return self._api.invoke(name, fn, event)

    def _result(self, name: str, spec: FunctionSpec, payload: bytes, request_id: str | None,
                response: dict[str, Any]) -> InvokeResult:
        body: bytes = response["Payload"]
        if response.get("FunctionError"):
            raise self._failure(name, spec, body)
        check_payload(name, len(body), self._limit, "response")
        try:
            reply = json.loads(body)
            out = base64.b64decode(reply["payload_b64"], validate=True)
        except (ValueError, KeyError, TypeError) as err:
            raise FunctionError(f"{name}: {self.function_name(name)} answered something other "
                                f"than a moefleet result ({err})",
                                "redeploy: the function runs other code") from err
        report = parse_report(response.get("LogResult"))
        init_s = float(reply["init_s"]) + report.get("Init Duration", 0.0) / 1000
        start = float(reply["start"])
        run_s = max(0.0, float(reply["end"]) - start)
        if "Duration" in report:  # the platform's measure of the whole handler call
            run_s = max(run_s, report["Duration"] / 1000 - float(reply["init_s"]))
        record = InvocationRecord(
            function=name, kind=spec.kind, memory_mb=spec.memory_mb, start_s=start,
            end_s=start + run_s, layer=spec.layer, expert=spec.expert, request_id=request_id,
            vcpus=spec.vcpus, gpu_share=spec.gpu_share, init_s=init_s, cold=bool(reply["cold"]),
            bytes_in=len(payload), bytes_out=len(out), storage_puts=int(reply["puts"]),
            storage_gets=int(reply["gets"]))
        with self._lock:
            self._records.append(record)
            self._counters["cold_starts"] += int(record.cold)
        return InvokeResult(out, record)

    def _failure(self, name: str, spec: FunctionSpec, body: bytes) -> Exception:
        etype, message = decode_error(body)
        if etype in _CRASH_TYPES:
            return Retry(f"{etype}: {message}", crashed=True)
        if etype == "Sandbox.Timedout" or "Task timed out" in message:
            with self._lock:
                self._counters["timeouts"] += 1
            return InvocationTimeoutError(
                f"{name}: invocation ran past timeout_s={spec.timeout_s:g} s (Lambda Timeout "
                f"{max(1, math.ceil(spec.timeout_s))} s); its environment was stopped",
                "raise timeout_s or send less work per call")
        if etype == "Function.ResponseSizeTooLarge":
            return PayloadTooLargeError(f"{name}: response payload too large: {message}",
                                        "return less per call, or use the object store")
        info = json_object(message) if etype == ERROR_TYPE else None
        if info is not None and {"phase", "type", "message"} <= info.keys():
            return HandlerError(f"{name}: {info['phase']} failed: {info['type']}: "
                                f"{info['message']}", info.get("hint") or "see the handler",
                                remote_type=info["type"], phase=info["phase"])
        phase = "init" if etype.startswith(("Runtime.ImportModule", "Runtime.Init")) else "run"
        return HandlerError(f"{name}: {phase} failed: {etype}: {message}",
                            "see the function's CloudWatch logs", remote_type=etype, phase=phase)

    def teardown(self) -> None:
        """Delete every function this backend deployed; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            deployed, self._deployed = sorted(self._deployed), set()
        if self._sandbox is not None:
            self._sandbox.close()
        left = [f"{fn} ({problem})" for fn in deployed if (problem := self._api.delete(fn))]
        if left:  # say so rather than fail: the caller is usually cleaning up after itself
            log.warning("aws backend: could not delete Lambda functions: %s", "; ".join(left))
