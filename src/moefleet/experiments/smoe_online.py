"""The online run: a controller scales a real deployment under a replayed workload, and
the simulator predicts the same run.

    replay -> deploy (local backend) -> warm-up (serial; also calibrates) -> replay under
    ControlLoop -> measured bill (Meter over the records) and P95
    same arrivals + plan + controller + interval -> Simulator -> predicted bill and P95

Invariants:
- The deployment is the sMoE scenario's plan (function names, memory, replicas) on a
  real model of the scenario's shape; expert replicas are *pods* (an instance cap, a
  call goes whole to one instance, as in the harness's ``scaling="replicas"``), so the
  executor dispatches one call per expert and the backend holds the replica cap.
- The simulator gets only what the run knew before the replay: the model's measured
  compute profile, the recorded routing of the very requests (exact replay per request
  id), the worker pool as ``node_slots``, and overheads calibrated on the warm-up
  requests (never on the replay; :mod:`moefleet.calibration.smoe_online`, which also
  holds :class:`OnlineSetup` and the simulated run). Warm-up runs first in both; the
  controller sees snapshots only from the replay's start (a control-interval boundary in
  both).
- Decisions the platform cannot apply are clamped, never applied raw: memory below what
  a local instance starts in (its measured runtime footprint + parameters) is raised by
  :class:`MemoryFloor` (in both runs alike), limits by ``reconfigure``; both are counted.

Emulated (labelled in every result): the local backend stands in for OpenFaaS pods —
CPU shares below one vCPU are stretched, the workers are the machine's cores, a
local-directory store. Units: seconds, USD.
"""

from __future__ import annotations

import math
import os
import queue
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from moefleet.autoscale.errors import AutoscaleError
from moefleet.autoscale.smoe.harness import Recorder, Scenario, segment_start
from moefleet.calibration.smoe_online import OnlineSetup, simulate_online, warm_arrivals
from moefleet.control import (
    APPLY_DELAY_S,
    Deferred,
    FunctionConfig,
    MemoryFloor,
    Replayed,
    ScalingController,
)
from moefleet.plan.plan import DeploymentPlan
from moefleet.runtime.control import ControlConfig, ControlLoop
from moefleet.workloads.base import Arrival

EMULATED = ("emulated: local worker processes stand in for OpenFaaS pods (CPU below one "
            "vCPU stretched to its share, one invocation per worker at a time)")


def replay(arrivals: Sequence[Arrival], duration_s: float,
           setup: OnlineSetup) -> tuple[list[Arrival], float]:
    """The window's arrivals thinned (seeded) and time-compressed; renamed
    ``online-<i>``; and the compressed duration."""
    rng = random.Random(setup.seed)
    kept = [a for a in sorted(arrivals, key=lambda a: a.t_s) if rng.random() < setup.keep]
    out = [Arrival(a.t_s / setup.compress, f"online-{i}", setup.prompt_tokens)
           for i, a in enumerate(kept)]
    return out, duration_s / setup.compress


def pod_plans(sc: Scenario, model: str) -> tuple[DeploymentPlan, DeploymentPlan]:
    """(the scenario's plan for ``model``, the same with one replica per expert): the
    first is what the simulator and the backend's replica caps hold, the second what
    the executor dispatches on (one call per expert; replicas are pods, not splits)."""
    plan = sc.plan.model_copy(update={"model": model})
    one = [lp.model_copy(update={"experts": [e.model_copy(update={"replicas": 1})
                                             for e in lp.experts]}) for lp in plan.layers]
    return plan, plan.model_copy(update={"layers": one})


def memory_floor(plan: DeploymentPlan, profile: Any, options: Sequence[int],
                 backend: str = "local", headroom: float = 1.25) -> dict[str, int]:
    """Per function: the least of ``options`` that holds the backend's measured runtime
    footprint plus the function's parameters, with ``headroom`` for call peaks."""
    runtime = profile.runtime_bytes.get(backend) or profile.footprint_bytes
    out: dict[str, int] = {}
    for f in plan.placement().functions:
        assert f.layer is not None  # the scenario's plans have no main function
        params = (profile.segments[f.layer].param_bytes if f.role == "segment" else
                  profile.expert(f.layer).param_bytes * len(f.experts))
        need = headroom * (runtime + params) / 2**20
        out[f.name] = next((m for m in options if m >= need), max(options))
    return out


@dataclass
class RunLog:
    """One run (measured or simulated) of the replay."""

    latencies: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)  # invocations per request
    records: list[Any] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    applied: list[tuple[float, str, FunctionConfig]] = field(default_factory=list)
    clamped_platform: int = 0
    clamped_floor: int = 0
    provisioned_usd: float = 0.0
    interval_p95_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    t0: float = 0.0  # the replay's start on the run's clock
    driver_cpu_s: float = 0.0  # this process: executor threads, packing, control loop
    worker_cpu_s: float = 0.0  # the local workers (handlers); CPU of respawned ones is lost

    def p95_s(self) -> float:
        lats = sorted(self.latencies.values())
        return lats[min(len(lats) - 1, math.ceil(0.95 * len(lats)) - 1)] if lats else 0.0


def _worker_cpu_s(pids: Sequence[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass  # a worker that exited: its CPU is lost to the count (stated as a floor)
    return total


def run_measured(sc: Scenario, plans: tuple[DeploymentPlan, DeploymentPlan], adapter: Any,
                 controller: ScalingController | None, floor: dict[str, int],
                 arrivals: Sequence[Arrival], duration_s: float,
                 batches: dict[str, tuple[Any, Any]], warmup_ids: Sequence[str],
                 store_dir: str, setup: OnlineSetup, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 ) -> tuple[RunLog, list[tuple[str, float, list[Any]]]]:
    """Deploy on the local backend, warm up (serial), replay ``arrivals`` under
    ``controller`` (None = the static plan) through :class:`ControlLoop`; returns the
    replay's log and the warm-up's (request id, latency, records)."""
    from moefleet.compose import open_engine
    from moefleet.compose.batches import Batches
    from moefleet.compose.score import score_options
    from moefleet.platform import open_store
    from moefleet.runtime.base import create_backend
    from moefleet.runtime.deploy import remove_objects
    from moefleet.runtime.lifecycle import deploy

    sim_plan, dispatch = plans
    store = open_store(store_dir)
    dep = deploy(dispatch, adapter, sc.spec, store)
    backend = create_backend("local", sc.spec, store=dep.store, workers=setup.workers)
    log = RunLog()
    warm: list[tuple[str, float, list[Any]]] = []
    try:
        longest = max(int(ids.shape[1]) for ids, _ in batches.values())
        with open_engine(adapter, plan=dep, backend=backend, store=store, platform=sc.spec,
                         options=score_options(1, max(2, longest)), model_ref=dep.model,
                         audit=True) as opened:
            experts = [f for f in sim_plan.placement().functions if f.role == "expert"]
            for f in experts:  # pods: the replica cap
                backend.reconfigure(f.name, FunctionConfig(f.memory_mb, f.replicas, 1))
            # each request runs on its own engine (lane), independently, as each would
            # on a platform: idle lanes are reused, a new one is spawned when all are busy
            lanes: queue.SimpleQueue[Batches] = queue.SimpleQueue()
            lanes.put(Batches(opened))

            def lane() -> Batches:
                try:
                    return lanes.get_nowait()
                except queue.Empty:
                    assert opened.spawn is not None  # a deployed plan spawns lanes
                    return Batches(opened.spawn())

            ex = lane()
            for rid in warmup_ids:
                res = ex.run_batch(*batches[rid], [rid])
                warm.append((rid, res.latency_s, res.records))
            inner = MemoryFloor(controller, floor) if controller is not None else None
            rec = Recorder(inner, sc.price_per_s, segment_start(sc))
            loop = ControlLoop(backend, rec, ControlConfig(
                interval_s=sc.interval_s, apply_delay_s=APPLY_DELAY_S, slo_s=sc.slo_s,
                bytes_per_token=4 * adapter.summary().hidden_size), clock=clock)

            lanes.put(ex)

            def serve(a: Arrival) -> None:
                loop.request_started()
                mine = lane()
                try:
                    res = mine.run_batch(*batches[a.request_id], [a.request_id])
                except Exception:  # a failed request is counted, the replay goes on
                    log.failed.append(a.request_id)
                    loop.request_finished(float("inf"))
                    return
                finally:
                    lanes.put(mine)
                log.latencies[a.request_id] = res.latency_s
                log.calls[a.request_id] = len(res.records)
                # a one-request batch: every call is this request's (the simulator's
                # records name theirs, so both logs can be compared per request)
                log.records.extend(replace(r, request_id=r.request_id or a.request_id)
                                   for r in res.records)
                loop.request_finished(res.latency_s, res.records, a.request_id)

            pids = backend.worker_pids  # type: ignore[attr-defined]
            cpu0, wcpu0 = time.process_time(), _worker_cpu_s(pids())
            w0, t0 = time.perf_counter(), clock()
            log.t0 = t0
            todo = sorted(arrivals, key=lambda a: a.t_s)
            with ThreadPoolExecutor(64, thread_name_prefix="online-req") as pool:
                futures: list[Future[None]] = []
                while todo or clock() - t0 < duration_s or not all(f.done() for f in futures):
                    while todo and todo[0].t_s <= clock() - t0:
                        futures.append(pool.submit(serve, todo.pop(0)))
                    loop.tick()
                    sleep(setup.poll_s)
            log.wall_s = time.perf_counter() - w0
            log.driver_cpu_s = time.process_time() - cpu0
            log.worker_cpu_s = _worker_cpu_s(pids()) - wcpu0
        log.applied = list(loop.applied)
        log.clamped_platform = len(loop.clamped)
        log.clamped_floor = len(inner.clamped) if isinstance(inner, MemoryFloor) else 0
        log.provisioned_usd = float(sum(rec.log.cost_usd))
        log.interval_p95_s = list(rec.log.p95_s)
    finally:
        backend.teardown()
        remove_objects(dep, store)
    return log, warm


def token_counts(batches: dict[str, tuple[Any, Any]]) -> dict[str, int]:
    """Real (unpadded) tokens per request: the simulator replays a request's recorded
    routing exactly only when its pass has the recorded token count."""
    return {rid: int(mask.sum()) for rid, (_, mask) in batches.items()}


def run_simulated(sc: Scenario, plan: DeploymentPlan, profile: Any, trace: Any, vocab: int,
                  controller: ScalingController | None, floor: dict[str, int],
                  arrivals: Sequence[Arrival], duration_s: float, warmup_ids: Sequence[str],
                  setup: OnlineSetup, cal: Any, tokens: dict[str, int],
                  caller_s: float = 0.0) -> tuple[RunLog, Any]:
    """The simulator's prediction of :func:`run_measured`: the same warm-up, then the
    replay from the next control-interval boundary, under the same controller (a
    :class:`Replayed` one already holds the floor and the segment start)."""
    warm = warm_arrivals(warmup_ids, setup, tokens)
    start = math.ceil((warm[-1].t_s + setup.warmup_gap_s) / sc.interval_s) * sc.interval_s
    replayed = isinstance(controller, Replayed)
    inner = MemoryFloor(controller, floor) if controller is not None and not replayed else (
        controller)
    rec = Recorder(inner, sc.price_per_s, None if replayed else segment_start(sc))
    shifted = [Arrival(start + a.t_s, a.request_id, tokens.get(a.request_id, a.prompt_tokens))
               for a in arrivals]
    res, records = simulate_online(sc, plan, profile, trace, vocab, Deferred(rec, start),
                        [*warm, *shifted], start + duration_s, setup, cal, caller_s)
    ids = {a.request_id for a in arrivals}
    log = RunLog(latencies={r["request_id"]: r["latency_s"] for r in res.request_log
                            if r["request_id"] in ids},
                 records=[r for r in records if r.request_id in ids],
                 provisioned_usd=float(sum(rec.log.cost_usd)),
                 interval_p95_s=list(rec.log.p95_s),
                 clamped_floor=len(inner.clamped) if isinstance(inner, MemoryFloor) else 0)
    log.wall_s = res.wall_s
    return log, res


def requests_for(adapter: Any, request_ids: Sequence[str], dataset: str, split: str | None,
                 prompt_tokens: int) -> tuple[dict[str, tuple[Any, Any]], Any]:
    """One single-request batch per id (prompts of ``dataset`` in turn, cut at
    ``prompt_tokens``) and the routing trace of exactly those requests (the simulator
    replays it per request id)."""
    import torch

    from moefleet.data import load_prompts
    from moefleet.traces import profile as record_routing
    from moefleet.traces.profile import tokenize_prompts

    prompts = load_prompts(dataset, split=split)
    texts = [prompts[i % len(prompts)].text for i in range(len(request_ids))]
    max_tokens = len(request_ids) * prompt_tokens
    made = tokenize_prompts(adapter, texts, max_tokens=max_tokens, max_length=prompt_tokens)
    if len(made) != len(request_ids):
        raise AutoscaleError(f"{dataset}: {len(made)} of {len(request_ids)} prompts "
                             "tokenised to a request", "use a dataset with non-empty prompts")
    batches = {}
    for i, ids in made:
        ids_BT = torch.tensor([ids])
        batches[request_ids[i]] = (ids_BT, torch.ones_like(ids_BT))
    trace = record_routing(adapter, list(request_ids), texts, attention_ids=False,
                           max_tokens=max_tokens, max_length=prompt_tokens)
    return batches, trace
