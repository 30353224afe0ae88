"""The MoE pipeline as a DAG, and sMoE's state features of its nodes.

Nodes: one per segment function (``seg-b``) and one per expert (``exp-b-i``), in
topological order. Edges: ``seg-b -> exp-b-*`` (scatter) and ``exp-b-* -> seg-(b+1)``
(gather) for an MoE block b, ``seg-b -> seg-(b+1)`` otherwise. The segment's own gather
half runs in the same function as its scatter half, so the DAG routes the gather edge
to the next segment; that keeps it acyclic. Topological batches: the sets of nodes at
the same depth (a segment alone, then a layer's experts together).

Decision groups (what the pointer network and the critic see at once): the experts of
each MoE layer, in layer order, then one group of all segment functions. Rewards are per
group (eq. 13); the last group also carries the SLO term.

Features (``F`` per node, all roughly in [0, 1] or log-scaled):
expert level - resource utilisation, concurrency utilisation, tail latency / SLO,
current config (memory, replicas, concurrency scaled like :class:`ConfigSpace`), log
tokens/s, log requests/s, queued calls, cold starts; layer level (0 for segments) -
token share, request share, routing entropy / log K, variance of tail latency / SLO
within the layer, straggler ratio (own tail latency / the layer's worst), log layer
GFLOP/s; snapshot level - log request rate, P95 / SLO, log in-flight requests. A
configuration space with a GPU axis adds one feature, the current GPU share (so a
CPU-only space keeps its ``NUM_FEATURES`` and older checkpoints their input width).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moefleet.autoscale.errors import AutoscaleError
from moefleet.control import FunctionMetrics, MetricsSnapshot
from moefleet.plan.plan import DeploymentPlan
from moefleet.profiles.model import ComputeProfile

NUM_FEATURES = 22


def num_features(gpu: bool) -> int:
    """Features per node: ``NUM_FEATURES``, plus the GPU share in a GPU space."""
    return NUM_FEATURES + (1 if gpu else 0)


@dataclass(frozen=True)
class PipelineDAG:
    """Node names in topological order, predecessor lists, depths, decision groups."""

    names: tuple[str, ...]
    kinds: tuple[str, ...]  # "segment" | "expert"
    preds: tuple[tuple[int, ...], ...]
    depth: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]  # MoE layers' experts, then all segments
    param_bytes: tuple[int, ...]
    flops_per_token: tuple[float, ...]
    bytes_per_token: int
    model: str

    @classmethod
    def from_plan(cls, plan: DeploymentPlan, profile: ComputeProfile) -> PipelineDAG:
        names: list[str] = []
        kinds: list[str] = []
        preds: list[tuple[int, ...]] = []
        params: list[int] = []
        flops: list[float] = []
        groups: list[tuple[int, ...]] = []
        seg_nodes: list[int] = []
        tail: tuple[int, ...] = ()
        placement = plan.placement()  # the one source of function names
        for b, seg_prof in enumerate(profile.segments):
            seg = len(names)
            names.append(placement.segment(b).name)
            kinds.append("segment")
            preds.append(tail)
            params.append(seg_prof.param_bytes)
            flops.append(2.0 * seg_prof.param_bytes / 4)
            seg_nodes.append(seg)
            tail = (seg,)
            held = placement.expert_functions(b) if b in profile.experts else []
            if not held:
                continue
            law = profile.experts[b]
            members = []
            for f in held:
                members.append(len(names))
                names.append(f.name)
                kinds.append("expert")
                preds.append((seg,))
                params.append(law.param_bytes * len(f.experts))
                flops.append(2.0 * law.param_bytes / 4)
            groups.append(tuple(members))
            tail = tuple(members)
        groups.append(tuple(seg_nodes))
        depth: list[int] = []
        for p in preds:
            depth.append(1 + max((depth[q] for q in p), default=-1))
        if set(names) != set(plan.function_names()):
            raise AutoscaleError("the plan's functions do not match the model profile",
                                 "plan and profile must describe the same model")
        return cls(tuple(names), tuple(kinds), tuple(preds), tuple(depth), tuple(groups),
                   tuple(params), tuple(flops), profile.bytes_per_token, plan.model)

    @property
    def num_nodes(self) -> int:
        return len(self.names)

    def levels(self) -> list[list[int]]:
        """Topological batches: node indices by depth (a node's predecessors are all in
        earlier batches)."""
        out: list[list[int]] = [[] for _ in range(max(self.depth) + 1)]
        for v, d in enumerate(self.depth):
            out[d].append(v)
        return out

    def pred_mask(self) -> torch.Tensor:
        """Bool [N, N]: ``m[v, u]`` iff u is a predecessor of v."""
        m = torch.zeros(self.num_nodes, self.num_nodes, dtype=torch.bool)
        for v, ps in enumerate(self.preds):
            for u in ps:
                m[v, u] = True
        return m

    def group_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``idx [G, K]`` node indices per group (padded with 0) and ``mask [G, K]``
        (True = a real member)."""
        k = max(len(g) for g in self.groups)
        idx = torch.zeros(len(self.groups), k, dtype=torch.long)
        mask = torch.zeros(len(self.groups), k, dtype=torch.bool)
        for gi, g in enumerate(self.groups):
            idx[gi, :len(g)] = torch.tensor(g)
            mask[gi, :len(g)] = True
        return idx, mask

    def fingerprint(self) -> str:
        return f"{self.model}|{self.num_nodes}|{[len(g) for g in self.groups]}"


def _log_scaled(x: float, top: float = 1e4) -> float:
    return math.log1p(max(x, 0.0)) / math.log1p(top)


def _scaled(v: int, opts: Sequence[int]) -> float:
    lo, hi = math.log(opts[0]), math.log(opts[-1])
    return 0.0 if hi == lo else (math.log(max(v, 1)) - lo) / (hi - lo)


def node_features(dag: PipelineDAG, snap: MetricsSnapshot, slo_s: float,
                  options: tuple[Sequence[Any], ...]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [N, F]`` state features and ``peak_tokens [N]`` (largest tokens per call
    estimate, for the memory filter) from one snapshot. ``options`` = (memory,
    replicas, concurrency) option lists, and the GPU shares as a fourth in a GPU space
    (then F = NUM_FEATURES + 1, the last column the current share)."""
    if slo_s <= 0:
        raise AutoscaleError(f"SLO must be > 0 s, got {slo_s!r}")
    fm: Mapping[str, FunctionMetrics] = snap.functions
    missing = [n for n in dag.names if n not in fm]
    if missing:
        raise AutoscaleError(f"snapshot lacks functions {missing[:3]} of the pipeline",
                             "the controller and the deployment must use the same plan")
    gpu = len(options) > 3
    x = torch.zeros(dag.num_nodes, num_features(gpu))
    peak = torch.zeros(dag.num_nodes)
    p95_all = snap.p95_latency_s / slo_s
    glob = [_log_scaled(snap.request_rate_rps), min(p95_all, 10.0) / 10.0,
            _log_scaled(snap.in_flight_requests)]
    mem_o, rep_o, conc_o = options[:3]
    for v, name in enumerate(dag.names):
        m = fm[name]
        cfg = m.config
        per_call = m.tokens / m.calls if m.calls else 0.0
        peak[v] = per_call * 2.0  # ASSUMPTION: peak call ~ twice the mean call
        x[v, :11] = torch.tensor([
            m.utilisation, min(m.concurrency_utilisation, 4.0) / 4.0,
            min(m.p95_latency_s / slo_s, 10.0) / 10.0,
            _scaled(cfg.memory_mb, mem_o), _scaled(cfg.replicas, rep_o),
            _scaled(cfg.concurrency, conc_o), _log_scaled(m.tokens_per_s),
            _log_scaled(m.calls_per_s), _log_scaled(m.queued), _log_scaled(m.cold_starts),
            min(m.instances, 16) / 16.0])
        x[v, 19:NUM_FEATURES] = torch.tensor(glob)
        if gpu:
            x[v, NUM_FEATURES] = cfg.gpu_share
    fpt = {fm[dag.names[g[0]]].layer: dag.flops_per_token[g[0]] for g in dag.groups[:-1]}
    layers = snap.layers(fpt)
    for g in dag.groups[:-1]:  # MoE layers: layer-level features
        lm = layers[fm[dag.names[g[0]]].layer]
        entropy = lm.routing_entropy / math.log(len(g)) if len(g) > 1 else 0.0
        var = lm.latency_variance_s2 / (slo_s * slo_s)
        gflops_s = lm.gflops / snap.interval_s
        for v in g:
            name = dag.names[v]
            m = fm[name]
            x[v, 11:19] = torch.tensor([
                m.token_share, m.request_share, entropy, min(var, 10.0) / 10.0,
                lm.straggler_ratio[name], _log_scaled(gflops_s, 1e3), 1.0, 0.0])
    for v in dag.groups[-1]:
        x[v, 18] = 1.0  # kind flag: segment
    return x, peak
