"""What the BO loop evaluates: a plan made from predicted counts, run on real batches.

A :class:`BOBatch` is one batch of profiled requests: the requests (what a predictor
sees) and the routing that really happened (counts per expert, plus the trace rows that
become the BO's limited key range L).

:func:`run_on_batch` is Alg. 2 lines 8-26 for one batch: compare predicted and real
tokens per replica; where they differ by more than the margin, apply the replication
rules to the deployed plan --
(i)   the real tokens per replica need more memory than the function has -> replicate so
      each replica's share fits;
(ii)  direct transfer and the real payload per replica exceeds the platform limit ->
      replicate so each replica's payload fits;
(iii) otherwise leave the expert alone (more replicas would only cost more);
then bill the repaired plan on the real counts with the analytical model
(:func:`moefleet.plan.costmodel.evaluate`). The evaluator is the analytical model, not a
measured run: the BO output says so (``evaluator: analytical``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from moefleet.errors import DataError
from moefleet.plan.costmodel import Estimate, direct_fits, evaluate, memory_need_bytes
from moefleet.plan.plan import DeploymentPlan
from moefleet.plan.problem import MB, PlanningProblem
from moefleet.predict._trace import TraceArrays
from moefleet.predict.base import ModelShape, Request
from moefleet.traces.schema import Trace

RULES = ("memory", "payload", "none")  # (i), (ii), (iii)


@dataclass(frozen=True)
class BOBatch:
    """One batch: requests, real counts_LE, and its trace rows (for the key range L).

    Invariants: ``real_LE`` has the predictor's (L, E) shape; the row arrays are aligned
    (one entry per token, MoE layer and chosen expert).
    """

    requests: list[Request]
    real_LE: np.ndarray
    layer_idx: np.ndarray
    token: np.ndarray
    position: np.ndarray
    attention: np.ndarray
    expert: np.ndarray

    @property
    def tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)


def pack_requests(sizes: list[int], budget: int) -> list[list[int]]:
    """Request indices packed in order into groups of about ``budget`` tokens: a group
    closes once it holds ``budget`` or more (so it overshoots by under one request)."""
    groups: list[list[int]] = [[]]
    size = 0
    for idx, n in enumerate(sizes):
        if size >= budget:
            groups.append([])
            size = 0
        groups[-1].append(idx)
        size += n
    return groups


def split_requests(trace: Trace, first_tokens: int) -> tuple[Trace, Trace]:
    """The trace's whole requests in order: the first group of ``first_tokens`` (as
    :func:`pack_requests` packs it), and the rest."""
    ta = TraceArrays.from_trace(trace)
    groups = pack_requests([r.num_tokens for r in ta.requests()], first_tokens)
    head = np.isin(ta.req_idx_N, np.asarray(groups[0], np.int64))
    return (Trace(trace.table.filter(head), trace.meta),
            Trace(trace.table.filter(~head), trace.meta))


def batches_from_trace(trace: Trace, shape: ModelShape, batch_tokens: int,
                       max_batches: int | None = None) -> list[BOBatch]:
    """Whole requests packed in order into batches of about ``batch_tokens`` tokens; a
    last batch under half the size is dropped (it would plan for a different load)."""
    if batch_tokens < 1:
        raise DataError(f"batch_tokens must be >= 1, got {batch_tokens}", "e.g. 10240")
    ta = TraceArrays.from_trace(trace, shape)
    reqs = ta.requests()
    groups = pack_requests([r.num_tokens for r in reqs], batch_tokens)
    if len(groups) > 1 and sum(reqs[i].num_tokens for i in groups[-1]) < batch_tokens / 2:
        groups.pop()
    if max_batches is not None:
        groups = groups[:max_batches]
    L, E, K = shape.num_moe_layers, shape.max_experts, shape.top_k
    out = []
    for g in groups:
        rows = np.isin(ta.req_idx_N, np.asarray(g, np.int64))
        ids = ta.ids_NK[rows]
        li = np.repeat(ta.layer_idx_N[rows], K)
        real = np.bincount(li * E + ids.reshape(-1), minlength=L * E)[: L * E].reshape(L, E)
        out.append(BOBatch(
            requests=[reqs[i] for i in g], real_LE=real.astype(np.int64), layer_idx=li,
            token=np.repeat(ta.tok_N[rows], K), position=np.repeat(ta.pos_N[rows], K),
            attention=np.repeat(ta.att_N[rows], K), expert=ids.reshape(-1)))
    if not out or out[0].tokens == 0:
        raise DataError("the trace holds no tokens to make BO batches from",
                        "profile more tokens (moefleet profile --max-tokens)")
    return out


@dataclass
class BatchOutcome:
    """One plan on one batch: the repaired plan's estimate and what the rules did."""

    estimate: Estimate
    plan: DeploymentPlan
    mismatched_LE: np.ndarray  # bool: |predicted - real| tokens per replica > margin
    rules: dict[str, int] = field(default_factory=dict)  # rule -> experts it applied to
    added_replicas: int = 0

    @property
    def feasible(self) -> bool:
        return self.estimate.feasible


def _fit_tokens(problem: PlanningProblem, li: int, mem_mb: int) -> int:
    """Most tokens one replica can hold in ``mem_mb`` (eq. 12c solved for r)."""
    free = mem_mb * MB - int(memory_need_bytes(problem, li, 0))
    per = problem.bytes_in + problem.bytes_out + problem.inter_per_token(li)
    return max(0, int(free // per)) if per > 0 else 1 << 30


def apply_rules(problem_real: PlanningProblem, plan: DeploymentPlan, pred_LE: np.ndarray,
                margin: float) -> BatchOutcome:
    """The plan with rules (i)-(iii) applied for the real counts of ``problem_real``."""
    repaired = plan.model_copy(deep=True)
    L, E = problem_real.counts_LE.shape
    mismatched = np.zeros((L, E), dtype=bool)
    rules = dict.fromkeys(RULES, 0)
    added = 0
    limit = problem_real.payload_limit_bytes
    width = max(problem_real.bytes_in, problem_real.bytes_out)
    for li, lp in enumerate(repaired.layers):
        d_real = problem_real.counts(li)
        for i, ec in enumerate(lp.experts):
            g = ec.replicas
            r_real = math.ceil(int(d_real[i]) / g)
            r_pred = math.ceil(float(pred_LE[li, i]) / g)
            if abs(r_real - r_pred) <= max(1.0, margin * r_real):
                continue
            mismatched[li, i] = True
            g_new = g
            if memory_need_bytes(problem_real, li, r_real) > ec.memory_mb * MB:
                fit = _fit_tokens(problem_real, li, ec.memory_mb)
                g_new = math.ceil(int(d_real[i]) / fit) if fit > 0 else g
                rules["memory"] += 1
            elif lp.method == "direct" and not direct_fits(problem_real, r_real):
                g_new = math.ceil(int(d_real[i]) * width / limit)
                while g_new < problem_real.max_replicas and not direct_fits(
                        problem_real, math.ceil(int(d_real[i]) / g_new)):
                    g_new += 1  # the envelope and gate weights: one more replica at a time
                rules["payload"] += 1
            else:
                rules["none"] += 1
            g_new = max(g, min(g_new, problem_real.max_replicas))
            added += g_new - g
            ec.replicas = g_new
    return BatchOutcome(evaluate(problem_real, repaired), repaired, mismatched, rules, added)


def batch_cost(outcome: BatchOutcome, slo_penalty: float) -> float:
    """The BO objective of one batch: billed MoE cost, times ``slo_penalty`` when the
    repaired plan still breaks a constraint on the real counts (the paper's objective is
    cost alone; without the penalty the search would learn to under-predict and break
    the SLO)."""
    cost = outcome.estimate.cost_usd
    return cost if outcome.feasible else cost * slo_penalty


def counts_for_plan(counts_LE: np.ndarray) -> np.ndarray:
    """Expected counts (floats) -> integer tokens per expert for planning (rounded up)."""
    arr = np.asarray(counts_LE, dtype=float)
    if not np.all(np.isfinite(arr)):
        raise DataError("predicted counts contain NaN or infinity", "check the predictor")
    return np.ceil(arr - 1e-9).astype(np.int64)
