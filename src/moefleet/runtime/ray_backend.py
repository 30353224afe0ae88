"""The ``ray`` backend: one Ray Serve deployment (an application) per function.

What is **real**: each function is a Serve application of one deployment whose replicas
are its instances (``num_replicas`` = ``replicas``, ``max_ongoing_requests`` =
``concurrency``), called through a ``DeploymentHandle`` with bytes in and bytes out; each
replica is its own process, so a cold start really builds the instance and loads its
weights from the object store (``init_s``); crashes (the replica process dies), timeouts
(the caller kills the replica, Serve starts a fresh one) and retries are real; object-store
requests are counted per invocation. On a cluster (``address``), replicas are placed by
Ray with ``num_cpus`` = the function's vCPUs and ``memory`` = its memory_mb.

What is **emulated** (a local Ray node standing in for a FaaS fleet, as in
:mod:`moefleet.runtime.local`):

- CPUs: Ray's CPU resource is a logical reservation. A local node started by this backend
  advertises ``num_cpus`` logical CPUs (default ``CPU_OVERSUBSCRIPTION`` per core) so a
  fleet of small instances fits one machine; a replica reserves its vCPUs by the
  platform's rule, capped at the largest node's CPUs, and the OS time-shares the cores.
  Inside a replica, torch threads = round(vCPUs), at least 1 and at most the machine's
  cores (a 0.07-vCPU instance runs on a whole thread);
- memory_mb is reserved on a cluster only; locally it is checked against the weights by
  the handlers (a fleet's memory would not fit one machine), not enforced;
- the replica process start and ``import torch`` are paid when Serve starts the replica
  (deploy, or after a crash/timeout), not billed: ``init_s`` is instance construction +
  weight download + load, on the first request (the replica starts empty);
- keep-alive: an instance idle for ``keep_alive_s`` drops its handler (its replica stays
  up): the next call is cold. With ``autoscaling=True``, Serve's autoscaler also scales
  replicas between 0 and ``replicas`` (downscale after ``keep_alive_s``).

Networking: a local node started here binds the loopback interface only (Ray 2.x binds
the node's external IP unless told this is not a cluster; see :func:`start_local_ray`); no
HTTP proxy and no dashboard are started (handles only).
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Any

from moefleet.platform import InvocationRecord, ObjectStore, PlatformSpec, load_platform
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
    FunctionError,
    UnknownFunctionError,
)
from moefleet.runtime.ray_call import CallOptions, Lost, TimedOut, attempt
from moefleet.runtime.ray_replica import FunctionReplica
from moefleet.runtime.replies import crashed_error, failed_record, timeout_error
from moefleet.runtime.retry import call_with_retries

CPU_OVERSUBSCRIPTION = 16  # logical CPUs per core of a local node (see module docstring)
# Ray decides on import whether it runs a cluster; "0" keeps a local node on loopback.
_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


class _Lost(Exception):
    """The replica died under an in-flight call (retryable)."""


@dataclass
class _Function:
    spec: FunctionSpec
    app: str
    generation: int
    handle: Any  # DeploymentHandle of the function's application


def start_local_ray(num_cpus: int | None = None) -> bool:
    """Start a local Ray node on loopback if Ray is not initialised; True if started here.

    Loopback only works when ``ray`` was not imported before (Ray reads the switch at
    import); otherwise the node binds where Ray's defaults say. The switch is an
    environment variable of this process (inherited by the node's processes): a later
    connection to a remote cluster from the same process would advertise loopback, so
    use a fresh process for that.
    """
    if "ray" not in sys.modules:
        os.environ.setdefault(_LOOPBACK_ENV, "0")
    import ray

    if ray.is_initialized():
        return False
    cores = os.cpu_count() or 1
    ray.init(num_cpus=num_cpus or cores * CPU_OVERSUBSCRIPTION, include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    return True


def _connect(address: str) -> bool:
    """Join the cluster at ``address`` unless Ray is initialised; True if joined here."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(address=address, log_to_driver=False, configure_logging=False)
    return True


class RayBackend(FunctionBackend):
    """Ray Serve backend. ``store`` is where handlers read weights and exchange tensors
    (path, URL or ObjectStore with a ``url``; every replica opens it itself); ``address``
    a Ray cluster (``ray://host:10001`` or ``auto``; default ``$RAY_ADDRESS``, else a
    local node with ``num_cpus`` logical CPUs). A crashed call is retried ``max_retries``
    times after ``retry_backoff_s`` x 1, 2, 4 ...; a call waits at most its timeout +
    ``init_timeout_s`` + ``admission_timeout_s`` in all. ``autoscaling`` lets Serve scale
    each function between 0 and ``replicas`` replicas instead of keeping ``replicas`` up.
    ``wait_ready`` makes ``deploy`` wait until the replicas run (default: replicas start in
    the background, in parallel, and the first calls queue until they are up)."""

    name = "ray"

    def __init__(
        self,
        platform: PlatformSpec | str = "aws-lambda",
        *,
        store: str | ObjectStore | None = None,
        address: str | None = None,
        max_retries: int = 2,
        retry_backoff_s: float = 0.05,
        num_cpus: int | None = None,
        autoscaling: bool = False,
        wait_ready: bool = False,
        init_timeout_s: float = 120.0,
        admission_timeout_s: float = 120.0,
        store_retries: int = 3,
        **_: Any,  # options meant for other backends (e.g. ``workers``) are ignored
    ) -> None:
        self.platform = load_platform(platform) if isinstance(platform, str) else platform
        self._limit = payload_limit(self.platform)
        self.max_retries, self.retry_backoff_s = max_retries, retry_backoff_s
        self.autoscaling, self.wait_ready = autoscaling, wait_ready
        self.init_timeout_s, self.admission_timeout_s = init_timeout_s, admission_timeout_s
        self.cores = os.cpu_count() or 1
        self._store: dict[str, Any] | None = None
        if store is not None:
            self._store = {"url": str(store if isinstance(store, str) else store.url)}
        self._store_retries = store_retries
        address = address or os.environ.get("RAY_ADDRESS") or None
        # Decided before ``import ray``: a local node's binding is fixed at import time.
        self._owns_ray = start_local_ray(num_cpus) if address is None else _connect(address)
        self._cluster = address is not None
        import ray
        from ray import serve

        if self._owns_ray:  # one "connecting to Serve" INFO line per deploy is noise
            logging.getLogger("ray.serve").setLevel(logging.WARNING)

        # No HTTP proxy: functions are reached through handles only (nothing listens).
        serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
        self._node_cpus = max((n["Resources"].get("CPU", 0.0) for n in ray.nodes()
                               if n.get("Alive")), default=float(self.cores))
        # Several backends may share one Serve instance: app names carry this backend's id.
        self._prefix = f"moefleet-{uuid.uuid4().hex[:8]}-"
        self._lock = threading.Lock()  # guards the tables below
        self._serve_lock = threading.Lock()  # one Serve deploy/delete at a time
        self._closed = False
        self._functions: dict[str, _Function] = {}
        self._records: list[InvocationRecord] = []
        self._pids: set[int] = set()
        self._generations = itertools.count(1)
        self._counters = {"retries": 0, "timeouts": 0, "cold_starts": 0}

    # -- Serve applications -------------------------------------------------------------
    def _options(self, spec: FunctionSpec) -> dict[str, Any]:
        """Deployment options for ``spec`` (see the module docstring for the emulation)."""
        vcpus = spec.vcpus or 1.0
        actor: dict[str, Any] = {"num_cpus": min(vcpus, self._node_cpus)}
        if self._cluster:
            actor["memory"] = spec.memory_mb * 1024 * 1024
        options: dict[str, Any] = {
            "ray_actor_options": actor, "max_ongoing_requests": spec.concurrency,
            # A dead replica is noticed by its router at once; the controller replaces it
            # after the next health check, so keep that period short.
            "health_check_period_s": 1.0, "graceful_shutdown_wait_loop_s": 0.1,
            "graceful_shutdown_timeout_s": min(spec.timeout_s, 30.0),
        }
        if self.autoscaling:
            options["autoscaling_config"] = {
                "min_replicas": 0, "initial_replicas": 0, "max_replicas": spec.replicas,
                "target_ongoing_requests": spec.concurrency, "upscale_delay_s": 0.0,
                "downscale_delay_s": spec.keep_alive_s, "downscale_to_zero_delay_s":
                spec.keep_alive_s}
        else:
            options["num_replicas"] = spec.replicas
        return options

    def _run_app(self, fn: _Function) -> Any:
        from ray import serve

        deployment = serve.deployment(name="fn", **self._options(fn.spec))(FunctionReplica)
        # Serve gives every serve.run a random code version, i.e. a rolling restart: a
        # version of our own keeps warm replicas on scale() (a lightweight update) and
        # restarts them on redeploy (a new generation). Without it: restarts always.
        if hasattr(deployment, "_version"):
            deployment._version = f"{fn.spec.name}-g{fn.generation}"
        app = deployment.bind(self._store, self._store_retries)
        target = serve.RunTarget(target=app, name=fn.app, route_prefix=None)
        with self._serve_lock:
            self._check_open()
            (handle,) = serve.run_many([target], wait_for_applications_running=self.wait_ready)
        return handle

    def deploy(self, spec: FunctionSpec) -> FunctionSpec:
        self._check_open()
        spec = validate_spec(self.platform, spec)
        fn = _Function(spec, self._prefix + spec.name, next(self._generations), None)
        fn.handle = self._run_app(fn)
        with self._lock:
            self._functions[spec.name] = fn
        return spec

    def functions(self) -> dict[str, FunctionSpec]:
        with self._lock:
            return {name: fn.spec for name, fn in self._functions.items()}

    def _function(self, name: str) -> _Function:
        with self._lock:
            if name not in self._functions:
                raise UnknownFunctionError(
                    f"no function named {name!r} is deployed on the ray backend",
                    f"deployed: {', '.join(sorted(self._functions)) or 'none'}")
            return self._functions[name]

    def scale(self, name: str, *, replicas: int | None = None,
              concurrency: int | None = None) -> FunctionSpec:
        self._check_open()
        old = self._function(name)
        spec = validate_spec(self.platform, replace(
            old.spec, replicas=old.spec.replicas if replicas is None else replicas,
            concurrency=old.spec.concurrency if concurrency is None else concurrency))
        fn = replace(old, spec=spec)  # same generation: warm instances stay warm
        fn.handle = self._run_app(fn)
        with self._lock:
            self._functions[name] = fn
        return spec

    def records(self) -> list[InvocationRecord]:
        with self._lock:
            return list(self._records)

    def stats(self) -> dict[str, Any]:
        """Counters: retries, timeouts, cold starts, deployed functions."""
        with self._lock:
            return {**self._counters, "functions": len(self._functions)}

    # -- invocations ----------------------------------------------------------------------
    def invoke(self, name: str, payload: bytes, *, request_id: str | None = None) -> InvokeResult:
        self._check_open()
        check_payload(name, len(payload), self._limit, "request")
        return call_with_retries(
            lambda: self._attempt(self._function(name), payload, request_id), _Lost,
            max_retries=self.max_retries, backoff_s=self.retry_backoff_s,
            on_retry=self._count_retry, on_failure=lambda _: self._check_open(),
            exhausted=lambda _: crashed_error(name, self.max_retries + 1, "replica process"))

    def _count_retry(self) -> None:
        with self._lock:
            self._counters["retries"] += 1

    def _options_of_calls(self) -> CallOptions:
        return CallOptions(self.cores, self.init_timeout_s, self.admission_timeout_s,
                           self.max_inline_bytes, self._limit, self.max_retries,
                           self.retry_backoff_s)

    def _nested(self) -> dict[str, Any]:
        """What a main function needs to call the others itself (see ray_call)."""
        with self._lock:
            table = {name: {"app": f.app, "generation": f.generation,
                            "spec": f.spec.to_dict()} for name, f in self._functions.items()}
        return {"functions": table, "options": asdict(self._options_of_calls())}

    def _attempt(self, fn: _Function, payload: bytes, request_id: str | None) -> InvokeResult:
        spec = fn.spec
        nested = self._nested() if spec.kind == "main" else None
        start = time.time()
        try:
            result, inner, pid = attempt(fn.handle, spec, fn.generation, payload, request_id,
                                         self._options_of_calls(), nested)
        except TimedOut:
            self._timed_out(spec, start, request_id, len(payload))
            raise  # unreachable: _timed_out raises
        except Lost:
            # The replica died under the call: billed up to now (conservative), retried.
            self._bill_failed(failed_record(spec, start, time.time(), request_id, len(payload)))
            raise _Lost() from None
        except FunctionError:
            if self._closed:
                raise BackendClosedError("the ray backend was torn down",
                                         "create a new one") from None
            raise
        with self._lock:
            self._records.extend(inner)  # nested calls of a main function, metered here
            self._records.append(result.record)
            self._counters["cold_starts"] += int(result.record.cold)
            self._counters["cold_starts"] += sum(r.cold for r in inner)
            if pid is not None:
                self._pids.add(pid)
        return result

    def worker_pids(self) -> list[int]:
        """Replica processes seen answering calls that are still replicas (local node:
        what a crash can kill). A pid whose process is gone, or now runs something else
        (pids are reused), is dropped: only a live Serve replica of one of this backend's
        applications (its title names the app) is ever named."""
        mine = f"ServeReplica:{self._prefix}".encode()
        with self._lock:
            for pid in list(self._pids):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        alive = mine in f.read()
                except OSError:
                    alive = False
                if not alive:
                    self._pids.discard(pid)
            return sorted(self._pids)

    def _bill_failed(self, record: InvocationRecord) -> None:
        with self._lock:
            self._records.append(record)

    def _timed_out(self, spec: FunctionSpec, start: float, request_id: str | None,
                   nbytes: int) -> None:
        """Billed for the whole timeout, as a FaaS platform bills a timed-out call."""
        with self._lock:
            self._counters["timeouts"] += 1
            self._records.append(failed_record(spec, start, start + spec.timeout_s,
                                               request_id, nbytes))
        raise timeout_error(spec.name, spec.timeout_s)

    # -- lifecycle ----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise BackendClosedError("the ray backend was torn down", "create a new one")

    def teardown(self) -> None:
        """Delete this backend's applications; shut Ray down only if it started it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            apps = [fn.app for fn in self._functions.values()]
        import ray
        from ray import serve

        with self._serve_lock:
            if self._owns_ray:
                serve.shutdown()
                ray.shutdown()
                return
            for app in apps:  # delete all at once, then wait for all of them
                serve.delete(app, _blocking=False)
            deadline = time.monotonic() + 60.0
            while apps and time.monotonic() < deadline:
                live = serve.status().applications
                apps = [a for a in apps if a in live]
                if apps:
                    time.sleep(0.1)
