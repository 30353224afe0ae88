"""Requests under injected faults: nothing lost, outputs unchanged, added latency and cost.

    python benchmarks/faults.py [--requests 8] [--rates 0.01,0.05,0.2] [--seed 0]

For each fault kind (worker crash, timeout, throttling with retry-after, straggler, store
503 SlowDown, dropped store connections) and each rate (fraction of invocations, or of
object-store operations for the store kinds), runs ``--requests`` requests (one prompt
of 8 tokens each) of the tiny Mixtral model deployed on the local backend (storage
method: tokens pass through the object store, 2 worker processes) through the fault
harness (``moefleet.runtime.faults``), plus one fault-free run of the same requests.
Writes benchmarks/results/faults.json: per run accepted, completed, failed, ``lost``
(must be 0), outputs equal to the monolithic model, latency p50/p95 and billed cost
(failed attempts included) and their ratio to the fault-free run. Kinds marked
``emulated`` are injected at the harness, not by the platform (see faults.py).
``--backends local,aws`` adds the aws backend on a moto server (127.0.0.1; invocations run
the uploaded zip in forked processes, S3 traffic goes to moto); ``ray`` adds the ray
backend on a local loopback node (one Serve application per function, replica processes;
crash = a replica process SIGKILLed mid-call), with the tiny model trimmed to 2x4 experts.
``--targets engine,http`` runs the generation engine and a real ``moefleet serve`` under
faults injected at the expert seam instead (see benchmarks/faults_serving.py); combine
with ``--backends`` to run both, or ``--append`` to keep earlier runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as pyplatform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from moefleet.experiments.fault_runs import run_under_faults
from moefleet.io import write_json_atomic
from moefleet.models.hf import HFMoEAdapter
from moefleet.models.tiny import tiny_model
from moefleet.plan import DeploymentPlan
from moefleet.platform import LocalObjectStore, load_platform
from moefleet.runtime.deploy import deploy_plan
from moefleet.runtime.faults import FAULT_KINDS, FaultPlan
from moefleet.runtime.local import LocalBackend

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "faults.json"


def prompts(n: int) -> list[list[int]]:
    """``n`` prompts of 8 token ids, seeded."""
    return [torch.randint(0, 1000, (8,), generator=torch.Generator().manual_seed(1000 + s))
            .tolist() for s in range(n)]


def make_backend(name: str, spec: Any, tmp: str) -> tuple[Any, Any]:
    """(backend, the object store its functions use)."""
    if name == "local":
        store = LocalObjectStore(tmp)
        return LocalBackend(spec, store=store, workers=2), store
    if name == "aws":
        sys.path.insert(0, str(ROOT))
        from moefleet.platform import open_store
        from tests.aws_helpers import moto_aws_backend

        # Fake credentials for moto only (as tests/conftest.py's aws_credentials does).
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                          AWS_DEFAULT_REGION="us-east-1", AWS_CONFIG_FILE=os.devnull,
                          AWS_SHARED_CREDENTIALS_FILE=os.devnull)
        backend = moto_aws_backend(spec)
        return backend, open_store(backend.store_url)
    if name == "ray":
        from moefleet.runtime.ray_backend import RayBackend

        store = LocalObjectStore(tmp)  # a local Ray node: replicas share this machine's disk
        return RayBackend(spec, store=store, wait_ready=True), store
    raise SystemExit(f"unknown backend {name!r}: use local, aws or ray")


def ray_adapter() -> HFMoEAdapter:
    """tiny-mixtral trimmed to 2 blocks of 4 experts (as tests/integration/test_runtime_ray
    does): 10 functions = 10 replica processes that each import torch, where the full
    tiny model's 27 take minutes to start on 2 cores."""
    from moefleet.models.tiny import small_mixtral

    model = small_mixtral()
    return HFMoEAdapter(model, name="tiny-mixtral-2x4")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--rates", default="0.01,0.05,0.2")
    ap.add_argument("--kinds", default=",".join(FAULT_KINDS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--targets", default="",
                    help="engine and/or http: faults under the generation engine and the "
                    "HTTP server (no backend runs unless --backends is given too)")
    ap.add_argument("--backends", default=None,
                    help="local, aws and/or ray (aws-on-moto: a moto server on 127.0.0.1, "
                    "the in-process invoker; needs the aws and dev extras; ray: a local "
                    "loopback Ray node, needs the ray extra)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--append", action="store_true",
                    help="keep --out's runs of the other backends (one backend per call)")
    args = ap.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    if any(t not in ("engine", "http") for t in targets):
        raise SystemExit(f"--targets takes engine and/or http, got {args.targets!r}")
    if args.backends is None:
        args.backends = "" if targets else "local"
    backends = [b for b in args.backends.split(",") if b]
    rates = [float(r) for r in args.rates.split(",")]
    kinds = args.kinds.split(",")
    spec = load_platform("aws-lambda")
    adapter = HFMoEAdapter(tiny_model("mixtral"))
    work = prompts(args.requests)
    runs: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    from faults_serving import engine_runs, http_runs  # this script's directory

    if "engine" in targets:
        runs += engine_runs(adapter, args.requests, rates, args.seed)
    if "http" in targets:
        runs += http_runs(args.requests, rates, args.seed)
    for backend_name in backends:
        model = ray_adapter() if backend_name == "ray" else adapter
        plan = DeploymentPlan.uniform(
            "mixtral", spec.name, model.moe_layers,
            [model.num_experts(layer) for layer in model.moe_layers], model.num_layers, 512,
            method="storage")
        with tempfile.TemporaryDirectory(prefix="moefleet-faults-") as tmp:
            backend, store = make_backend(backend_name, spec, tmp)
            try:
                dep = deploy_plan(model, plan, spec, store, backend=backend)
                # Warm every instance the requests touch: cold starts are not faults.
                run_under_faults(model, dep, backend, store, spec, FaultPlan("none", 0.0),
                                 work)
                base = run_under_faults(model, dep, backend, store, spec,
                                        FaultPlan("none", 0.0), work).to_dict()
                base.update(kind="none", backend=backend_name)
                runs.append(base)
                for kind in kinds:
                    for rate in rates:
                        r = run_under_faults(model, dep, backend, store, spec,
                                             FaultPlan(kind, rate, seed=args.seed),
                                             work).to_dict()
                        r["backend"] = backend_name
                        for key in ("latency_p50_s", "latency_p95_s", "cost_usd"):
                            r[f"added_{key}"] = r[key] - base[key]
                        r["cost_ratio_vs_no_faults"] = r["cost_usd"] / base["cost_usd"]
                        runs.append(r)
                        print(f"{backend_name:5s} {kind:10s} {rate:5.2f}: injected "
                              f"{r['faults_injected']:3d} completed {r['completed']}/"
                              f"{r['accepted']} lost {r['lost']} "
                              f"equal {r['outputs_equal_monolithic']} "
                              f"p50 +{r['added_latency_p50_s']:.3f}s "
                              f"p95 +{r['added_latency_p95_s']:.3f}s "
                              f"cost x{r['cost_ratio_vs_no_faults']:.3f}", flush=True)
            finally:
                backend.teardown()
    report = {
        "command": "python benchmarks/faults.py " + " ".join(argv or sys.argv[1:]),
        "backends": backends + targets,
        "model": "tiny-mixtral (random weights, 3 MoE layers, 8 experts); ray: trimmed to "
                 "2 MoE layers of 4 experts (10 replica processes)",
        "method": "storage", "requests_per_run": args.requests, "rates": rates,
        "total_lost": sum(r["lost"] for r in runs), "wall_s": time.perf_counter() - t0,
        "machine": {"cpus": os.cpu_count(), "platform": pyplatform.platform()},
        "not_measured": ["store faults inside the functions (the client side is wrapped)"],
        "runs": runs,
    }
    if args.append and args.out.is_file():
        old = json.loads(args.out.read_text())
        mine = set(report["backends"])
        report["runs"] = [r for r in old["runs"] if r["backend"] not in mine] + runs
        report["backends"] = sorted({r["backend"] for r in report["runs"]})
        report["commands"] = [*old.get("commands", [old["command"]]), report["command"]]
        report["total_lost"] = sum(r["lost"] for r in report["runs"])
    write_json_atomic(args.out, report)
    print(f"wrote {args.out}; lost in total: {report['total_lost']}")
    return report


if __name__ == "__main__":
    main()
