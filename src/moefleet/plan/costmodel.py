"""The analytical cost and latency model of ODS/BO (READING-NOTES "eqs. 3-12").

Per replica of expert (e,i) with memory option j, g replicas, r = ceil(d/g) tokens each,
t = U_j (eq. 3), T_head = T_warm + T_acc + P/B_s:

- a=1 pipelined:  t_rep = T_head + ceil(r/β)·t_blk + t_tail,
                  t_blk = T_acc + max(β·(D_in/B_s + t), β·D_out/B_s),
                  t_tail = T_acc + β·D_out/B_s                                  (eq. 6)
- a=2 storage:    t_rep = T_head + 2·T_acc + r·(D_in/B_s + t + D_out/B_s)          (eq. 8)
- a=3 direct:     t_rep = T_head + r·(D_in/B_f + t),  r·max(D_in, D_out) ≤ D_P      (eq. 10)

Layer latency ("MoE-E2E"): a=1,2: max(max_i t_rep, T_load) + T_acc + Σ_i d·D_out/B_s
(eqs. 7, 9); a=3: max_i t_rep + r_max·D_out/B_f + T_load (eq. 11). End to end:
Σ_blocks T^NE + Σ_e layer latency ≤ T_limit (eq. 12d). Memory: P + M^inter + r·(D_in+D_out)
≤ M_j (eq. 12c). β: 1 ≤ β ≤ max_i r (eq. 12e).

Cost (eq. 4-5, with billing made concrete): every replica is one invocation per batch,
billed like the platform's ``Meter`` bills it:
    price_per_s(M_j) · billed(t_rep) + per_request [+ object-store requests],
where billed() rounds up to the billing granularity with the minimum billed duration
(100 ms on aws-lambda-2020, 1 ms today), applied per invocation because that is how the
platform bills; an expert costs g times its replica. Object-store requests are our
addition (the paper's objective has only GB-s; the platform bills them and they make small
pipelined minibatches honest): per replica a=1: 2·nblk PUT + (2 + 2·nblk) GET (inputs put
by the gate, got by the expert, outputs put, got by the next segment, plus the two
parameter GETs of a cold start: the skeleton and the expert's weights) and the GETs it
makes for minibatches not yet uploaded (``transfers.minibatch_failed_asks``); a=2: 2 PUT +
4 GET; a=3: 2 GET (parameters). On top, per MoE layer, the requests the segments and the
coordinator make to move the layer's activations (``transfer_usd``, :mod:`.transfers`:
spills over the inline budget, the pipelined routing and its polling) and one LIST per
batch. ``PlanningProblem.storage_requests`` switches all of them off. An expert with d = 0
is not invoked: no cost, no latency. The cost is that of the MoE layers (the paper's
objective plus those requests); ``segment_cost_usd`` reports the non-MoE segment
functions for information.

Warm instances (``PlanningProblem.warm_instances``, opt-in, off by default: the paper's
model above is the default). Steady-state serving where every function instance already
holds its parameters in memory: T_head = T_warm (no T_acc + P/B_s download), no parameter
GET per replica (a=1: 2·nblk GET, a=2: 2 GET, a=3: none), T_load = the next segment's warm
start only, and a replica is billed for t_rep − T_warm (the platform bills the handler, not
the warm start; T_warm still counts for latency). ``Rates`` carries the flag so that every
consumer (evaluate, the frontiers, the MIQCP) uses the same numbers. Segment functions
(``segment_cost_usd``) are billed as before.

All formula helpers accept numpy arrays or scalars (the solvers evaluate thousands of
options at once with the same code that :func:`evaluate` uses).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moefleet.plan import transfers
from moefleet.plan.plan import METHOD_CODES, DeploymentPlan
from moefleet.plan.problem import MB, PlanningProblem
from moefleet.platform.inline import GATE_WEIGHT_BYTES, PACKET_ENVELOPE_BYTES

_TOL = 1e-9  # seconds; latency comparisons against the SLO
PARAM_GETS = 2  # a cold expert function GETs the model skeleton and its expert's weights


@dataclass(frozen=True)
class Rates:
    """The platform numbers the formulas use (seconds, bytes, bytes/s, USD)."""

    warm_s: float  # T_warm
    acc_s: float  # T_acc
    bs: float  # B_s, storage bandwidth
    bf: float  # B_f, function-to-function bandwidth
    payload: int  # D_P: inline packet budget (eq. 12f; platform.inline)
    gran_s: float  # billing granularity
    min_billed_s: float
    per_request: float
    per_put: float
    per_get: float
    warm_instances: bool = False  # steady state: parameters held, T_warm not billed

    @property
    def unbilled_s(self) -> float:
        """Seconds of t_rep the platform does not bill: T_warm with warm instances."""
        return self.warm_s if self.warm_instances else 0.0

    @classmethod
    def of(cls, problem: PlanningProblem) -> Rates:
        s = problem.platform
        assert s.startup and s.storage and s.network and s.billing and s.prices and s.limits
        on = problem.storage_requests
        return cls(
            warm_s=s.startup.warm_start_s,
            acc_s=s.storage.access_latency_s,
            bs=s.storage.bandwidth_bytes_per_s,
            bf=s.network.function_bandwidth_bytes_per_s,
            payload=problem.payload_limit_bytes,
            gran_s=s.billing.granularity_ms / 1000.0,
            min_billed_s=s.billing.min_billed_ms / 1000.0,
            per_request=s.prices.per_request,
            per_put=s.storage.price_per_put if on else 0.0,
            per_get=s.storage.price_per_get if on else 0.0,
            warm_instances=problem.warm_instances,
        )


def price_per_s(problem: PlanningProblem, mem_mb: int) -> float:
    """USD per billed second at ``mem_mb`` (GB-s price, plus vCPU-s where billed)."""
    return problem.platform.compute_cost(mem_mb, 1.0)


def price_table(problem: PlanningProblem) -> np.ndarray:
    """``price_per_s`` over ``problem.memory_options_mb`` (computed once per problem)."""
    return problem.price_per_s_J


def head_s(rates: Rates, param_bytes: float) -> float:
    """T_head = T_warm + T_acc + P/B_s: warm start, storage access, parameter download;
    T_warm alone with warm instances (the parameters are already in memory)."""
    if rates.warm_instances:
        return rates.warm_s
    return rates.warm_s + rates.acc_s + param_bytes / rates.bs


def n_blocks(r: Any, beta: Any) -> Any:
    """ceil(r/β): minibatches of one replica under a=1 (integers in, integers out)."""
    return -(-np.asarray(r, dtype=np.int64) // np.asarray(beta, dtype=np.int64))


def replica_time(
    method: int, r: Any, u: Any, head: Any, beta: Any, rates: Rates, d_in: int, d_out: int
) -> Any:
    """t_rep of one replica (eqs. 6, 8, 10); arrays broadcast."""
    if method == 1:
        blk = rates.acc_s + beta * np.maximum(d_in / rates.bs + u, d_out / rates.bs)
        tail = rates.acc_s + beta * d_out / rates.bs
        return head + n_blocks(r, beta) * blk + tail
    if method == 2:
        return head + 2 * rates.acc_s + r * (d_in / rates.bs + u + d_out / rates.bs)
    if method == 3:
        return head + r * (d_in / rates.bf + u)
    raise ValueError(f"method must be 1, 2 or 3, got {method}")


def billed_s(t: Any, rates: Rates) -> Any:
    """Billed seconds of one invocation lasting ``t`` s: rounded up to the granularity, at
    least the minimum; inf stays inf. A duration within 1e-6 of a granularity step is not
    rounded up further (``PlatformSpec.billed_duration_s`` rounds to whole ns first)."""
    units = np.ceil(np.asarray(t, dtype=float) / rates.gran_s - 1e-6)
    out = np.maximum(units * rates.gran_s, rates.min_billed_s)
    return out if out.ndim else float(out)


def requests_per_replica(
    method: int, nblk: Any, warm_instances: bool = False
) -> tuple[Any, Any]:
    """(PUTs, GETs) to the object store caused by one replica per batch (our accounting);
    with warm instances there are no parameter GETs."""
    param = 0 if warm_instances else PARAM_GETS
    if method == 1:
        return 2 * nblk, param + 2 * nblk
    if method == 2:
        return 2, param + 2
    return 0, param


def replica_billed_s(t_rep: Any, rates: Rates) -> Any:
    """Billed seconds of one replica lasting ``t_rep``: :func:`billed_s` of t_rep, less
    T_warm with warm instances (``Rates.unbilled_s``)."""
    if rates.warm_instances:
        t_rep = np.asarray(t_rep, dtype=float) - rates.unbilled_s
    return billed_s(t_rep, rates)


def replica_cost(method: int, t_rep: Any, nblk: Any, price_s: Any, rates: Rates) -> Any:
    """USD of one replica invocation: compute at billed duration + request + storage."""
    puts, gets = requests_per_replica(method, nblk, rates.warm_instances)
    return (
        price_s * replica_billed_s(t_rep, rates)
        + rates.per_request
        + puts * rates.per_put
        + gets * rates.per_get
    )


def layer_latency(
    method: int, max_trep: float, r_max: float, sum_d: float, load_s: float, rates: Rates,
    d_out: int,
) -> float:
    """MoE-E2E latency of one layer (eqs. 7, 9, 11)."""
    if method in (1, 2):
        return max(max_trep, load_s) + rates.acc_s + sum_d * d_out / rates.bs
    return max_trep + r_max * d_out / rates.bf + load_s


def memory_need_bytes(problem: PlanningProblem, li: int, r: Any) -> Any:
    """Bytes an expert function must hold (eq. 12c): F + P + M^inter + r·(D_in + D_out + m)
    (module doc); never below the runtime footprint F, even with no tokens."""
    return (
        problem.runtime_bytes
        + problem.expert_param_bytes[li]
        + problem.intermediate_bytes
        + r * (problem.bytes_in + problem.bytes_out + problem.inter_per_token(li))
    )


def direct_fits(problem: PlanningProblem, r: Any) -> Any:
    """Eq. 12f: a direct replica of ``r`` tokens sends and returns its packet inline."""
    per = max(problem.bytes_in + GATE_WEIGHT_BYTES, problem.bytes_out)
    return np.asarray(r) * per + PACKET_ENVELOPE_BYTES <= problem.payload_limit_bytes


@dataclass(frozen=True)
class LayerEstimate:
    layer: int  # block index
    method: int  # a
    beta: int
    cost_usd: float
    latency_s: float  # MoE-E2E
    max_replica_s: float  # max_i t_rep
    invocations: int


@dataclass(frozen=True)
class Estimate:
    """What the analytical model says about one plan (units: USD, seconds)."""

    cost_usd: float  # MoE layers: compute + request + storage + transfer + poll parts
    latency_s: float  # end to end, eq. 12d
    compute_usd: float
    request_usd: float
    storage_usd: float  # the expert replicas' own store requests
    segment_cost_usd: float  # non-MoE segment functions, not part of cost_usd
    layers: list[LayerEstimate]
    feasible: bool
    violations: list[str] = field(default_factory=list)
    transfer_usd: float = 0.0  # segments' and coordinator's store requests (transfers)
    # Pipelined replicas' GETs for minibatches not yet up. They couple a layer's replicas
    # (the gate's upload waves), so the planners' frontiers leave them out: a planner's
    # optimum is exact for cost_usd - poll_usd.
    poll_usd: float = 0.0

    def as_predicted(self) -> dict[str, float]:
        """The ``DeploymentPlan.predicted`` entries."""
        return {
            "cost_usd": self.cost_usd,
            "latency_s": self.latency_s,
            "compute_usd": self.compute_usd,
            "request_usd": self.request_usd,
            "storage_usd": self.storage_usd,
            "transfer_usd": self.transfer_usd,
            "poll_usd": self.poll_usd,
            "segment_cost_usd": self.segment_cost_usd,
        }


def evaluate(problem: PlanningProblem, plan: DeploymentPlan) -> Estimate:
    """Cost and latency of ``plan`` for ``problem``; constraint breaches go to
    ``violations`` (the estimate is still computed, ``feasible`` is False)."""
    plan.check_model(list(problem.moe_layers), list(problem.num_experts), problem.num_blocks)
    plan.check_platform(problem.platform)
    rates = Rates.of(problem)
    bad: list[str] = []
    if any(m != problem.segment_memory_mb for m in plan.segment_memory_mb):
        bad.append(
            f"segment memory {sorted(set(plan.segment_memory_mb))} MB differs from the "
            f"problem's {problem.segment_memory_mb} MB (segment times are given at that size)"
        )
    prices: dict[int, float] = dict(
        zip(problem.memory_options_mb, price_table(problem).tolist(), strict=True))
    parts = np.zeros(5)  # compute, request, storage, transfer, poll
    parts[3] = transfers.batch_requests(problem).usd(rates.per_put, rates.per_get)
    layers: list[LayerEstimate] = []
    for li, lp in enumerate(plan.layers):
        a, beta = METHOD_CODES[lp.method], lp.beta
        d = problem.counts(li)
        head = head_s(rates, problem.expert_param_bytes[li])
        layer_cost = transfers.layer_transfer_usd(problem, li, a, rates.per_put, rates.per_get)
        parts[3] += layer_cost
        max_t, r_max, calls = 0.0, 0, 0
        active = sum(ec.replicas for ec, n in zip(lp.experts, d, strict=True) if n > 0)
        for i, ec in enumerate(lp.experts):
            g, mem = ec.replicas, ec.memory_mb
            r = math.ceil(int(d[i]) / g)
            where = f"layer {lp.layer} expert {i}"
            if g > problem.max_replicas:
                bad.append(f"{where}: {g} replicas > the limit {problem.max_replicas}")
            need = memory_need_bytes(problem, li, r)
            if need > mem * MB:
                bad.append(f"{where}: needs {need / MB:.1f} MB, has {mem} MB (eq. 12c)")
            if d[i] == 0:
                continue  # not invoked: nothing to bill, nothing to wait for
            if a == 3 and not direct_fits(problem, r):
                bad.append(
                    f"{where}: direct payload of {r} tokens does not fit the "
                    f"{rates.payload} B inline budget (eq. 12f)"
                )
            u = problem.per_token_s(li, mem)
            t = float(replica_time(a, r, u, head, beta, rates, problem.bytes_in,
                                   problem.bytes_out))
            nblk = int(n_blocks(r, beta)) if a == 1 else 1
            puts, gets = requests_per_replica(a, nblk, rates.warm_instances)
            poll = 0.0
            if a == 1 and rates.per_get:
                u_blk = rates.acc_s + beta * max(problem.bytes_in / rates.bs + u,
                                                 problem.bytes_out / rates.bs)
                poll = rates.per_get * transfers.minibatch_failed_asks(
                    problem, head, u_blk, nblk, beta, active, rates.acc_s, rates.bs)
            if mem not in prices:
                prices[mem] = price_per_s(problem, mem)
            compute = prices[mem] * float(replica_billed_s(t, rates))
            storage = puts * rates.per_put + gets * rates.per_get
            parts[:3] += g * np.array([compute, rates.per_request, storage])
            parts[4] += g * poll
            layer_cost += g * (compute + rates.per_request + storage + poll)
            max_t, r_max, calls = max(max_t, t), max(r_max, r), calls + g
        if a == 1 and r_max > 0 and beta > r_max:
            bad.append(f"layer {lp.layer}: beta {beta} > max tokens per replica {r_max} (12e)")
        lat = layer_latency(a, max_t, r_max, float(d.sum()), problem.load_s(li), rates,
                            problem.bytes_out)
        layers.append(LayerEstimate(lp.layer, a, beta, layer_cost, lat, max_t, calls))
    latency = problem.fixed_latency_s + sum(le.latency_s for le in layers)
    if latency > problem.slo_s + _TOL:
        bad.append(f"end-to-end latency {latency:.4g} s > SLO {problem.slo_s:.4g} s (eq. 12d)")
    return Estimate(
        cost_usd=float(parts.sum()),
        latency_s=latency,
        compute_usd=float(parts[0]),
        request_usd=float(parts[1]),
        storage_usd=float(parts[2]),
        transfer_usd=float(parts[3]),
        poll_usd=float(parts[4]),
        segment_cost_usd=segment_cost(problem),
        layers=layers,
        feasible=not bad,
        violations=bad,
    )


def segment_cost(problem: PlanningProblem) -> float:
    """USD of the non-MoE segment functions (one invocation per block per batch, with its
    parameter GETs; their activation transfers are in ``Estimate.transfer_usd``)."""
    rates = Rates.of(problem)
    p = price_per_s(problem, problem.segment_memory_mb)
    gets = 0 if rates.warm_instances else PARAM_GETS  # cold: skeleton + the block's weights
    return float(sum(p * billed_s(t, rates) + rates.per_request + gets * rates.per_get
                     for t in problem.segment_time_s))
