"""``compare --measure K``: the K cheapest feasible policies that can run for real, run
through the composition root on the local backend (``open_engine`` + ``run_billed``),
their measured cost and P95 latencies beside the simulator's for the *same* requests.

The measured requests are the traffic's first ``REQUESTS`` arrivals, all arriving at
t = 0, prompts cut to ``MAX_PROMPT`` random token ids and outputs to ``MAX_OUTPUT``
greedy tokens (EOS ignored); the simulated side re-runs the policy on exactly those
requests, so the two share lengths, routing shape and prices. The two sides also share
the deployment's shape: a Remoe layout gives each request a main function of its own
(nothing batches across requests, and a main's bill is its request's alone), so those
requests run one at a time, each timed from the start of its main; an ODS/BO plan serves
them as one batch, as its simulation does. Each policy runs ``repeats`` times and every
run is reported (no best-of). The local backend stands in for the platform with its
startup and its object store emulated (:func:`platform_emulation`): a local cold start
skips the runtime start a platform pays, and a local directory is far faster than S3, so
without them every measured run would read cheaper and faster than the platform would be.
Both sides' TTFT and TPOT P95 are compared (a run meets the bars with both within 25%).

The two sides are made to describe the same machine and the same functions:
- the simulated rows take the engine's CPU times measured here (:func:`calibrate_cpu`,
  on prompts of its own, before any row is planned) in place of FLOP-scaled ones: the
  engine's step carries scheduling, sampling and the Python around each layer, which a
  FLOP count leaves out (on tiny-moe-lm about 2.5x the FLOP-scaled step);
- an ODS/BO plan's segment functions cannot decode (no KV cache between calls), so this
  process plays them (``EngineOptions(play_segments=True)``): held to their vCPU share,
  each step billed as their invocations, with the platform's startup on each;
- a Remoe main is held to its vCPU share (``hold_main_share``), and the simulated main
  pays the CPU factors measured on the engine held at a few shares (a step after a pause
  costs more CPU than one back to back).

Runnable for real: plans with functions (Remoe's layouts, the composed policy with a
SALC-controlled brownout stack, ODS/BO plans). Monolithic and sMoE rows are simulated
only (an in-process engine is not a serverless bill; sMoE needs pods). A layout whose
main function holds a GPU is measured only where CUDA is: run on this CPU and billed at
the GPU's price it says nothing about the simulated GPU row (on tiny-moe-lm it measured
16-79x the simulated cost and 29-229x its P95 TPOT), so without a GPU it is skipped and
the result says why.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from moefleet.compare.rows import Row
from moefleet.compare.scenario import Scenario
from moefleet.compare.traffic import Traffic
from moefleet.errors import MoefleetError
from moefleet.workloads.base import Arrival

REQUESTS = 6
CAL_ROUNDS = 3  # in-process calibration rounds, the fastest kept (calibrate_runtime)
# vCPU shares at which the calibration also times the engine held (the factors a Remoe
# main below one vCPU pays, interpolated between them; RemoeProblem.held_factors)
HELD_SHARES = (0.125, 0.25, 0.5)
MAX_PROMPT = 48
MAX_OUTPUT = 12
REMOE = {"remoe-mmp": "remoe", "remoe-sweep": "remoe-sweep", "remoe-cpu": "cpu",
         "remoe-gpu": "gpu", "remoe-mix": "mix", "remoe-fetch": "fetch"}
ODS = {"lambdaml": "lambdaml", "ods-predicted": "ods", "ods-bo": "ods", "ods-oracle": "ods"}
MEASURABLE = (*REMOE, "composed", *ODS)


def needs_gpu(policy: str) -> bool:
    """Whether the policy's layout has a GPU main function (Remoe's, bar the CPU one)."""
    return policy == "composed" or (policy in REMOE and REMOE[policy] != "cpu")


def mini_scenario(sc: Scenario, n: int = REQUESTS) -> Scenario:
    """The scenario cut to the measured requests: the first ``n``, at t = 0, short."""
    got = sc.traffic.arrivals[:n]
    arr = [Arrival(0.0, a.request_id, min(a.prompt_tokens or 1, MAX_PROMPT),
                   min(a.output_tokens or 1, MAX_OUTPUT)) for a in got]
    tr = Traffic(sc.traffic.spec, arr, max(1.0, sc.interval_s),
                 {**sc.traffic.described, "measured": f"first {n}, batched, cut"})
    return dataclasses.replace(sc, traffic=tr, quick=True)


def _plan_for(sc: Scenario, policy: str, adapter: Any) -> Any:
    """The policy's deployment plan for the measured model."""
    from moefleet.compare.ods_rows import _plan, refined_routing
    from moefleet.compare.remoe_rows import plan_relaxed, problem

    if policy in ODS:
        s_LE = {"ods-bo": refined_routing(sc), "ods-oracle": sc.real_LE}.get(
            policy, sc.pred_LE)
        plan, _ = _plan(sc, ODS[policy], s_LE)
        return plan
    kind = "remoe" if policy == "composed" else REMOE[policy]
    s_LE = refined_routing(sc) if policy == "composed" else sc.pred_LE
    p = problem(sc, s_LE, gpu=kind != "cpu")
    res, _ = plan_relaxed(p, kind)
    return res.to_plan(p, list(adapter.summary().moe_layers))


def simulated_row(sc: Scenario, policy: str) -> Row:
    from moefleet.compare.ods_rows import ods_rows
    from moefleet.compare.remoe_rows import remoe_rows
    from moefleet.compare.smoe_rows import composed_row

    rows = ([composed_row(sc)] if policy == "composed"
            else ods_rows(sc) if policy in ODS else remoe_rows(sc))
    return next(r for r in rows if r.policy == policy)


def run_real(sc: Scenario, policy: str, adapter: Any, *, salc: bool) -> dict[str, Any]:
    """One measured run; figures as the simulated row's."""
    from moefleet.compose import EngineOptions, StackOptions, open_engine
    from moefleet.compose.run import run_billed
    from moefleet.engine import SamplingParams
    from moefleet.experts.brownout_control import BrownoutSpec

    plan = _plan_for(sc, policy, adapter)
    rng = np.random.default_rng(sc.seed)
    vocab = adapter.summary().vocab_size or 256
    prompts = [rng.integers(1, vocab, a.prompt_tokens or 1).tolist()
               for a in sc.traffic.arrivals]
    params = [SamplingParams(max_tokens=a.output_tokens or 1, temperature=0.0,
                             ignore_eos=True) for a in sc.traffic.arrivals]
    brown = (BrownoutSpec(ways=2, mode="full", slo_ttft_s=sc.slo_ttft_s,
                          slo_tpot_s=sc.slo_tpot_s) if salc else None)
    # A Remoe deployment gives every request a main function of its own (the simulator
    # prices it so): those requests run one at a time here, each timed from its main's
    # start. ODS/BO plans serve batches, as their simulation does.
    alone = policy not in ODS
    t0 = time.perf_counter()
    with open_engine(adapter, plan=plan, stack=StackOptions(brownout=brown),
                     backend="local", platform=sc.spec, backend_options=platform_emulation(sc),
                     options=EngineOptions(max_num_seqs=1 if alone else len(prompts),
                                           hold_main_share=alone,
                                           play_segments=not alone)) as opened:
        run = run_billed(opened, prompts, params)
        notes = list(opened.notes)
    ttft = [o.times.first_token - (o.times.scheduled if alone else o.times.arrival)
            for o in run.outputs if o.times and o.times.first_token is not None
            and o.times.scheduled is not None]
    tpot = [o.times.tpot_s for o in run.outputs if o.times and o.times.tpot_s is not None]
    out_tokens = sum(len(o.new_token_ids) for o in run.outputs)
    errors = [o.error for o in run.outputs if o.error]
    if errors and not out_tokens:  # nothing ran: a $0 bill would read as a free policy
        return {"error": f"{len(errors)} of {len(run.outputs)} requests failed: {errors[0]}"}
    return {"cost_usd": run.total_usd, "output_tokens": out_tokens,
            "requests_at_once": 1 if alone else len(prompts),
            "cost_per_1m_usd": run.total_usd / max(out_tokens, 1) * 1e6,
            "ttft_p95_s": float(np.percentile(ttft, 95)) if ttft else None,
            "tpot_p95_s": float(np.percentile(tpot, 95)) if tpot else None,
            "tpot_p50_s": float(np.percentile(tpot, 50)) if tpot else None,
            # per request, in arrival order: a P95 over few requests is one slow request
            "ttft_s": [round(t, 5) for t in ttft], "tpot_s": [round(t, 5) for t in tpot],
            "wall_s": time.perf_counter() - t0, "notes": notes,
            "errors": errors}


def calibrate_cpu(sc: Scenario, adapter: Any) -> Any:
    """The engine's CPU times on this machine (a
    :class:`~moefleet.calibration.remoe.RemoeCalibration`), for :attr:`Scenario.cpu_cal`:
    three prompts of their own (never the measured requests) through the in-process engine
    (three rounds, the fastest kept), then through a plan with every expert remote, on the
    local backend without any emulation. Its functions get one vCPU or more (one worker
    thread is one vCPU), so the times are the engine's own, not a share's; the simulator
    scales them by the vCPUs a plan's memory gets. The in-process engine is timed once
    more at each of :data:`HELD_SHARES`, held as a measured Remoe main is (a step's CPU
    after a pause costs more than back to back: the factors a main pays below one
    vCPU)."""
    import tempfile

    from moefleet.calibration.remoe import calibrate_runtime
    from moefleet.plan.remoe.shapes import gb_per_vcpu
    from moefleet.platform import open_store

    one_vcpu_mb = 1024 * gb_per_vcpu(sc.spec)
    at_least = sc.spec.round_up_memory
    rng = np.random.default_rng(sc.seed + 101)
    vocab = adapter.summary().vocab_size or 256
    prompts = [rng.integers(1, vocab, n).tolist() for n in (MAX_PROMPT // 2, MAX_PROMPT - 8,
                                                            MAX_PROMPT)]
    with tempfile.TemporaryDirectory(prefix="moefleet-cal-") as tmp:
        return calibrate_runtime(adapter, prompts, platform=sc.spec, store=open_store(tmp),
                                 max_tokens=MAX_OUTPUT, main_memory_mb=at_least(
                                     max(2048.0, one_vcpu_mb)),
                                 remote_memory_mb=at_least(one_vcpu_mb), gpu_gb=0.0,
                                 rounds=CAL_ROUNDS, held_shares=HELD_SHARES)


def platform_emulation(sc: Scenario) -> dict[str, Any]:
    """The local backend standing in for the scenario's platform as its simulation prices
    it: the platform's cold and warm start on every call, its object store's latency and
    bandwidth on every store request (both emulated, both only ever slow a run down)."""
    opts: dict[str, Any] = {"startup": "platform"}
    if sc.spec.storage is not None:
        opts["store_latency"] = (sc.spec.storage.access_latency_s,
                                 sc.spec.storage.bandwidth_bytes_per_s)
    return opts


def reference(sim: Row) -> dict[str, Any]:
    """The simulated figures a measured run is held to. A Remoe main runs in this process
    (warm, no cold start to measure): its row is taken with warm mains, TTFT from the
    main's start and the main's INIT left out of the cost; the remote functions' cold
    starts stay on both sides (emulated here, see :func:`platform_emulation`)."""
    if sim.ttft_warm_p95_s is None:
        return {"cost_per_1m_usd": sim.cost_per_1m, "ttft_p95_s": sim.ttft_p95_s,
                "tpot_p95_s": sim.tpot_p95_s, "tpot_p50_s": sim.tpot_p50_s}
    usd = (sim.cost_usd or 0.0) - sim.bill.get("main INIT", 0.0)
    return {"cost_per_1m_usd": usd / max(sim.output_tokens, 1) * 1e6,
            "ttft_p95_s": sim.ttft_warm_p95_s, "tpot_p95_s": sim.tpot_p95_s,
            "tpot_p50_s": sim.tpot_p50_s,
            "basis": "warm mains (the measured main runs in this process)"}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _cheapest(rows: list[Row]) -> list[Row]:
    """Rows meeting the SLO, cheapest first, then the others, cheapest first."""
    ok = sorted((r for r in rows if r.meets_slo), key=lambda r: r.cost_per_1m or 0.0)
    rest = sorted((r for r in rows if not r.meets_slo), key=lambda r: r.cost_per_1m or 0.0)
    return ok + rest


def measure(sc: Scenario, rows: list[Row], k: int, adapter: Any, repeats: int = 2,
            say: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Measure the ``k`` cheapest runnable rows meeting the SLO (else the cheapest
    runnable ones); each result is also put on its row (``row.measured``)."""
    import torch

    ran = _cheapest([r for r in rows if r.absent is None and r.policy in MEASURABLE
                     and r.cost_per_1m is not None])
    skipped = []
    if not torch.cuda.is_available():  # say so for those that would have been picked
        skipped = [r for r in ran[:k] if needs_gpu(r.policy)]
        ran = [r for r in ran if not needs_gpu(r.policy)]
    out: list[dict[str, Any]] = []
    for r in skipped:
        why = ("not measured: its main function holds a GPU and this machine has none (a "
               "CPU run billed at GPU prices would say nothing about the simulated row)")
        r.notes.append(why)
        out.append({"policy": r.policy, "platform": r.platform, "skipped": why, "runs": []})
    if not ran:
        raise MoefleetError("--measure: no policy that can run for real here ran"
                            + (" (the GPU layouts need CUDA)" if skipped else ""),
                            "use a platform with CPU functions (e.g. aws-lambda)")
    pick = ran[:k]
    mini = mini_scenario(sc)
    for row in pick:
        sim = simulated_row(mini, row.policy)
        ref = reference(sim)
        runs = []
        for i in range(repeats):
            if say is not None:
                say(f"measuring {row.policy} (run {i + 1}/{repeats})")
            try:
                got = run_real(mini, row.policy, adapter, salc=row.policy == "composed")
            except MoefleetError as err:
                got = {"error": err.message}
            if "error" not in got:
                got["cost_ratio"] = _ratio(got["cost_per_1m_usd"], ref["cost_per_1m_usd"])
                got["tpot_p95_ratio"] = _ratio(got["tpot_p95_s"], ref["tpot_p95_s"])
                # the typical request's, beside the bar's P95 (a P95 over few requests
                # is the slowest one: jitter the simulator does not model)
                got["tpot_p50_ratio"] = _ratio(got["tpot_p50_s"], ref["tpot_p50_s"])
                got["ttft_p95_ratio"] = _ratio(got["ttft_p95_s"], ref["ttft_p95_s"])
            runs.append(got)
        entry = {"policy": row.policy, "platform": row.platform,
                 "requests": len(mini.traffic.arrivals),
                 "simulated": ref,
                 "runs": runs,
                 "bars": {"cost_within_20pct": [abs((r.get("cost_ratio") or 0) - 1) <= 0.2
                                                for r in runs],
                          "ttft_p95_within_25pct": [abs((r.get("ttft_p95_ratio") or 0) - 1)
                                                    <= 0.25 for r in runs],
                          "tpot_p95_within_25pct": [abs((r.get("tpot_p95_ratio") or 0) - 1)
                                                    <= 0.25 for r in runs]}}
        row.measured = entry
        out.append(entry)
    return out
