"""What the function-pipeline policies (ODS/BO, sMoE) share: the shape's compute profile
and one run of the project's simulator (:class:`moefleet.sim.Simulator`) on the
scenario's arrivals, turned into a row.

The profile is estimated, not measured at this size: 2 FLOPs per parameter per token at
the FLOP rate measured here at the shape's expert size (one vCPU; the synthetic models'
thread law), a 1 ms overhead per call; segments carry the non-expert parameters evenly.
With ``--measure`` (the scenario's ``cpu_cal``) the laws are the engine's measured times.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moefleet.compare.rows import Row, fill_latency
from moefleet.compare.scenario import Scenario
from moefleet.profiles.model import BatchLaw, ComputeProfile, FunctionProfile, ThreadLaw
from moefleet.sim.synthetic import DEFAULT_THREADS

FP32 = 4
ONE_THREAD = ThreadLaw(0.0, 0.0, 1.0)  # flat from one vCPU up (see profile_of)


def profile_of(sc: Scenario) -> ComputeProfile:
    """The shape's profile: FLOP-scaled, or with the engine's CPU times measured here
    (``sc.cpu_cal``, ``--measure``): a segment per step costs the per-layer decode time of
    the engine at one token and its prompt time per further token; an expert call the
    remote handler's fixed time plus the measured slot time per token; both at one thread
    whatever the vCPUs above one (no thread scaling was measured)."""
    d = sc.dims
    rate = sc.timing.cpu_flops_1
    cal = sc.cpu_cal

    # Calibrated times were measured on one thread: no speed-up from more vCPUs is
    # assumed (paid for, not used; conservative), a share below one core is 1/v slower.
    threads = DEFAULT_THREADS if cal is None else ONE_THREAD

    def law(params: float, batch: BatchLaw | None = None) -> FunctionProfile:
        return FunctionProfile(batch or BatchLaw(1e-3, 2.0 * params / rate), threads,
                               param_bytes=int(params * FP32))

    moe = list(range(d.moe_layers))
    seg = d.nonexpert_params / d.moe_layers
    seg_law = ex_law = None
    if cal is not None:
        per = cal.nonexpert_prefill_token_s
        seg_law = BatchLaw(max(0.0, cal.nonexpert_decode_s - per), per)
        ex_law = BatchLaw(cal.handler_fixed_s, cal.expert_token_s + cal.slot_wire_s)
    return ComputeProfile(model=d.name, hidden_size=d.hidden, moe_layers=moe,
                          experts={b: law(d.expert_params, ex_law) for b in moe},
                          segments=[law(seg, seg_law) for _ in moe],
                          bytes_per_token=d.hidden * FP32,
                          machine={"estimated": cal is None},
                          runtime_bytes={"compare": int(sc.runtime_mb * 2**20)})


# expert-passes per row: requests x (1 + output tokens) x MoE layers x experts
WORK = 2_000_000
QUICK_WORK = 300_000


def work_cap(sc: Scenario) -> int:
    """How many of the first requests a pipeline row simulates: every expert call is an
    event, so the bound is on expert-passes (at least 5 requests)."""
    per = (sc.traffic.outputs + 1) * sc.dims.moe_layers * sc.dims.experts
    budget = QUICK_WORK if sc.quick else WORK
    n = int(np.searchsorted(np.cumsum(per), budget, side="right"))
    return max(5, n)


def simulate_plan(sc: Scenario, plan: Any, row: Row, *, policy: Any = None,
                  scaling: str = "on-demand", initial: Any = None,
                  prewarm: bool = False, pod_mb: int | None = None,
                  decode: str = "batched") -> Row:
    """Run ``plan`` under ``policy`` on the scenario; fill ``row`` from the result."""
    from moefleet.sim import DistributionRouter, SimConfig, Simulator

    tr = sc.traffic
    router = DistributionRouter(sc.real_LE, sc.dims.top_k)
    cfg = SimConfig(scaling=scaling, keep_alive_s=sc.keep_alive_s, decode=decode,  # type: ignore[arg-type]
                    max_decode_batch=64, max_batched_tokens=2048,
                    ttft_slo_s=sc.slo_ttft_s, tpot_slo_s=sc.slo_tpot_s,
                    slo_s=None, interval_s=sc.interval_s, keep_requests=True,
                    prewarm=prewarm)
    sim = Simulator(plan, profile_of(sc), sc.spec, router=router, config=cfg, controller=policy,
                    seed=sc.seed, initial=initial)
    cap = work_cap(sc)
    arrivals, horizon = tr.arrivals, sc.duration_s
    if len(arrivals) > cap:
        horizon = arrivals[cap].t_s
        arrivals = arrivals[:cap]
        row.notes.append(f"simulated the first {horizon:.0f} s of the traffic ({cap} of "
                         f"{len(tr.arrivals)} requests): cost per token and latencies are "
                         "theirs")
    res = sim.run(arrivals, horizon)
    log = res.request_log
    out_of = {a.request_id: a.output_tokens or 1 for a in arrivals}
    ttft = np.array([r["ttft_s"] for r in log])
    lat = np.array([r["latency_s"] for r in log])
    outs = np.array([out_of[r["request_id"]] for r in log])
    tpot = np.where(outs > 1, (lat - ttft) / np.maximum(outs - 1, 1), 0.0)
    fill_latency(row, ttft, tpot, outs, sc.slo_ttft_s, sc.slo_tpot_s)
    row.cost_usd = float(res.cost.total)
    row.output_tokens = int(outs.sum())
    row.cold_starts = int(res.cold_starts)
    row.gpu_s = 0.0
    row.bill = {"function compute": float(res.cost.compute),
                "invocations": float(res.cost.request),
                "object store": float(res.cost.storage)}
    if pod_mb is not None:  # pods: billed while alive (the sMoE harness's cost)
        pod_s = sum(iv["instances"] for iv in res.timeline) * sc.interval_s
        row.cost_usd = sc.spec.compute_cost(pod_mb, pod_s)
        row.bill = {"pod time": row.cost_usd}
        row.notes.append(f"pods billed while alive at {pod_mb} MB each ({pod_s:,.0f} pod-s)")
    row.notes.append(f"{res.invocations:,} invocations simulated; compute profile "
                     + ("estimated from the measured FLOP rate" if sc.cpu_cal is None else
                        "from the engine's CPU times measured here"))
    return row
