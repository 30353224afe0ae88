"""Which input would have to change, and by how much, for a policy to reach a cost ratio.

One input at a time is multiplied by a factor f (the others as given) and the cost of
``policy`` relative to the GPU-only baseline is re-planned and re-evaluated (eqs. 1-10);
:func:`factor_needed` returns the f closest to 1 on a log grid where the ratio is at most
the target, or None when no f in the range reaches it. Inputs (``INPUTS``):

- ``gpu_price``: c_g (per GB of GPU memory);
- ``cpu_price``: c_c and its memory part;
- ``invoke_overhead``: t_rem, a warm remote call's overhead;
- ``cpu_expert_time``: T(y) (θ1, θ3) and the non-experts' CPU time, i.e. the CPU FLOP rate;
- ``gpu_time``: every GPU time (non-expert decode/prefill, GPU experts);
- ``transfer``: B, the function-to-function rate.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from moefleet.plan.remoe.planner import plan_policy
from moefleet.plan.remoe.problem import InfeasibleError, RemoeError, RemoeProblem, TimeLaw

INPUTS: tuple[str, ...] = ("gpu_price", "cpu_price", "invoke_overhead", "cpu_expert_time",
                           "gpu_time", "transfer")


def scale(p: RemoeProblem, name: str, f: float) -> RemoeProblem:
    """``p`` with input ``name`` multiplied by ``f`` (> 0)."""
    if not f > 0:
        raise RemoeError(f"scale factor must be > 0, got {f}")
    r = dataclasses.replace
    if name == "gpu_price":
        return r(p, gpu_price_gb_s=p.gpu_price_gb_s * f)
    if name == "cpu_price":
        return r(p, cpu_price_gb_s=p.cpu_price_gb_s * f,
                 cpu_mem_price_gb_s=p.cpu_mem_price_gb_s * f)
    if name == "invoke_overhead":
        return r(p, invoke_overhead_s=p.invoke_overhead_s * f)
    if name == "cpu_expert_time":
        law = TimeLaw(p.law.theta1 * f, p.law.theta2, p.law.theta3 * f, p.law.gb_per_vcpu)
        return r(p, law=law, nonexpert_cpu_token_s=p.nonexpert_cpu_token_s * f)
    if name == "gpu_time":
        return r(p, nonexpert_token_s=p.nonexpert_token_s * f,
                 nonexpert_prefill_token_s=p.nonexpert_prefill_token_s * f,
                 gpu_expert_token_s=p.gpu_expert_token_s * f)
    if name == "transfer":
        return r(p, transfer_bytes_s=p.transfer_bytes_s * f)
    raise RemoeError(f"unknown input {name!r}", f"use one of {', '.join(INPUTS)}")


def ratio_vs_gpu(problems: Sequence[RemoeProblem], policy: str) -> float:
    """Σ cost(policy) / Σ cost(GPU-only) over the problems (SLOs not enforced; the GPU
    baseline billed even where it would not fit one card, as in the Fig. 9 analogue);
    inf where the policy cannot plan some problem at all (its SLOs out of reach)."""
    try:
        num = sum(plan_policy(p, policy, check_slo=False).estimate.cost for p in problems)
    except InfeasibleError:
        return math.inf
    den = sum(plan_policy(p, "gpu", check_slo=False).estimate.cost for p in problems)
    return num / den


def factor_needed(problems: Sequence[RemoeProblem], policy: str, name: str,
                  target: float, lo: float = 1e-3, hi: float = 1e3,
                  points: int = 49) -> dict[str, Any]:
    """The factor closest to 1 (log distance) on ``points`` log-spaced factors in
    [lo, hi] at which ``policy``'s ratio is <= ``target``; the ratios at every factor."""
    fs = np.geomspace(lo, hi, points)
    ratios = [ratio_vs_gpu([scale(p, name, float(f)) for p in problems], policy)
              for f in fs]
    ok = [float(f) for f, q in zip(fs, ratios, strict=True) if q <= target]
    best = min(ok, key=lambda f: abs(np.log(f))) if ok else None
    return {"input": name, "policy": policy, "target": target, "factor": best,
            "ratio_at_1": ratio_vs_gpu(problems, policy),
            "grid": [[float(f), float(q)] for f, q in zip(fs, ratios, strict=True)]}
