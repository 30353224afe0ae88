"""The ``aws`` backend's in-process invoker: Lambda's invoke, emulated on this machine.

moto serves Lambda's control plane (create/update/list/delete) but needs Docker to run a
function, so tests (and anyone without AWS) use ``invoker="in-process"``: everything up to
the invoke call is real (the zip is uploaded to S3, functions are created and configured
through the Lambda API, all over HTTP), and this module stands in for Lambda's data plane:

- a new execution environment reads the function's configuration back from the Lambda
  API (``MemorySize``, ``Timeout``, ``Environment``, ``CodeSha256``), downloads the code
  zip from S3, checks its SHA-256 against ``CodeSha256``, unpacks it and runs the
  *same generated entry point* (``lambda_function.lambda_handler``) on the real event JSON,
  in a process forked from a zygote (:mod:`moefleet.runtime.aws_sandbox`);
- an environment serves one invocation at a time; a function has at most ``cap`` of them
  (its reserved concurrency); one idle for longer than the function's keep-alive is
  stopped when the function is next invoked (Lambda reclaims idle ones on its own clock);
- the answer has the shape of boto3's ``invoke`` response: ``FunctionError`` "Unhandled"
  with Lambda's error objects for a handler exception, ``Sandbox.Timedout`` (the process
  is killed after the configured ``Timeout``) and ``Runtime.ExitError`` (the process died),
  and a ``LogResult`` whose ``REPORT`` line carries the measured ``Duration`` and, on a
  cold start, ``Init Duration`` (the entry module's import time).

Differences from Lambda, on purpose: callers beyond ``cap`` wait for a free environment
(Lambda answers 429, which the backend retries); environments share this machine's CPUs;
credentials are the caller's (standing in for the execution role's).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moefleet.runtime.aws_sandbox import recv_frame, send_frame
from moefleet.runtime.errors import BackendClosedError, FunctionError, ThrottledError

# What a Lambda layer or container image would provide, imported once by the zygote.
PRELOAD = ["torch", "numpy", "safetensors.torch", "boto3", "transformers",
           *(f"transformers.models.{f}.modeling_{f}" for f in ("mixtral", "qwen2_moe", "olmoe",
                                                               "deepseek_v2"))]
# Caller variables an environment also sees (a Lambda image sets PATH, LANG, ... itself).
_PASS = ("PATH", "HOME", "LANG", "TMPDIR", "HF_HUB_OFFLINE", "TRANSFORMERS_VERBOSITY",
         "MOEFLEET_CACHE_DIR")
_INIT_LIMIT_S = 120.0  # bound on one environment's INIT (import of the entry module)


class _Zygote:
    """The fork server process; started on first use, stopped by :meth:`close`."""

    def __init__(self, startup_timeout_s: float) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        script = Path(__file__).with_name("aws_sandbox.py")
        self.proc = subprocess.Popen(
            [sys.executable, "-I", str(script), str(theirs.fileno()), json.dumps(PRELOAD)],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self.control = ours
        self.lock = threading.Lock()
        ours.settimeout(startup_timeout_s)
        try:
            if not ours.recv(4096):
                raise OSError("the zygote exited during startup")
        except OSError as err:
            self.close()
            raise FunctionError(f"the in-process Lambda emulator did not start: {err}",
                                "see the zygote's output above (aws_sandbox.py)") from err
        ours.settimeout(30.0)

    def fork(self, request: dict[str, Any]) -> tuple[int, socket.socket]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with self.lock:
                socket.send_fds(self.control, [json.dumps(request).encode()], [theirs.fileno()])
                reply = self.control.recv(4096)
        finally:
            theirs.close()
        if not reply:
            ours.close()
            raise FunctionError("the in-process Lambda emulator's zygote died",
                                "see its output above; create a new backend")
        return int(json.loads(reply)["pid"]), ours

    def close(self) -> None:
        self.control.close()  # environments see their own sockets close, not this one
        self.proc.kill()  # it holds no state; killing skips torch's slow interpreter exit
        self.proc.wait(timeout=30)


# One zygote per process, shared by every in-process invoker (its preload is the same for
# all) and stopped when the last of them closes.
_shared_lock = threading.Lock()
_shared: _Zygote | None = None
_shared_users = 0


def _acquire_zygote(startup_timeout_s: float) -> _Zygote:
    global _shared, _shared_users
    with _shared_lock:
        if _shared is None or _shared.proc.poll() is not None:
            _shared = _Zygote(startup_timeout_s)
        _shared_users += 1
        return _shared


def _release_zygote() -> None:
    global _shared, _shared_users
    with _shared_lock:
        _shared_users -= 1
        if _shared_users == 0 and _shared is not None:
            _shared.close()
            _shared = None


@dataclass(eq=False)
class _Env:
    pid: int
    sock: socket.socket
    init_ms: float
    init_error: dict[str, str] | None = None  # the entry module failed to import
    busy: bool = True
    fresh: bool = True  # no invocation yet: its first REPORT carries Init Duration
    last_used: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class _Function:
    """One deployed version; ``deploy`` again replaces the object (so identity = version)."""

    name: str
    code_bucket: str
    code_key: str
    cap: int
    keep_alive_s: float
    config: dict[str, Any] | None = None  # GetFunctionConfiguration, read once per version
    envs: list[_Env] = field(default_factory=list)
    starting: int = 0


def _kill(env: _Env) -> None:
    env.sock.close()
    with contextlib.suppress(ProcessLookupError):  # it already exited (crash, end of INIT)
        os.kill(env.pid, signal.SIGKILL)  # our own environment, by pid


def _error(error_type: str, message: str) -> dict[str, Any]:
    """A boto3-shaped invoke response for a failure Lambda itself reports."""
    body = json.dumps({"errorMessage": message, "errorType": error_type}).encode()
    return {"StatusCode": 200, "FunctionError": "Unhandled", "Payload": body}


class InProcessInvoker:
    """Emulated Lambda invoke (see the module docstring). Thread-safe."""

    def __init__(self, lambda_client: Any, s3_client: Any, region: str,
                 credentials: dict[str, str], *, startup_timeout_s: float = 300.0) -> None:
        self._lambda, self._s3, self.region = lambda_client, s3_client, region
        self._credentials = dict(credentials)  # what the execution role would provide
        self._tmp = tempfile.TemporaryDirectory(prefix="moefleet-lambda-")
        self._code_root = Path(self._tmp.name)
        self._startup_timeout_s = startup_timeout_s
        self._cond = threading.Condition()
        self._functions: dict[str, _Function] = {}
        self._zygote: _Zygote | None = None
        self._zygote_lock = threading.Lock()
        self._closed = False

    # -- control (called by the backend after the matching Lambda API call) -------------
    def register(self, function: str, code_bucket: str, code_key: str, cap: int,
                 keep_alive_s: float) -> None:
        """A new version of ``function``: its environments are replaced (cold again)."""
        with self._cond:
            old = self._functions.get(function)
            self._functions[function] = _Function(function, code_bucket, code_key, cap,
                                                  keep_alive_s)
            if old is not None:  # busy ones are stopped when their call returns
                self._stop([e for e in old.envs if not e.busy], old)
            self._cond.notify_all()

    def set_cap(self, function: str, cap: int) -> None:
        with self._cond:
            fn = self._functions[function]
            fn.cap = cap
            idle = [e for e in fn.envs if not e.busy]
            self._stop(idle[: max(0, len(fn.envs) - cap)], fn)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for fn in self._functions.values():
                self._stop(list(fn.envs), fn)
            self._functions.clear()
            self._cond.notify_all()
        with self._zygote_lock:
            zygote, self._zygote = self._zygote, None
        if zygote is not None:
            _release_zygote()
        self._tmp.cleanup()

    def _stop(self, envs: list[_Env], fn: _Function | None = None) -> None:
        for env in envs:
            if fn is not None and env in fn.envs:
                fn.envs.remove(env)
            _kill(env)

    def busy_pids(self) -> list[int]:
        """Environments in the middle of an invocation (what a crash can hit)."""
        with self._cond:
            return [e.pid for fn in self._functions.values() for e in fn.envs if e.busy]

    # -- invoke -------------------------------------------------------------------------
    def invoke(self, function: str, event: bytes, wait_s: float) -> dict[str, Any]:
        """One synchronous invoke; returns a boto3-shaped response (``Payload`` as bytes)."""
        request_id = str(uuid.uuid4())
        env, fn = self._admit(function, wait_s)
        assert fn.config is not None  # read by _admit before any environment exists
        timeout_s = float(fn.config["Timeout"])
        if env.init_error is not None:
            self._release(fn, env, keep=False)
            return _error(env.init_error["errorType"], env.init_error["errorMessage"])
        try:
            send_frame(env.sock, json.dumps({"request_id": request_id,
                                             "timeout_s": timeout_s}).encode())
            send_frame(env.sock, event)
            env.sock.settimeout(timeout_s)
            header = recv_frame(env.sock)
            body = recv_frame(env.sock) if header is not None else None
        except TimeoutError:
            self._release(fn, env, keep=False)
            return _error("Sandbox.Timedout", f"RequestId: {request_id} Error: Task timed out "
                          f"after {timeout_s:.2f} seconds")
        except OSError:
            header = body = None
        if header is None or body is None:
            self._release(fn, env, keep=False)
            return _error("Runtime.ExitError", f"RequestId: {request_id} Error: Runtime exited "
                          "without providing a reason")
        reply = json.loads(header)
        report = (f"REPORT RequestId: {request_id}\tDuration: {reply['duration_ms']:.2f} ms\t"
                  f"Billed Duration: {math.ceil(reply['duration_ms'])} ms\tMemory Size: "
                  f"{fn.config['MemorySize']} MB\tMax Memory Used: {reply['max_memory_mb']} MB")
        if env.fresh:
            report += f"\tInit Duration: {env.init_ms:.2f} ms"
        env.fresh = False
        self._release(fn, env, keep=True)
        out: dict[str, Any] = {"StatusCode": 200, "ExecutedVersion": "$LATEST", "Payload": body,
                               "LogResult": base64.b64encode(report.encode() + b"\n").decode()}
        if reply["function_error"]:
            out["FunctionError"] = reply["function_error"]
        return out

    def _admit(self, function: str, wait_s: float) -> tuple[_Env, _Function]:
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                if self._closed:
                    raise BackendClosedError("the aws backend was torn down", "create a new one")
                fn = self._functions.get(function)
                if fn is None:
                    raise FunctionError(f"Lambda function {function} is not deployed here",
                                        "deploy it first")
                now = time.monotonic()
                self._stop([e for e in fn.envs if not e.busy
                            and now - e.last_used > fn.keep_alive_s], fn)
                idle = [e for e in fn.envs if not e.busy]
                if idle:
                    env = max(idle, key=lambda e: e.last_used)
                    env.busy = True
                    return env, fn
                if len(fn.envs) + fn.starting < fn.cap:
                    fn.starting += 1
                    break
                if now >= deadline:
                    raise ThrottledError(
                        f"Lambda function {function}: all {fn.cap} environments stayed busy "
                        f"for {wait_s:g} s", "scale the function up or send fewer requests")
                self._cond.wait(min(0.5, deadline - now))
        try:
            env = self._start_env(function, fn)
        finally:
            with self._cond:
                fn.starting -= 1
                self._cond.notify_all()
        with self._cond:
            fn.envs.append(env)
        return env, fn

    def _start_env(self, function: str, fn: _Function) -> _Env:
        try:
            if fn.config is None:  # a new sandbox reads what the control plane stored
                fn.config = self._lambda.get_function_configuration(FunctionName=function)
            config = fn.config
            code_dir = self._code(fn, config["CodeSha256"])
        except Exception as err:  # botocore's errors: no new environment without them
            raise FunctionError(f"Lambda function {function}: cannot start an environment: "
                                f"{err}", "deploy the function again") from err
        env = {k: os.environ[k] for k in _PASS if k in os.environ}
        env.update(self._credentials)
        env.update(config.get("Environment", {}).get("Variables", {}))
        env.update(AWS_LAMBDA_FUNCTION_NAME=function, AWS_LAMBDA_FUNCTION_VERSION="$LATEST",
                   AWS_LAMBDA_FUNCTION_MEMORY_SIZE=str(config["MemorySize"]),
                   AWS_REGION=self.region, AWS_DEFAULT_REGION=self.region,
                   LAMBDA_TASK_ROOT=str(code_dir), AWS_CONFIG_FILE=os.devnull,
                   AWS_SHARED_CREDENTIALS_FILE=os.devnull)
        with self._zygote_lock:  # not self._cond: other calls go on while it starts
            if self._zygote is None and not self._closed:  # on the first cold start
                self._zygote = _acquire_zygote(self._startup_timeout_s)
            zygote = self._zygote
        if zygote is None:
            raise BackendClosedError("the aws backend was torn down", "create a new one")
        pid, sock = zygote.fork({"code_dir": str(code_dir), "env": env,
                                 "handler": config["Handler"]})
        sock.settimeout(_INIT_LIMIT_S)
        try:
            hello = recv_frame(sock)
        except OSError:
            hello = None
        init: dict[str, Any] = json.loads(hello) if hello else {"init_ms": 0.0, "init_error": {
            "errorType": "Runtime.ExitError", "errorMessage": "the runtime died during INIT"}}
        return _Env(pid, sock, float(init["init_ms"]), init["init_error"])

    def _code(self, fn: _Function, code_sha256: str) -> Path:
        """The function's unpacked zip, downloaded once per code hash."""
        digest = base64.b64decode(code_sha256).hex()
        target = self._code_root / digest
        if target.is_dir():
            return target
        data = self._s3.get_object(Bucket=fn.code_bucket, Key=fn.code_key)["Body"].read()
        if hashlib.sha256(data).hexdigest() != digest:
            raise FunctionError(
                f"s3://{fn.code_bucket}/{fn.code_key} does not match the function's "
                f"CodeSha256 {code_sha256}", "deploy the function again")
        tmp = Path(tempfile.mkdtemp(prefix=f".{digest}.", dir=self._code_root))
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            zf.extractall(tmp)
        try:
            tmp.rename(target)  # atomic: a half-unpacked tree is never used
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another thread unpacked it first
        return target

    def _release(self, fn: _Function, env: _Env, keep: bool) -> None:
        with self._cond:
            current = not self._closed and self._functions.get(fn.name) is fn
            if keep and current and len(fn.envs) <= fn.cap:
                env.busy = False
                env.last_used = time.monotonic()
            else:  # crashed, timed out, replaced by a new version, or scaled away
                self._stop([env], fn)
            self._cond.notify_all()
