"""Remoe's policies (MMP, sweep, CPU, GPU, MIX, Fetch) and the composed policy's
simulated row, on the scenario's arrivals.

Each policy plans one layout for the mean request on the *predicted* routing (at the
scenario's SLOs; where its worst case cannot meet them, at SLOs relaxed x2 until it can,
and the row says so), then the SimPy Remoe simulator (:mod:`moefleet.sim.remoe`) serves
requests with the *real* routing. A Remoe request runs in its own main function, so
requests interact only through cold starts; that makes the hot path separable:

1. ``sample`` requests of the traffic, each at its own prompt and output length, run in
   the simulator (warm figures: prefill, TPOT, cost per request; the main's cold start);
2. the rest get least-squares fits on those samples (prefill ~ prompt, cost ~ prompt +
   output, TPOT ~ output), checked on the samples (the fit's error is in the row notes);
3. cold starts of the main functions come from the arrivals (:func:`main_pool`): a
   request finds a warm main if one has been idle for less than the keep-alive.

Cold starts are not billed (Remoe's eq. 6); they delay TTFT.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any

import numpy as np

from moefleet.compare.rows import Row, absent, fill_latency
from moefleet.compare.scenario import Scenario
from moefleet.errors import MoefleetError
from moefleet.plan.problem import InfeasibleError
from moefleet.plan.remoe import plan_policy
from moefleet.plan.remoe.problem import RemoeProblem
from moefleet.plan.remoe.shapes import problem_for
from moefleet.sim.remoe import RemoeSimulator

POLICIES = {"remoe-mmp": "remoe", "remoe-sweep": "remoe-sweep", "remoe-cpu": "cpu",
            "remoe-gpu": "gpu", "remoe-mix": "mix", "remoe-fetch": "fetch"}


def problem(sc: Scenario, s_LE: np.ndarray, gpu: bool = True) -> RemoeProblem:
    load = sc.spec.storage.bandwidth_bytes_per_s if sc.spec.storage is not None else 0.0
    p = problem_for(sc.dims, sc.timing, sc.spec, s_LE, n_in=sc.n_in, n_out=sc.n_out,
                    ttft_slo_s=sc.slo_ttft_s, tpot_slo_s=sc.slo_tpot_s, gpu=gpu,
                    load_bytes_s=load, runtime_mb=sc.runtime_mb)
    if sc.cpu_cal is None:
        return p
    from moefleet.calibration.remoe import cpu_calibrated

    return cpu_calibrated(p, sc.cpu_cal)


def plan_relaxed(p: RemoeProblem, kind: str) -> tuple[Any, float]:
    """(plan, SLO relaxation factor): the plan at the SLOs, else at SLOs x 2, x 4, ..."""
    factor = 1.0
    for _ in range(8):
        q = dataclasses.replace(p, ttft_slo_s=p.ttft_slo_s * factor,
                                tpot_slo_s=p.tpot_slo_s * factor)
        try:
            # baselines are billed even where they miss the SLOs (as Remoe's paper)
            return plan_policy(q, kind, check_slo=False), factor
        except InfeasibleError:
            factor *= 2
    raise InfeasibleError(f"no {kind} layout even at SLOs x {factor / 2:g}",
                          "use a platform with larger functions")


def main_pool(times: np.ndarray, busy_s: np.ndarray, cold_s: float, keep_alive_s: float
              ) -> tuple[np.ndarray, int, int]:
    """Wait before each request's main starts (0 when warm, ``cold_s`` when cold), the
    number of main cold starts, and of *idle episodes* (requests that find no main
    running or idle: every function of the deployment has expired, so the remote ones
    cold-start too). One main per request at a time; idle mains live ``keep_alive_s``
    (the most recently idle one is reused, as the simulator's pool)."""
    idle: list[float] = []  # max-heap (negated) of times mains became idle
    running: list[float] = []  # min-heap of finish times
    wait = np.zeros(len(times))
    colds = episodes = 0
    for i, t in enumerate(times):
        while running and running[0] <= t:
            heapq.heappush(idle, -heapq.heappop(running))
        while idle and t + idle[0] > keep_alive_s:  # the newest is too old: all are
            idle.clear()
        if not idle and not running:
            episodes += 1
        if idle:
            heapq.heappop(idle)
            start = t
        else:
            colds += 1
            start = t + cold_s
            wait[i] = cold_s
        heapq.heappush(running, start + busy_s[i])
    return wait, colds, episodes


def _fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    a = np.column_stack([np.ones(len(x)), x])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return coef


def simulate_layout(sc: Scenario, p: RemoeProblem, res: Any, row: Row) -> Row:
    """Fill ``row`` with the layout's figures on the scenario's traffic (module doc)."""
    tr = sc.traffic
    prompts, outputs, times = tr.prompts, tr.outputs, tr.times
    n = len(times)
    k = min(n, 6 if sc.quick else 12)
    rng = np.random.default_rng(sc.seed + 3)
    picks = np.sort(rng.choice(n, size=k, replace=False))
    pre, tpot, cost, main_cost, gpu_s = [], [], [], [], []
    cold_s = main_init = remote_init = 0.0
    remote_cold = 0
    for j, i in enumerate(picks):
        q = dataclasses.replace(p, n_in=int(prompts[i]), n_out=int(outputs[i]))
        # with the engine calibrated, a remote call bills its handler's measured fixed
        # time, not the invoke round trip (the platform does not meter that)
        billed = None if sc.cpu_cal is None else sc.cpu_cal.handler_fixed_s
        out = RemoeSimulator(q, res.layout, seed=sc.seed + j, keep_alive_s=sc.keep_alive_s,
                             billing=sc.spec.billing, s_LE=sc.real_LE,
                             billed_overhead_s=billed).run([0.0])
        pre.append(out.prefill_s[0])
        tpot.append(out.tpot_s[0])
        # each sampled request ran alone, so cold: its INIT is priced below, per cold
        # start the arrivals cause, not per request
        cost.append(out.cost_usd - out.main_init_cost - out.remote_init_cost)
        main_cost.append(out.main_cost)
        cold_s = max(cold_s, out.cold_s[0])
        main_init = max(main_init, out.main_init_cost)
        remote_init = max(remote_init, out.remote_init_cost)
        remote_cold = max(remote_cold, out.remote_cold_starts)
        gpu_s.append(out.main_billed_s)
    X = np.column_stack([prompts[picks], outputs[picks]]).astype(np.float64)
    c_pre = _fit(X[:, 0], np.array(pre))
    c_tpot = _fit(X[:, 1], np.array(tpot))
    a = np.column_stack([np.ones(k), X])
    c_cost, *_ = np.linalg.lstsq(a, np.array(cost), rcond=None)
    allx = np.column_stack([np.ones(n), prompts, outputs]).astype(np.float64)
    pre_all = np.maximum(c_pre[0] + c_pre[1] * prompts, 0.0)
    pre_all[picks] = pre
    tpot_all = np.maximum(c_tpot[0] + c_tpot[1] * outputs, 0.0)
    tpot_all[picks] = tpot
    cost_all = np.maximum(allx @ c_cost, 0.0)
    fit_err = float(np.max(np.abs(a @ c_cost - np.array(cost)) / np.maximum(cost, 1e-12)))
    cost_all[picks] = cost
    busy = pre_all + tpot_all * np.maximum(outputs - 1, 0)
    wait, colds, episodes = main_pool(times, busy, cold_s, sc.keep_alive_s)
    fill_latency(row, wait + pre_all, tpot_all, outputs, sc.slo_ttft_s, sc.slo_tpot_s)
    row.ttft_warm_p95_s = float(np.percentile(pre_all, 95))
    warm_usd = float(cost_all.sum())
    share = min(1.0, float(np.sum(main_cost) / max(np.sum(cost), 1e-300)))
    row.bill = {"main function": warm_usd * share,
                "remote experts": warm_usd * (1 - share)}
    if main_init or remote_init:  # the platform bills INIT
        row.bill["main INIT"] = colds * main_init
        row.bill["remote INIT"] = episodes * remote_init
    row.cost_usd = sum(row.bill.values())
    row.output_tokens = int(outputs.sum())
    row.cold_starts = int(colds + episodes * remote_cold)
    gpu_gb = float(res.estimate.gpu_gb)
    card = sc.spec.gpu.memory_gb if sc.spec.gpu is not None else 1.0
    row.gpu_s = float(np.sum(busy)) * gpu_gb / card if gpu_gb > 0 else 0.0
    if gpu_gb > 0:
        row.fidelity = "emulated"
        row.notes.append("GPU emulated: datasheet roofline (profiles/gpu.py)")
    row.notes.append(f"{k} of {n} requests simulated (SimPy, real routing); the rest by a "
                     f"least-squares fit (cost fit within {100 * fit_err:.1f}% on them)")
    return row


def remoe_rows(sc: Scenario, s_LE: np.ndarray | None = None) -> list[Row]:
    rows = []
    plat = sc.spec.name
    for name, kind in POLICIES.items():
        cmd = f"moefleet plan --policy {kind} (Remoe) on {sc.model}"
        gpu = kind != "cpu"
        if gpu and sc.spec.gpu is None:
            rows.append(absent(name, "remoe", plat, f"platform {plat} has no GPU functions "
                               f"(the {kind} layout's main needs one)", cmd))
            continue
        try:
            p = problem(sc, sc.pred_LE if s_LE is None else s_LE, gpu=gpu)
            res, factor = plan_relaxed(p, kind)
        except MoefleetError as err:
            rows.append(absent(name, "remoe", plat, err.message, cmd))
            continue
        row = Row(name, "remoe", plat, command=cmd)
        if factor > 1:
            row.notes.append(f"planned at SLOs x {factor:g} (infeasible at the SLOs)")
        if res.meta.get("gpu_over_one_card"):
            row.notes.append(str(res.meta["gpu_over_one_card"]))
        rows.append(simulate_layout(sc, p, res, row))
    return rows
