"""Turn a ``DeploymentPlan`` into functions on a backend, and remember it as JSON.

``deploy_plan`` checks the plan against the model and the platform, uploads the model's
weights to the object store (:func:`weights.upload_model`), builds one
:class:`FunctionSpec` per function of the plan's placement (names, memory, replicas:
:mod:`moefleet.plan.placement`) and deploys them when given a
backend. The returned :class:`Deployment` is what the executor runs against and what
``moefleet deploy`` writes to disk; :func:`install` re-creates its functions on a fresh
backend (the weights are already in the store).
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moefleet.errors import DataError
from moefleet.io import load_json_input, write_json_atomic
from moefleet.models.base import MoEModelAdapter
from moefleet.models.shape import ModelShape
from moefleet.plan import DeploymentPlan, Placement, PlanError
from moefleet.platform import ObjectStore, PlatformSpec
from moefleet.runtime.base import FunctionBackend, FunctionKind, FunctionSpec, HandlerRef
from moefleet.runtime.weights import ModelLayout, upload_model

DEPLOYMENT_FORMAT = 1
DEFAULT_KEEP_ALIVE_S = 600.0
DEFAULT_TIMEOUT_S = 300.0
MAIN_KV_MB = 64  # KV cache of a main function (counted against its memory)


@dataclass
class Deployment:
    """A model laid out as functions: where its weights are, which functions exist, and the
    model's shape the executor needs (no weights on the caller's side)."""

    model: str
    platform: str
    backend: str
    store: str
    prefix: str
    plan: DeploymentPlan
    layout: ModelLayout
    shape: ModelShape
    functions: list[FunctionSpec]
    namespace: str = ""  # prefix of every function name (several deployments, one backend)
    created: str = field(
        default_factory=lambda: dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))

    def function(self, plan_name: str) -> str:
        """The backend's name for plan function ``plan_name`` (e.g. ``seg-0``)."""
        return self.namespace + plan_name

    @functools.cached_property
    def placement(self) -> Placement:
        """The plan's functions (derived once; the plan does not change)."""
        return self.plan.placement()

    def segment_function(self, block: int) -> str:
        """Backend name of block ``block``'s segment function."""
        return self.function(self.placement.segment(block).name)

    def expert_function(self, layer: int, expert: int) -> str:
        """Backend name of the function holding expert ``expert`` of MoE layer ``layer``."""
        return self.function(self.placement.holder(layer, expert).name)

    @property
    def num_layers(self) -> int:
        return self.shape.num_layers

    @property
    def moe_layers(self) -> list[int]:
        return list(self.shape.moe_layers)

    @property
    def top_k(self) -> int:
        return self.shape.top_k

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": DEPLOYMENT_FORMAT, "model": self.model, "platform": self.platform,
            "backend": self.backend, "store": self.store, "prefix": self.prefix,
            "plan": self.plan.model_dump(mode="json"), "layout": self.layout.to_dict(),
            "shape": self.shape.to_dict(), "functions": [f.to_dict() for f in self.functions],
            "namespace": self.namespace, "created": self.created,
        }

    def save(self, path: str | Path) -> Path:
        write_json_atomic(path, self.to_dict())
        return Path(path)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "<deployment>") -> Deployment:
        if d.get("format") != DEPLOYMENT_FORMAT:
            raise DataError(f"{source}: deployment format {d.get('format')!r} is not "
                            f"{DEPLOYMENT_FORMAT}", "deploy again with moefleet deploy")
        try:
            return cls(
                model=d["model"], platform=d["platform"], backend=d["backend"],
                store=d["store"], prefix=d["prefix"],
                plan=DeploymentPlan.model_validate(d["plan"]),
                layout=ModelLayout.from_dict(d["layout"]),
                # files written before ModelShape stored the same facts as "structure"
                shape=ModelShape.from_dict(d["shape"] if "shape" in d else d["structure"]),
                functions=[FunctionSpec.from_dict(f) for f in d["functions"]],
                namespace=d.get("namespace", ""), created=d.get("created", ""),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(f"{source} is not a valid deployment: {err!r}",
                            "deploy again with moefleet deploy") from err

    @classmethod
    def load(cls, path: str | Path) -> Deployment:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"deployment file {p} does not exist",
                            "create it with: moefleet deploy PLAN -o deployment.json")
        data = load_json_input(p, "deployment file", "deploy again: moefleet deploy PLAN")
        if not isinstance(data, dict):
            raise DataError(f"{p}: a deployment file is a JSON object, got "
                            f"{type(data).__name__}", "deploy again: moefleet deploy PLAN")
        return cls.from_dict(data, str(p))


def check_plan(plan: DeploymentPlan, adapter: MoEModelAdapter, platform: PlatformSpec) -> None:
    """The plan fits the model (blocks, MoE layers, experts) and the platform."""
    if plan.platform != platform.name:
        raise PlanError(
            f"the plan was made for platform {plan.platform!r}, not {platform.name!r}",
            f"deploy to {plan.platform!r}, or re-plan for {platform.name!r}")
    plan.check_model(adapter.moe_layers,
                     [adapter.num_experts(layer) for layer in adapter.moe_layers],
                     adapter.num_layers)
    plan.check_platform(platform)


def deployment_key(prefix: str) -> str:
    """Where a deployment with a main function keeps its own JSON (the main reads it)."""
    return f"{prefix}/deployment.json"


def function_specs(
    plan: DeploymentPlan, layout: ModelLayout, platform: PlatformSpec, *,
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S, timeout_s: float | None = None,
    namespace: str = "", prefix: str = "",
) -> list[FunctionSpec]:
    """One spec per function of ``plan.placement()`` (segments first, then experts by
    layer, then the main function), named as the placement names them, behind
    ``namespace``. A main function reads the deployment from ``deployment_key(prefix)``."""
    limit = platform.limits.timeout_s if platform.limits else None
    timeout = timeout_s or min(DEFAULT_TIMEOUT_S, limit or DEFAULT_TIMEOUT_S)
    common: dict[str, Any] = {"keep_alive_s": keep_alive_s, "timeout_s": timeout}
    specs = []
    for fn in plan.placement().functions:
        kind: FunctionKind
        if fn.role == "segment" and fn.layer is not None:
            kind, handler = "segment", HandlerRef(
                "moefleet.runtime.handlers:segment_handler",
                {"block": fn.layer, "skeleton": layout.skeleton,
                 "weights": layout.segments[fn.layer]})
        elif fn.role == "expert" and fn.layer is not None:
            layer = fn.layer
            kind, handler = "expert", HandlerRef(
                "moefleet.runtime.handlers:expert_handler",
                {"layer": layer, "skeleton": layout.skeleton,
                 "weights": {str(i): layout.expert_key(layer, i) for i in fn.experts}})
        elif fn.role == "main":
            kind, handler = "main", HandlerRef(
                "moefleet.remoe.handler:main_handler",
                {"deployment": deployment_key(prefix), "kv_mb": MAIN_KV_MB})
        else:
            raise PlanError(f"function {fn.name!r}: role {fn.role!r} has no handler",
                            "fix the plan's placement")
        specs.append(FunctionSpec(namespace + fn.name, kind, handler,
                                  memory_mb=fn.memory_mb, replicas=fn.replicas,
                                  concurrency=fn.concurrency, layer=fn.layer,
                                  experts=fn.experts, **common))
    return specs


def deploy_plan(
    adapter: MoEModelAdapter, plan: DeploymentPlan, platform: PlatformSpec,
    store: ObjectStore, *, backend: FunctionBackend | None = None, backend_name: str = "local",
    prefix: str | None = None, model_ref: str | None = None,
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S, timeout_s: float | None = None,
    namespace: str = "",
) -> Deployment:
    """Check, upload weights, build function specs, deploy them on ``backend`` if given.
    ``namespace`` prefixes function names so several deployments can share a backend."""
    check_plan(plan, adapter, platform)
    prefix = prefix or f"deployments/{uuid.uuid4().hex[:12]}"
    layout = upload_model(adapter, store, prefix)
    specs = function_specs(plan, layout, platform, keep_alive_s=keep_alive_s,
                           timeout_s=timeout_s, namespace=namespace, prefix=prefix)
    deployment = Deployment(
        model=model_ref or plan.model, platform=platform.name,
        backend=backend.name if backend is not None else backend_name, store=store.url,
        prefix=prefix, plan=plan, layout=layout, shape=adapter.summary(),
        functions=specs, namespace=namespace)
    if plan.main is not None:  # the main function reads its deployment from the store
        store.put(deployment_key(prefix), json.dumps(deployment.to_dict()).encode())
    if backend is not None:
        install(deployment, backend)
    return deployment


def install(deployment: Deployment, backend: FunctionBackend, *,
            kinds: Collection[str] | None = None,
            keep_existing: bool = False) -> list[FunctionSpec]:
    """Create the deployment's functions on ``backend`` (weights must be in the store):
    those whose kind (``segment``, ``expert``, ``main``) is in ``kinds``, or all (None).
    The caller plays the others (the engine runs the non-experts itself, or ``serve``
    plays the main function). A function is deployed again (a new version: its next call
    is cold) unless ``keep_existing`` and the backend already has it as specified."""
    have = backend.functions() if keep_existing else {}
    return [spec if have.get(spec.name) == spec else backend.deploy(spec)
            for spec in deployment.functions if kinds is None or spec.kind in kinds]


def remove_objects(deployment: Deployment, store: ObjectStore) -> int:
    """Delete everything the deployment put under its prefix; returns the count."""
    keys = store.list(deployment.prefix + "/")
    for key in keys:
        store.delete(key)
    return len(keys)
