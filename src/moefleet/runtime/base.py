"""``FunctionBackend``: where serverless functions are deployed and invoked.

One interface for every backend (``local`` worker processes today; ``ray`` and ``aws``
later). A backend owns *functions* described by :class:`FunctionSpec`; each function has up
to ``replicas`` instances, each instance accepts up to ``concurrency`` in-flight
invocations. The contract (checked by ``tests/contracts/test_function_backend.py``):

- ``deploy(spec)`` validates the spec against the backend's ``PlatformSpec`` (memory offered,
  vCPUs by the platform's rule, replicas/concurrency/timeout limits) and makes the function
  invokable; deploying a name again replaces it (like a new version: next call is cold).
- ``invoke(name, payload)`` takes and returns **bytes** (by convention a safetensors packet,
  see :mod:`moefleet.runtime.payload`; nothing is ever pickled). A request or response larger
  than the platform's sync payload limit raises :class:`PayloadTooLargeError`. The result
  carries the :class:`~moefleet.platform.InvocationRecord` of the call (cold/warm, handler
  start/end, INIT time, bytes in/out, object-store requests).
- A crashed instance fails only its in-flight calls; they are retried (bounded, with
  backoff) before :class:`FunctionCrashedError`. A handler past ``timeout_s`` raises
  :class:`InvocationTimeoutError`; an exception in the handler raises :class:`HandlerError`
  (not retried: it is deterministic). No call waits forever.
- ``records()`` lists one record per successful invocation, in completion order.
- ``teardown()`` stops every instance; it is idempotent; later calls raise
  :class:`BackendClosedError`.

Units: memory MB, time seconds, sizes bytes.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, Protocol

from moefleet.control import FunctionConfig
from moefleet.errors import MoefleetError, UnknownNameError
from moefleet.platform import InvocationRecord, PlatformSpec
from moefleet.runtime.errors import (
    InvalidFunctionSpecError,
    PayloadTooLargeError,
    UnknownFunctionError,
)

# main: a function that runs the model loop and invokes others (Remoe); backends give
# main functions their own instance slots so one waiting on its experts never starves them.
FunctionKind = Literal["segment", "expert", "aux", "main"]
_KINDS = ("segment", "expert", "aux", "main")

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HandlerRef:
    """What a function runs: ``factory`` is ``"package.module:callable"``, called once per
    instance (cold start) as ``factory(config, init_context) -> handler``. ``config`` must
    be JSON-able; it names weights by object-store key, never carries them."""

    factory: str
    config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        module, _, attr = self.factory.partition(":")
        if not module or not attr:
            raise InvalidFunctionSpecError(
                f"handler factory {self.factory!r} is not 'package.module:callable'",
                "e.g. 'moefleet.runtime.handlers:expert_handler'",
            )


@dataclass(frozen=True)
class FunctionSpec:
    """One function. ``vcpus=None`` means the platform's rule for ``memory_mb`` (filled in
    by ``deploy``). ``layer`` is the block (segment) or MoE layer (expert); ``experts`` are
    the expert indices an expert function holds. ``keep_alive_s`` is how long an idle
    instance stays warm; ``timeout_s`` bounds one invocation's handler time.
    ``gpu_share`` is the fraction of one GPU each instance holds (0 = CPU only); the
    platform must offer it. No backend here has a GPU: a share is EMULATED - the
    handler runs on the CPU as it would without one (no speed-up is applied, so a call
    never looks faster than on the GPU slice) and is billed at the slice's price."""

    name: str
    kind: FunctionKind
    handler: HandlerRef
    memory_mb: int
    vcpus: float | None = None
    replicas: int = 1
    concurrency: int = 1
    keep_alive_s: float = 600.0
    timeout_s: float = 60.0
    layer: int | None = None
    experts: tuple[int, ...] = ()
    gpu_share: float = 0.0

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise InvalidFunctionSpecError(
                f"function name {self.name!r} is empty or has characters other than "
                "letters, digits, '-', '_', '.'",
                "use names like 'seg-0' or 'exp-1-3'",
            )
        if self.kind not in _KINDS:
            raise InvalidFunctionSpecError(
                f"{self.name}: kind {self.kind!r} is not one of {_KINDS}", "fix 'kind'"
            )
        for what in ("replicas", "concurrency", "memory_mb"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidFunctionSpecError(
                    f"{self.name}: {what} must be a whole number >= 1, got {value!r}",
                    f"set {what} to 1 or more",
                )
        share = self.gpu_share
        if isinstance(share, bool) or not isinstance(share, int | float) or not (
                math.isfinite(share) and 0.0 <= share <= 1.0):
            raise InvalidFunctionSpecError(
                f"{self.name}: gpu_share must be a fraction of one GPU in [0, 1], got {share!r}",
                "set gpu_share to 0 (CPU only) or a share the platform offers")
        for what in ("keep_alive_s", "timeout_s"):
            value = getattr(self, what)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise InvalidFunctionSpecError(
                    f"{self.name}: {what} must be a positive number of seconds, got {value!r}",
                    f"set {what} > 0",
                )

    @property
    def expert(self) -> int | None:
        """The expert index for billing (only when the function holds exactly one)."""
        return self.experts[0] if len(self.experts) == 1 else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["experts"] = list(self.experts)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FunctionSpec:
        try:
            data = dict(d)
            data["handler"] = HandlerRef(**data["handler"])
            data["experts"] = tuple(int(i) for i in data.get("experts", ()))
            return cls(**data)
        except (KeyError, TypeError) as err:
            raise InvalidFunctionSpecError(
                f"not a function spec: {err}", "regenerate the deployment file"
            ) from err


@dataclass(frozen=True)
class InvokeResult:
    """What ``invoke`` returns: the handler's response bytes and the call's record."""

    payload: bytes
    record: InvocationRecord


class Invoker(Protocol):
    """What callers invoke functions through: a :class:`FunctionBackend`, or the nested
    invoker a function gets in its call context (``ctx.functions``). The one protocol
    remote experts, the segment runner and function handlers share."""

    def invoke(self, name: str, payload: bytes, *,
               request_id: str | None = None) -> InvokeResult: ...

    @property
    def max_inline_bytes(self) -> int: ...


def validate_spec(platform: PlatformSpec, spec: FunctionSpec) -> FunctionSpec:
    """``spec`` checked against ``platform``, with ``vcpus`` filled in from its rule."""
    try:
        platform.check_memory(spec.memory_mb)
        vcpus = platform.check_vcpus(spec.memory_mb, spec.vcpus)
        platform.check_gpu_share(spec.gpu_share)
    except MoefleetError as err:
        raise InvalidFunctionSpecError(f"{spec.name}: {err.message}", err.hint) from err
    limits = platform.limits
    if limits is not None:
        if spec.replicas > limits.max_replicas:
            raise InvalidFunctionSpecError(
                f"{spec.name}: replicas={spec.replicas} exceeds {platform.name}'s limit "
                f"{limits.max_replicas}",
                f"use at most {limits.max_replicas} replicas",
            )
        if spec.concurrency > limits.max_concurrency_per_instance:
            raise InvalidFunctionSpecError(
                f"{spec.name}: concurrency={spec.concurrency} exceeds {platform.name}'s "
                f"per-instance limit {limits.max_concurrency_per_instance}",
                f"use concurrency <= {limits.max_concurrency_per_instance}",
            )
        if limits.timeout_s is not None and spec.timeout_s > limits.timeout_s:
            raise InvalidFunctionSpecError(
                f"{spec.name}: timeout_s={spec.timeout_s:g} exceeds {platform.name}'s "
                f"limit {limits.timeout_s:g} s",
                f"use timeout_s <= {limits.timeout_s:g}",
            )
    return replace(spec, vcpus=vcpus)


def payload_limit(platform: PlatformSpec) -> int:
    """The synchronous payload limit in bytes (request and response each)."""
    if platform.limits is None:
        raise InvalidFunctionSpecError(
            f"platform '{platform.name}' has no payload limits (kind {platform.kind})",
            "function backends need a FaaS platform, e.g. aws-lambda",
        )
    return int(platform.limits.sync_payload_bytes)


def check_payload(name: str, nbytes: int, limit: int, direction: str = "request") -> None:
    """Raise :class:`PayloadTooLargeError` when ``nbytes`` exceeds ``limit``."""
    if nbytes > limit:
        raise PayloadTooLargeError(
            f"{name}: {direction} payload of {nbytes:,} bytes exceeds the platform's "
            f"synchronous limit of {limit:,} bytes",
            "send fewer tokens per invocation (more replicas), or pass tensors through "
            "the object store (method 'storage' or 'pipelined')",
        )


class FunctionBackend(ABC):
    """See the module docstring for the contract every implementation keeps."""

    name: str = "?"
    platform: PlatformSpec

    @abstractmethod
    def deploy(self, spec: FunctionSpec) -> FunctionSpec:
        """Create (or replace) a function; returns the validated spec."""

    @abstractmethod
    def invoke(self, name: str, payload: bytes, *, request_id: str | None = None) -> InvokeResult:
        """Run one invocation synchronously (thread-safe: call from many threads)."""

    @abstractmethod
    def scale(
        self, name: str, *, replicas: int | None = None, concurrency: int | None = None
    ) -> FunctionSpec:
        """Change a function's instance cap and per-instance concurrency."""

    @abstractmethod
    def records(self) -> list[InvocationRecord]:
        """One record per billed attempt since the backend started: every successful
        invocation, plus (``failed=True``) attempts that crashed or timed out."""

    @abstractmethod
    def teardown(self) -> None:
        """Stop everything; idempotent."""

    @abstractmethod
    def functions(self) -> dict[str, FunctionSpec]:
        """Deployed functions by name."""

    @property
    def max_inline_bytes(self) -> int:
        """The largest tensor packet sent inline (bigger ones spill to the object store):
        the platform's synchronous payload limit, unless the backend's wire format
        inflates packets (aws: base64 inside a JSON event) and overrides this."""
        return payload_limit(self.platform)

    def reconfigure(self, name: str, config: FunctionConfig,
                    vcpus: float | None = None) -> FunctionSpec:
        """Apply a controller's decision to a deployed function (one implementation for
        every backend, through ``deploy`` and ``scale``). A memory, vCPU or GPU-share
        change redeploys the function, so its next calls start cold on the new size (a
        pod's GPU request is not resized in place); replicas and concurrency go through
        ``scale`` (warm instances stay). A value outside the platform's limits is
        clamped to them and logged, never applied raw: a GPU share on a CPU-only
        platform becomes 0, one between the platform's slices is rounded up to the next
        (``PlatformSpec.clamp_gpu_share``). The GPU is emulated (see FunctionSpec)."""
        cur = self.spec(name)
        limits = self.platform.limits
        mem = config.memory_mb
        memory = self.platform.memory
        if memory is not None:
            if mem > memory.highest_mb:
                mem = memory.highest_mb
            elif not self.platform.is_valid_memory(mem):
                mem = self.platform.round_up_memory(mem)
        replicas, concurrency = config.replicas, config.concurrency
        if limits is not None:
            replicas = min(replicas, limits.max_replicas)
            concurrency = min(concurrency, limits.max_concurrency_per_instance)
        share = self.platform.clamp_gpu_share(config.gpu_share)
        clamped = (mem, replicas, concurrency, share) != (
            config.memory_mb, config.replicas, config.concurrency, config.gpu_share)
        if clamped:
            _log.warning("%s: decision %s clamped to the %s limits: memory %d MB, "
                         "%d replicas, concurrency %d, GPU share %g", name, config,
                         self.platform.name, mem, replicas, concurrency, share)
        if (mem != cur.memory_mb or share != cur.gpu_share
                or (vcpus is not None and vcpus != cur.vcpus)):
            if share > 0:
                _log.info("%s: GPU share %g emulated on the CPU (billed at the slice's "
                          "price, no speed-up)", name, share)
            self.deploy(replace(cur, memory_mb=mem, vcpus=vcpus, replicas=replicas,
                                concurrency=concurrency, gpu_share=share))
        return self.scale(name, replicas=replicas, concurrency=concurrency)

    def spec(self, name: str) -> FunctionSpec:
        specs = self.functions()
        if name not in specs:
            raise UnknownFunctionError(
                f"no function named {name!r} is deployed on the {self.name} backend",
                f"deployed: {', '.join(sorted(specs)) or 'none'}",
            )
        return specs[name]

    def __enter__(self) -> FunctionBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()


# -- backend registry ---------------------------------------------------------------------
BackendFactory = Callable[..., FunctionBackend]
_BACKENDS: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Add a backend under ``name``; a second registration of a name is an error."""
    if name in _BACKENDS:
        raise ValueError(f"backend {name!r} is already registered")
    _BACKENDS[name] = factory


def backend_names() -> list[str]:
    _ensure_builtin()
    return sorted(_BACKENDS)


def create_backend(name: str, platform: PlatformSpec, **options: Any) -> FunctionBackend:
    """A backend by name: ``create_backend("local", spec, store="/tmp/store")``."""
    _ensure_builtin()
    if name not in _BACKENDS:
        raise UnknownNameError(
            f"unknown backend {name!r}", f"available backends: {', '.join(sorted(_BACKENDS))}"
        )
    return _BACKENDS[name](platform, **options)


# Built-in backends, imported on first use: ray and aws need their extras installed, and a
# missing extra should only matter to someone who asks for that backend.
_BUILTIN = {
    "local": ("moefleet.runtime.local", "LocalBackend", None),
    "ray": ("moefleet.runtime.ray_backend", "RayBackend", "ray"),
    "aws": ("moefleet.runtime.aws_backend", "AwsBackend", "aws"),
}


def _lazy(module: str, attr: str, extra: str | None) -> BackendFactory:
    def factory(platform: PlatformSpec, **options: Any) -> FunctionBackend:
        import importlib

        try:
            cls = getattr(importlib.import_module(module), attr)
        except ImportError as err:
            raise MoefleetError(
                f"the {attr} backend cannot be imported: {err}",
                f"install the extra: pip install 'moefleet[{extra}]'" if extra else
                "reinstall moefleet",
            ) from err
        backend: FunctionBackend = cls(platform, **options)
        return backend

    return factory


def _ensure_builtin() -> None:
    for name, (module, attr, extra) in _BUILTIN.items():
        if name not in _BACKENDS:
            _BACKENDS[name] = _lazy(module, attr, extra)
