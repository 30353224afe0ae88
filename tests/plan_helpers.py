"""Shared by the planning tests: a hand-built BERT-sized profile, tiny problems, and an
exact optimum by brute-force enumeration (independent of the frontier/knapsack code)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from moefleet.plan.costmodel import (
    Rates,
    billed_s,
    head_s,
    layer_latency,
    memory_need_bytes,
    n_blocks,
    replica_time,
    requests_per_replica,
)
from moefleet.plan.problem import MB, PlanningProblem
from moefleet.plan.transfers import batch_requests, layer_transfer_usd
from moefleet.platform import load_platform
from moefleet.profiles.model import BatchLaw, ComputeProfile, FunctionProfile, ThreadLaw

# BERT-base, one expert = the dense FFN 768 -> 3072 -> 768 (fp32):
# params 2*768*3072 + 3072 + 768 = 4,722,432 -> 18,889,728 bytes; ~9.4 MFLOP per token.
# ASSUMPTION: ~31 GFLOP/s effective on one Lambda vCPU (AVX2 sgemm) -> 3.0e-4 s/token,
# 1.82x at 2 vCPUs: T(v) = 5.80e-4*exp(-v) + 8.66e-5 (T(1)=3.0e-4, T(2)=1.65e-4);
# 1 ms fixed overhead per call.
BERT_EXPERT = FunctionProfile(
    batch=BatchLaw(overhead_s=1e-3, per_token_s=3.0e-4),
    threads=ThreadLaw(theta1=5.80e-4, theta2=1.0, theta3=8.66e-5),
    param_bytes=4 * (2 * 768 * 3072 + 3072 + 768),
)
# Segment = attention (4*768*768 + biases) + 2 LayerNorms + gate: ~9.5 MB, ~5 MFLOP/token.
_SEG_BYTES = 4 * (4 * 768 * 768 + 4 * 768 + 4 * 768 + 768 * 16)
BERT_SEGMENT = FunctionProfile(
    batch=BatchLaw(overhead_s=2e-3, per_token_s=1.6e-4),
    threads=ThreadLaw(theta1=3.09e-4, theta2=1.0, theta3=4.62e-5),
    param_bytes=_SEG_BYTES,
)
_EMBED_BYTES = 4 * (30522 + 512 + 2) * 768  # word + position + type embeddings (block 0)


def bert_profile(layers: int = 12) -> ComputeProfile:
    segs = [BERT_SEGMENT] * layers
    segs[0] = FunctionProfile(BERT_SEGMENT.batch, BERT_SEGMENT.threads,
                              _SEG_BYTES + _EMBED_BYTES)
    return ComputeProfile(
        model="bert-moe-hand", hidden_size=768, moe_layers=list(range(layers)),
        experts=dict.fromkeys(range(layers), BERT_EXPERT), segments=segs,
        bytes_per_token=768 * 4,
    )


def skewed_counts(layers: int, experts: int, tokens: int, seed: int = 0) -> np.ndarray:
    """Top-1 routing with Dirichlet(1) expert popularity per layer (seeded)."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.multinomial(tokens, rng.dirichlet(np.ones(experts)))
                     for _ in range(layers)])


def tiny_problem(
    counts: Sequence[Sequence[int]], slo_s: float, *, bytes_per_token: int = 400_000,
    memory: Sequence[int] = (128, 768, 1536), max_replicas: int = 2,
    param_bytes: int = 20_000_000, per_token_1vcpu: float = 0.01, seg_s: float = 0.5,
    warm_instances: bool = False,
) -> PlanningProblem:
    """Small explicit instance on aws-lambda-2020: U_j = per_token_1vcpu / vcpus(M_j);
    big tokens so the 6 MB payload limit binds for direct invocation at ~15 tokens."""
    spec = load_platform("aws-lambda-2020")
    u = [per_token_1vcpu / spec.vcpus(m) for m in memory]
    c = np.asarray(counts)
    return PlanningProblem.explicit(
        model="tiny", platform=spec, moe_layers=list(range(len(c))),
        num_experts=[c.shape[1]] * len(c), num_blocks=len(c), counts_LE=c,
        expert_param_bytes=param_bytes, bytes_per_token=bytes_per_token,
        memory_options_mb=memory, per_token_s=u, slo_s=slo_s, segment_time_s=seg_s,
        segment_param_bytes=5_000_000, max_replicas=max_replicas,
        warm_instances=warm_instances,
        extra_per_token_s={spec.baseline_memory(): [per_token_1vcpu / spec.vcpus(
            spec.baseline_memory())] * len(c)},
    )


def layer_configs(p: PlanningProblem, li: int) -> list[tuple[float, float, tuple]]:
    """Every (latency, cost, config) of one layer, by enumeration with scalar formulas."""
    rates = Rates.of(p)
    d = [int(x) for x in p.counts(li)]
    head = head_s(rates, p.expert_param_bytes[li])
    opts = [(j, g) for j in range(len(p.memory_options_mb))
            for g in range(1, p.max_replicas + 1)]
    out = []
    for a in (1, 2, 3):
        betas = range(1, max(d) + 1) if a == 1 and max(d) > 0 else [1]
        for beta in betas:
            for combo in itertools.product(opts, repeat=len(d)):
                cost, t_max, r_max, ok = 0.0, 0.0, 0, True
                for di, (j, g) in zip(d, combo, strict=True):
                    r = math.ceil(di / g)
                    mem = p.memory_options_mb[j]
                    if memory_need_bytes(p, li, r) > mem * MB:
                        ok = False
                        break
                    if di == 0:
                        continue
                    if a == 3 and r * max(p.bytes_in, p.bytes_out) > rates.payload:
                        ok = False
                        break
                    t = float(replica_time(a, r, p.per_token_s_LJ[li, j], head, beta, rates,
                                           p.bytes_in, p.bytes_out))
                    puts, gets = requests_per_replica(a, int(n_blocks(r, beta)),
                                                      p.warm_instances)
                    price = p.platform.compute_cost(mem, 1.0)
                    # warm instances: the platform bills the handler, not the warm start
                    t_bill = t - rates.warm_s if p.warm_instances else t
                    cost += g * (price * billed_s(t_bill, rates) + rates.per_request
                                 + puts * rates.per_put + gets * rates.per_get)
                    t_max, r_max = max(t_max, t), max(r_max, r)
                if not ok or (a == 1 and r_max and beta > r_max):
                    continue
                lat = layer_latency(a, t_max, r_max, float(sum(d)), p.load_s(li), rates,
                                    p.bytes_out)
                cost += layer_transfer_usd(p, li, a, rates.per_put, rates.per_get)
                out.append((lat, cost, (a, beta, combo)))
    return out


Configs = list[list[tuple[float, float, tuple]]]


def all_configs(p: PlanningProblem) -> Configs:
    """``layer_configs`` of every layer (independent of the SLO: compute once)."""
    return [layer_configs(p, li) for li in range(p.num_moe_layers)]


def brute_force_optimum(
    p: PlanningProblem, methods: Sequence[int] = (1, 2, 3), configs: Configs | None = None
) -> float:
    """Exact min cost (inf if infeasible) over every configuration of every layer."""
    per_layer = []
    for cfgs in configs or all_configs(p):
        pts = sorted((lat, c) for lat, c, cfg in cfgs if cfg[0] in methods)
        front, best = [], math.inf  # dropping dominated points keeps the optimum
        for lat, c in pts:
            if c < best:
                front.append((lat, c))
                best = c
        per_layer.append(front)
    budget = p.slo_s - p.fixed_latency_s
    best_cost = math.inf
    for combo in itertools.product(*per_layer):
        if sum(x[0] for x in combo) <= budget + 1e-9:
            best_cost = min(best_cost, sum(x[1] for x in combo))
    return best_cost


def planned_cost(p: PlanningProblem, predicted: dict[str, float]) -> float:
    """What the planners optimise, comparable with :func:`brute_force_optimum`: the plan's
    cost less the per-batch LIST and the replicas' minibatch polls (costmodel.Estimate)."""
    rates = Rates.of(p)
    return (predicted["cost_usd"] - predicted["poll_usd"]
            - batch_requests(p).usd(rates.per_put, rates.per_get))
