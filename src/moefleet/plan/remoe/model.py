"""Remoe's cost and latency model (paper eqs. 1-10) and LPT partitioning.

A :class:`Layout` fixes the decisions: where the main function's experts run (``kind``),
its CPU memory w, the remote set x_l, the remote memory y_l, the replicas z_l and the LPT
partition of each remote set. :func:`evaluate` returns the expected prefill time PT
(eqs. 1-3), decode time GT (eqs. 4-5), TTFT and TPOT (III-B3), the main cost C_loc
(eqs. 6-7) and the remote costs PC_rem, GC_rem (eqs. 8-9).

Expected values stand in for the routing s_{l,k,i}: prefill counts are E[N_pre]; a decode
token sends h_l = K·Σ_remote s to the remote function (its work) and calls it with
probability q_l = 1 − (1 − Σ_remote s)^K (its invocation overhead t_rem, paid once per
call). The remote path is the decode bottleneck the paper assumes only when it is; we
keep eq. 5's max.

Layout kinds: ``remoe`` (GPU non-experts + CPU local experts + remote functions),
``mix`` (the same with nothing remote), ``cpu`` (one CPU function, non-experts on CPU
too), ``gpu`` (everything on the GPU), ``fetch`` (ideal offloading: every expert cached
in CPU memory, the needed ones already on the GPU, no transfer time).
"""

from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np

from moefleet.plan.remoe.problem import RemoeProblem

Kind = Literal["remoe", "mix", "cpu", "gpu", "fetch"]
KINDS: tuple[Kind, ...] = ("remoe", "cpu", "gpu", "mix", "fetch")


def lpt(sizes: list[float] | np.ndarray, z: int) -> list[list[int]]:
    """Longest Processing Time: items by decreasing size, each to the least loaded of z
    bins (ties: lowest bin). Makespan <= (4/3 − 1/(3z))·OPT (Graham 1969)."""
    bins: list[list[int]] = [[] for _ in range(max(1, z))]
    heap = [(0.0, j) for j in range(len(bins))]
    order = sorted(range(len(sizes)), key=lambda i: (-float(sizes[i]), i))
    for i in order:
        load, j = heapq.heappop(heap)
        bins[j].append(i)
        heapq.heappush(heap, (load + float(sizes[i]), j))
    return bins


@dataclass(frozen=True)
class Layout:
    """The decisions of one deployment. ``remote_LE`` is x; ``remote_mb[l]`` is y_l (0
    where layer l has no remote experts); ``groups[l]`` is the LPT partition of layer l's
    remote experts over its z_l = len(groups[l]) replicas (expert ids)."""

    kind: Kind
    main_mb: int
    remote_LE: np.ndarray
    remote_mb: tuple[int, ...]
    groups: tuple[tuple[tuple[int, ...], ...], ...]

    @property
    def replicas(self) -> list[int]:
        return [len(g) for g in self.groups]


@dataclass
class Estimate:
    """Expected times (s) and costs (USD) of one request under a layout."""

    pt_s: float
    gt_s: float
    ttft_s: float
    tpot_s: float
    cold_s: float
    c_loc: float
    pc_rem: float
    gc_rem: float
    gpu_gb: float
    main_gb: float
    layer_prefill_s: list[float] = field(default_factory=list)
    layer_decode_s: list[float] = field(default_factory=list)

    @property
    def cost(self) -> float:
        return self.c_loc + self.pc_rem + self.gc_rem

    def meets(self, p: RemoeProblem, tol: float = 1e-9) -> bool:
        return (self.ttft_s <= p.ttft_slo_s * (1 + tol)
                and self.tpot_s <= p.tpot_slo_s * (1 + tol))

    def to_dict(self) -> dict[str, float]:
        d = {k: v for k, v in asdict(self).items() if not isinstance(v, list)}
        d["cost_usd"] = self.cost
        return d


def _gpu_expert_bytes(p: RemoeProblem, kind: Kind) -> float:
    if kind == "gpu":
        return p.num_layers * p.num_experts * p.expert_bytes
    if kind == "fetch":
        # The buffer for the experts one layer needs at once: at most those prefill hits.
        distinct = float(np.max(np.sum(1.0 - (1.0 - p.s_LE) ** (p.n_in * p.top_k), 1)))
        return distinct * p.expert_bytes
    return 0.0


def main_need_mb(p: RemoeProblem, kind: Kind, remote_LE: np.ndarray) -> float:
    """Constraint (10f): CPU memory the main function must hold (MB), plus the host
    memory its runtime takes (and its CUDA runtime's, when the main has a GPU): a main
    sized without them would not start on the platform."""
    runtime = p.runtime_mb + (p.gpu_runtime_mb if kind != "cpu" and p.has_gpu else 0.0)
    local = float(np.sum(~remote_LE)) * p.expert_bytes
    tokens = p.token_bytes * p.n_out
    if kind == "cpu":  # non-experts and the KV cache live in CPU memory too
        local += p.nonexpert_bytes + (p.n_in + p.n_out) * (p.token_bytes
                                                           + p.kv_bytes_per_token)
    if kind == "gpu":
        local = 0.0
    return (local + tokens) / 2**20 + runtime


def remote_need_mb(p: RemoeProblem, remote_E: np.ndarray, layer: int) -> float:
    """Constraint (10e): the remote function of a layer holds its experts and tokens
    (and its runtime, when it holds any)."""
    n = p.prefill_tokens_LE[layer]
    held = float(np.sum(remote_E * (p.expert_bytes + p.token_bytes * n))) / 2**20
    return held + (p.runtime_mb if bool(np.any(remote_E)) else 0.0)


def remote_decode_s(p: RemoeProblem, share: np.ndarray, y_gb: np.ndarray) -> np.ndarray:
    """r_l(y): expected remote-path time per decode token (eq. 5's second term)."""
    h = p.top_k * share
    q = np.where(share > 0, 1.0 - (1.0 - np.minimum(share, 1.0)) ** p.top_k, 0.0)
    wire = 2.0 * p.token_bytes / p.transfer_bytes_s
    return h * (p.expert_s_array(y_gb) + wire) + q * p.invoke_overhead_s


def prefill_layer(p: RemoeProblem, li: int, remote_E: np.ndarray, t_loc: float,
                  y_gb: float, groups: tuple[tuple[int, ...], ...]) -> tuple[float, list[float]]:
    """Eq. 2 without τ_sw: max(local experts in turn, slowest replica), and the replicas'
    run times ZT_{l,j} (eq. 3). ``t_loc`` is a local expert's time per prompt token;
    remote experts compute at T(y)·prefill_factor per token (a batch, not one token)."""
    n_E = p.prefill_tokens_LE[li]
    loc = float(np.sum(n_E[~remote_E])) * t_loc
    if not remote_E.any():
        return loc, []
    unit = p.expert_s(y_gb) * p.prefill_factor + 2.0 * p.token_bytes / p.transfer_bytes_s
    zt = [float(sum(n_E[k] for k in grp)) * unit + p.invoke_overhead_s for grp in groups]
    return max(loc, max(zt)), zt


@dataclass(frozen=True)
class MainTimes:
    """The main function's per-layer times under a layout (shared by :func:`evaluate`
    and the simulator): non-experts per prefill (all prompt tokens) and per decode token,
    the GPU<->CPU copies (2τ_sw) of each, a local expert's time per decode token and per
    prompt token, the main's GPU GB and its price per second, and the cold-start loads."""

    f_pre: float
    f_dec: float
    sw_pre: float
    sw_dec: float
    t_loc: float
    t_loc_pre: float
    gpu_gb: float
    main_gb: float
    rate_s: float  # c_g·M_g + CPU rate of w (eq. 6's bracket)
    main_experts: float  # experts the main function loads at a cold start
    biggest_group: int  # experts in the largest remote replica


def main_times(p: RemoeProblem, lay: Layout) -> MainTimes:
    x = np.asarray(lay.remote_LE, bool)
    main_gb = p.gb(lay.main_mb)
    on_gpu = lay.kind in ("gpu", "fetch")
    gpu_gb = 0.0 if lay.kind == "cpu" else p.gpu_memory_gb(_gpu_expert_bytes(p, lay.kind))
    # The main's CPU work at its share of a vCPU costs more per step below one (measured
    # factors; 1 without them): its non-experts on a CPU main, its local CPU experts.
    held_dec, held_pre = p.held_factors(main_gb / p.law.gb_per_vcpu)
    cpu_slot = p.expert_s(main_gb)  # a local expert's slot on the main's CPU share
    if lay.kind == "cpu":
        speed = cpu_slot / p.law.one_vcpu_s
        f_dec = p.nonexpert_cpu_token_s * speed * held_dec
        per_prompt = held_pre * (p.nonexpert_cpu_prefill_token_s * speed
                                 if p.nonexpert_cpu_prefill_token_s >= 0
                                 else p.nonexpert_cpu_token_s * speed * p.prefill_factor)
        f_pre = p.n_in * per_prompt
        sw_pre = sw_dec = 0.0
    else:
        f_pre, f_dec = p.n_in * p.nonexpert_prefill_token_s, p.nonexpert_token_s
        sw_pre = 0.0 if on_gpu else 2 * p.swap_s(p.n_in)
        sw_dec = 0.0 if on_gpu else 2 * p.swap_s(p.top_k)
    t_loc = p.gpu_expert_token_s if on_gpu else cpu_slot * held_dec
    # A prompt batch runs faster per token than one decode token (compute- vs read-bound).
    t_loc_pre = (t_loc * p.nonexpert_prefill_token_s / max(p.nonexpert_token_s, 1e-30)
                 if on_gpu else cpu_slot * held_pre * p.prefill_factor)
    # Monolithic layouts load every expert (Fetch caches them all in CPU memory).
    main_experts = float(np.sum(~x)) if lay.kind in ("remoe", "mix") else float(x.size)
    biggest = max((len(g) for gs in lay.groups for g in gs), default=0)
    return MainTimes(f_pre, f_dec, sw_pre, sw_dec, t_loc, t_loc_pre, gpu_gb, main_gb,
                     p.gpu_price_gb_s * gpu_gb + p.cpu_rate(main_gb), main_experts, biggest)


def evaluate(p: RemoeProblem, lay: Layout) -> Estimate:
    """Eqs. 1-10 for one request under ``lay`` (see the module docstring)."""
    L = p.num_layers
    x = np.asarray(lay.remote_LE, bool)
    m = main_times(p, lay)
    y_gb = np.array([p.gb(mb) for mb in lay.remote_mb], np.float64)
    pre, dec, pc_rem = [], [], 0.0
    share = np.sum(p.s_LE * x, axis=1)
    r_dec = remote_decode_s(p, share, np.maximum(y_gb, 1e-6))
    for li in range(L):
        t_pre, zt = prefill_layer(p, li, x[li], m.t_loc_pre, float(y_gb[li]),
                                  lay.groups[li])
        pre.append(m.f_pre + m.sw_pre + t_pre)  # eq. 1
        pc_rem += p.cpu_rate(float(y_gb[li])) * sum(zt)  # eq. 8
        loc_dec = p.top_k * float(np.sum(p.s_LE[li][~x[li]])) * m.t_loc
        dec.append(m.f_dec + m.sw_dec + max(loc_dec, float(r_dec[li])))  # eqs. 4-5
    pt, gt = sum(pre), p.n_out * sum(dec)
    cold = p.cold_s(m.main_experts, m.biggest_group)
    c_loc = (pt + gt) * m.rate_s  # eq. 6
    gc_rem = float(p.n_out * np.sum(p.cpu_rate(y_gb) * r_dec))  # eq. 9
    return Estimate(pt, gt, pt + cold, gt / p.n_out, cold, c_loc, pc_rem, gc_rem,
                    m.gpu_gb, m.main_gb, pre, dec)
