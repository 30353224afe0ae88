"""Run requests through a deployed Remoe plan and meter every part of it.

Two phases, both on the backend:

1. **cold start**: the main function and every replica of every remote expert function
   are started at the same time (a ``warm`` message each), so the remote functions load
   while the main loads its larger share; the phase's wall time is the deployment's cold
   start (overlapped), and each record's ``init_s`` is that function's own;
2. **generation**: the requests go to the main function in batches of ``batch_size``
   (one invocation runs a batch's prefill and decode to completion); TTFT and TPOT are
   measured inside the main function, the remote expert calls are the backend's records.

Cost: every record priced by the platform's meter; the main function's records with the
plan's GPU share (``main.gpu_gb`` of the platform GPU's memory, in its slices) although it
ran on this machine's CPU: "GPU emulated", the GPU price applied to the measured time.
"""

from __future__ import annotations

import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from moefleet.errors import MoefleetError
from moefleet.platform import InvocationRecord, Meter, PlatformSpec
from moefleet.remoe.messages import Generate, Result
from moefleet.runtime.base import FunctionBackend
from moefleet.runtime.deploy import Deployment
from moefleet.runtime.main_model import gpu_share
from moefleet.runtime.messages import Warm, decode, encode
from moefleet.runtime.payload import pack, unpack

GPU_NOTE = ("GPU emulated: the main function ran on this machine's CPU; the GPU price of "
            "its plan is applied to its measured time")


def _priced(records: list[InvocationRecord], platform: PlatformSpec,
            share: float) -> dict[str, Any]:
    meter = Meter(platform)
    for r in records:
        meter.add(replace(r, gpu_share=share) if r.kind == "main" else r)
    bill = meter.bill()
    return {"invocations": bill.invocations, "cold_starts": bill.cold_starts,
            "cost_usd": bill.total.total, "billed_s": sum(
                platform.invocation_billed_s(r.duration_s, r.init_s) for r in records)}


def start_all(dep: Deployment, backend: FunctionBackend) -> dict[str, Any]:
    """Phase 1: start the main function and every remote replica at once."""
    jobs = [dep.function(f.name) for f in dep.placement.functions
            for _ in range(f.replicas if f.role == "expert" else 1)]
    body = pack(meta=encode(Warm()))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, len(jobs))) as pool:
        results = list(pool.map(lambda name: backend.invoke(name, body), jobs))
    wall = time.perf_counter() - t0
    for res in results:
        decode(unpack(res.payload).meta, Warm)
    main = [r.record for r in results if r.record.kind == "main"]
    remote = [r.record for r in results if r.record.kind != "main"]
    return {"wall_s": wall,
            "main_init_s": max((r.init_s for r in main), default=0.0),
            "remote_init_s": max((r.init_s for r in remote), default=0.0),
            "remote_functions": len({r.function for r in remote}),
            "remote_instances": len(remote)}


def generate(dep: Deployment, backend: FunctionBackend, prompts: list[list[int]], *,
             max_tokens: int, batch_size: int) -> list[tuple[Result, InvocationRecord]]:
    """Phase 2: the requests in batches, one main invocation per batch."""
    main = dep.placement.main
    if main is None:
        raise MoefleetError("this deployment has no main function (not a Remoe plan)",
                            "run it with moefleet run (the executor path)")
    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        ids = tuple(f"r{start + i}-{uuid.uuid4().hex[:6]}" for i in range(len(chunk)))
        msg = Generate(ids, tuple(tuple(p) for p in chunk), max_tokens,
                       max_num_seqs=len(chunk))
        res = backend.invoke(dep.function(main.name), pack(meta=encode(msg)),
                             request_id=ids[0])
        out.append((decode(unpack(res.payload).meta, Result), res.record))
    return out


def run_remoe(dep: Deployment, backend: FunctionBackend, platform: PlatformSpec,
              prompts: list[list[int]], *, max_tokens: int, batch_size: int) -> dict[str, Any]:
    """Both phases and the summary (times in s, cost in USD, tokens per request)."""
    share = gpu_share(dep, platform)
    before = len(backend.records())
    cold = start_all(dep, backend)
    mid = len(backend.records())
    t0 = time.perf_counter()
    batches = generate(dep, backend, prompts, max_tokens=max_tokens, batch_size=batch_size)
    wall = time.perf_counter() - t0
    records = backend.records()
    warm_recs, gen_recs = records[before:mid], records[mid:]
    results = [r for res, _ in batches for r in res.requests()]
    devices = sorted({res.device for res, _ in batches})
    parts = {}
    for phase, recs in (("cold_start", warm_recs), ("generation", gen_recs)):
        parts[phase] = {
            "main": _priced([r for r in recs if r.kind == "main"], platform, share),
            "remote": _priced([r for r in recs if r.kind != "main"], platform, share)}
    total = sum(p[k]["cost_usd"] for p in parts.values() for k in ("main", "remote"))
    return {
        "kind": "remoe-main",  # the main function ran the engine (``_print_summary`` reads it)
        "model": dep.model, "platform": platform.name, "policy": dep.plan.policy,
        "requests": len(results), "max_tokens": max_tokens, "batch_size": batch_size,
        "main_memory_mb": dep.plan.main.memory_mb if dep.plan.main else None,
        "gpu_share": share, "device": devices,
        "gpu": "none" if share <= 0 else GPU_NOTE if set(devices) <= {"cpu"} else (
            f"GPU: the main function's non-expert modules ran on {', '.join(devices)}"),
        "cold_start": cold, "generation_wall_s": wall,
        "ttft_s": {"median": statistics.median(r.ttft_s for r in results),
                   "max": max(r.ttft_s for r in results)},
        "tpot_s": {"median": statistics.median(r.tpot_s for r in results)},
        "remote_invocations": sum(res.remote_invocations for res, _ in batches),
        "cost_usd": {"total": total, **parts},
        "tokens": {r.request_id: list(r.tokens) for r in results},
    }


def reference_tokens(adapter: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The monolithic model's greedy tokens (in process, every expert local)."""
    from moefleet.compose.root import in_process_engine
    from moefleet.engine.request import SamplingParams

    outs = in_process_engine(adapter).engine.generate(
        prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [o.new_token_ids for o in outs]


def run_remoe_plan(source: Any, prompts: list[list[int]], *, platform: PlatformSpec,
                   store: Any, adapter: Any = None, backend: str = "local",
                   backend_options: dict[str, Any] | None = None, max_tokens: int = 16,
                   batch_size: int = 8, check: bool = True,
                   cold_repeats: int = 0) -> dict[str, Any]:
    """Deploy (a plan; or take a ``Deployment``), create its functions, :func:`run_remoe`,
    compare with the monolithic model when ``check`` (needs ``adapter``), then
    ``cold_repeats`` more cold starts (every function redeployed: a new version starts
    cold), tear down (``runtime.lifecycle.deployed_backend``: whatever happens, the backend
    is torn down and the weights this call uploaded are removed)."""
    from moefleet.runtime.deploy import install
    from moefleet.runtime.lifecycle import deployed_backend

    with deployed_backend(source, platform=platform, store=store, adapter=adapter,
                          backend=backend, backend_options=backend_options) as (dep, fb):
        summary = run_remoe(dep, fb, platform, prompts, max_tokens=max_tokens,
                            batch_size=batch_size)
        repeats = [summary["cold_start"]]
        for _ in range(max(0, min(cold_repeats, 20))):
            install(dep, fb)
            repeats.append(start_all(dep, fb))
        summary["cold_start_repeats"] = repeats
    summary["backend"] = dep.backend
    if check and adapter is not None:
        ref = reference_tokens(adapter, prompts, max_tokens)
        got = list(summary["tokens"].values())
        summary["tokens_match_monolithic"] = got == ref
    return summary
