"""Manifests a user can apply for a plan's functions: OpenFaaS ``Function`` CRDs,
Knative ``Service`` objects, or a Ray Serve config (YAML).

Each function of ``plan.placement()`` becomes one object with its memory, the vCPUs the
platform's rule gives that memory, its replica count and its per-instance concurrency;
``decisions`` (a controller's current configs) override the plan's. A decision beyond
the platform's limits is clamped and logged, never written raw. Kubernetes object names
must be DNS-1123 labels, so ``_`` in grouped expert names becomes ``-g-``; the original
name travels in the ``MOEFLEET_FUNCTION`` variable, which :func:`parse_export` reads back.

GPU shares (a function with ``gpu_share`` s > 0; a share the platform does not offer is
clamped, a CPU-only platform's to 0, and logged): Kubernetes schedules ``nvidia.com/gpu``
only in whole units, so a fraction is not a schedulable limit. We write the share as
the annotation ``moefleet.io/gpu-share`` and, for NVIDIA MPS, the client limits
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (100 x s) and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``
(s x the card's memory). Knative also gets ``nvidia.com/gpu: 1`` in its container limits:
one unit of the node's GPU resource, which is a 1/N slice where the NVIDIA device plugin
shares GPUs (MPS or time-slicing with N replicas) and a whole card where it does not;
the plan assumes the former. The OpenFaaS Function CRD's limits hold only CPU and
memory, so an OpenFaaS function gets the GPU through an OpenFaaS Profile named in the
``com.openfaas.profile`` annotation (``moefleet-gpu``, which the cluster operator
defines: runtime class and GPU request). Ray Serve takes fractional GPUs natively
(``ray_actor_options.num_gpus``).

Validation: the Ray Serve config is checked with Ray's own ``ServeDeploySchema`` when
Ray is installed. No Python package here ships models for the OpenFaaS or Knative CRDs
(nor the Kubernetes client), so those are checked by :func:`parse_export`'s own rules
(apiVersion, kind, DNS-1123 names, quantities).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import yaml

from moefleet.control import FunctionConfig
from moefleet.errors import MoefleetError
from moefleet.plan.plan import DeploymentPlan
from moefleet.platform.specs import PlatformSpec

FORMATS = ("openfaas", "knative", "ray-serve")
_DNS = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_log = logging.getLogger(__name__)


class ExportError(MoefleetError):
    """A format, decision or manifest that cannot be exported or read back."""


def k8s_name(name: str) -> str:
    out = name.lower().replace("_", "-g-")
    if not _DNS.match(out):
        raise ExportError(f"function name {name!r} cannot be a Kubernetes name",
                          "use names of letters, digits and '-'")
    return out


def configs(plan: DeploymentPlan, spec: PlatformSpec,
            decisions: Mapping[str, FunctionConfig] | None = None,
            concurrency: int = 1) -> dict[str, FunctionConfig]:
    """Function -> config: the plan's, overridden by ``decisions``, within limits."""
    out = {f.name: FunctionConfig(f.memory_mb, f.replicas, concurrency)
           for f in plan.placement().functions}
    for name, cfg in (decisions or {}).items():
        if name not in out:
            raise ExportError(f"decision for {name!r}, which the plan does not have",
                              f"functions: {', '.join(sorted(out))}")
        out[name] = cfg
    limits, memory = spec.limits, spec.memory
    for name, cfg in list(out.items()):
        mem, rep, conc = cfg.memory_mb, cfg.replicas, cfg.concurrency
        if memory is not None:
            mem = min(max(mem, memory.lowest_mb), memory.highest_mb)
        if limits is not None:
            rep = min(rep, limits.max_replicas)
            conc = min(conc, limits.max_concurrency_per_instance)
        share = spec.clamp_gpu_share(cfg.gpu_share)
        if (mem, rep, conc, share) != (cfg.memory_mb, cfg.replicas, cfg.concurrency,
                                       cfg.gpu_share):
            _log.warning("%s: %s clamped to %s's limits (%d MB, %d replicas, concurrency %d, "
                         "GPU share %g)", name, cfg, spec.name, mem, rep, conc, share)
            out[name] = FunctionConfig(mem, rep, conc, share)
    return out


GPU_SHARE_KEY = "moefleet.io/gpu-share"
OPENFAAS_GPU_PROFILE = "moefleet-gpu"


def _gpu_env(share: float, spec: PlatformSpec) -> dict[str, str]:
    """NVIDIA MPS client limits for a slice ``share`` of the platform's GPU."""
    card_mb = int((spec.gpu.memory_gb if spec.gpu is not None else 0) * 1024)
    return {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": f"{round(100 * share)}",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={int(share * card_mb)}M"}


def _millicores(vcpus: float) -> str:
    return f"{max(1, round(vcpus * 1000))}m"


def export(plan: DeploymentPlan, fmt: str, spec: PlatformSpec, *, image: str,
           decisions: Mapping[str, FunctionConfig] | None = None,
           namespace: str = "openfaas-fn") -> str:
    """The YAML text of ``plan`` in format ``fmt`` (see the module doc)."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}", f"use one of {', '.join(FORMATS)}")
    cfgs = configs(plan, spec, decisions)
    roles = {f.name: f.role for f in plan.placement().functions}
    docs: list[dict[str, Any]] = []
    for name, c in cfgs.items():
        env = {"MOEFLEET_FUNCTION": name, "MOEFLEET_ROLE": roles[name],
               "MOEFLEET_MODEL": plan.model}
        res = {"memory": f"{c.memory_mb}Mi", "cpu": _millicores(spec.vcpus(c.memory_mb))}
        notes: dict[str, str] = {}
        if c.gpu_share > 0:  # see the module doc: a fraction is not a k8s limit
            env.update(_gpu_env(c.gpu_share, spec))
            notes[GPU_SHARE_KEY] = f"{c.gpu_share:g}"
        if fmt == "openfaas":
            fn_spec: dict[str, Any] = {
                "name": k8s_name(name), "image": image,
                "labels": {"com.openfaas.scale.min": str(c.replicas),
                           "com.openfaas.scale.max": str(c.replicas)},
                "environment": {**env, "max_inflight": str(c.concurrency)},
                "limits": dict(res), "requests": dict(res)}
            if notes:
                fn_spec["annotations"] = {**notes,
                                          "com.openfaas.profile": OPENFAAS_GPU_PROFILE}
            docs.append({"apiVersion": "openfaas.com/v1", "kind": "Function",
                         "metadata": {"name": k8s_name(name), "namespace": namespace},
                         "spec": fn_spec})
        elif fmt == "knative":
            limits = {**res, "nvidia.com/gpu": "1"} if notes else dict(res)
            docs.append({"apiVersion": "serving.knative.dev/v1", "kind": "Service",
                         "metadata": {"name": k8s_name(name)},
                         "spec": {"template": {
                             "metadata": {"annotations": {
                                 "autoscaling.knative.dev/min-scale": str(c.replicas),
                                 "autoscaling.knative.dev/max-scale": str(c.replicas),
                                 **notes}},
                             "spec": {"containerConcurrency": c.concurrency,
                                      "containers": [{
                                          "image": image,
                                          "env": [{"name": k, "value": v}
                                                  for k, v in env.items()],
                                          "resources": {"limits": limits,
                                                        "requests": limits}}]}}}})
    if fmt == "ray-serve":
        deps = [{"name": name, "num_replicas": c.replicas,
                 "max_ongoing_requests": c.concurrency,
                 "ray_actor_options": {"num_cpus": round(spec.vcpus(c.memory_mb), 3),
                                       "memory": c.memory_mb * 1024 * 1024,
                                       **({"num_gpus": c.gpu_share} if c.gpu_share else {})}}
                for name, c in cfgs.items()]
        doc = {"applications": [{"name": "moefleet", "route_prefix": "/",
                                 "import_path": "moefleet.runtime.ray_replica:FunctionReplica",
                                 "deployments": deps}]}
        _validate_ray(doc)
        return yaml.safe_dump(doc, sort_keys=False)
    return yaml.safe_dump_all(docs, sort_keys=False)


def _validate_ray(doc: dict[str, Any]) -> None:
    try:
        from ray.serve.schema import ServeDeploySchema
    except ImportError:  # pragma: no cover - depends on the extra
        return
    try:
        ServeDeploySchema.model_validate(doc)
    except Exception as err:
        raise ExportError(f"Ray Serve rejects the config: {err}") from None


def _mi(q: str) -> int:
    if not q.endswith("Mi") or not q[:-2].isdigit():
        raise ExportError(f"memory quantity {q!r} is not '<n>Mi'")
    return int(q[:-2])


def parse_export(text: str, fmt: str) -> dict[str, FunctionConfig]:
    """Read an exported manifest back: function name -> config (the round trip)."""
    out: dict[str, FunctionConfig] = {}
    if fmt == "ray-serve":
        doc = yaml.safe_load(text)
        _validate_ray(doc)
        for d in doc["applications"][0]["deployments"]:
            opts = d["ray_actor_options"]
            out[d["name"]] = FunctionConfig(opts["memory"] // 2**20, d["num_replicas"],
                                            d["max_ongoing_requests"],
                                            float(opts.get("num_gpus", 0.0)))
        return out
    want = {"openfaas": ("openfaas.com/v1", "Function"),
            "knative": ("serving.knative.dev/v1", "Service")}
    if fmt not in want:
        raise ExportError(f"unknown export format {fmt!r}", f"use one of {', '.join(FORMATS)}")
    for doc in yaml.safe_load_all(text):
        if (doc.get("apiVersion"), doc.get("kind")) != want[fmt]:
            raise ExportError(f"not a {fmt} object: {doc.get('apiVersion')}/{doc.get('kind')}")
        if not _DNS.match(doc["metadata"]["name"]):
            raise ExportError(f"{doc['metadata']['name']!r} is not a DNS-1123 name")
        if fmt == "openfaas":
            s = doc["spec"]
            env = s["environment"]
            out[env["MOEFLEET_FUNCTION"]] = FunctionConfig(
                _mi(s["limits"]["memory"]), int(s["labels"]["com.openfaas.scale.max"]),
                int(env["max_inflight"]),
                float((s.get("annotations") or {}).get(GPU_SHARE_KEY, 0.0)))
        else:
            t = doc["spec"]["template"]
            c = t["spec"]["containers"][0]
            env = {e["name"]: e["value"] for e in c["env"]}
            notes = t["metadata"]["annotations"]
            out[env["MOEFLEET_FUNCTION"]] = FunctionConfig(
                _mi(c["resources"]["limits"]["memory"]),
                int(notes["autoscaling.knative.dev/max-scale"]),
                int(t["spec"]["containerConcurrency"]), float(notes.get(GPU_SHARE_KEY, 0.0)))
    return out
