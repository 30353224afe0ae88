"""One pass of n tokens through the MoE pipeline, as SimPy events.

    for block b: seg-b pre -> [route -> expert replicas (tokens split over replicas)
    -> barrier (last output visible) -> seg-b post] -> next block

A pass is a generator used with ``yield from`` inside a request (or decode-loop)
process. It mirrors the runtime's executor (``moefleet.runtime.segments``), an unbilled
coordinator: per block a ``pre`` call of the segment function (attention, gate, scatter
upload), then on MoE blocks the expert replica calls and a ``post`` call (gather,
combine, residual; the last block's head). The segment's profiled compute is charged to
``pre`` (the profile does not split it). Payloads over the platform limit spill through
the object store as the runtime's do; the executor's own PUT/GET requests are billed to
it (``<executor>``, like ``Meter.add_storage``).
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from typing import Any

import numpy as np
import simpy

from moefleet.control import FunctionConfig
from moefleet.models.shape import ModelShape
from moefleet.plan.plan import DeploymentPlan, LayerPlan
from moefleet.platform.billing import Meter
from moefleet.platform.specs import PlatformSpec
from moefleet.profiles.model import ComputeProfile
from moefleet.sim.config import SimConfig, SimError
from moefleet.sim.entities import Barrier, Call, Node
from moefleet.sim.functions import FunctionPool
from moefleet.sim.routing import Router
from moefleet.sim.timing import (
    Links,
    minibatches,
    payload_s,
    split_tokens,
    store_io_s,
)

_STORE = ("storage", "pipelined")


class Pipeline:
    """The deployed functions of one plan and how a pass walks through them."""

    def __init__(self, env: simpy.Environment, plan: DeploymentPlan, profile: ComputeProfile,
                 spec: PlatformSpec, shape: ModelShape, router: Router, sim: SimConfig,
                 rng: np.random.Generator, meter: Meter | None,
                 initial: Mapping[str, FunctionConfig] | None = None) -> None:
        self.env = env
        self.shape = shape
        self.router = router
        self.rng = rng
        self.meter = meter
        self.top_k = shape.top_k
        # On demand, replicas split each call's tokens (ODS/BO); as pods, a call goes to one.
        self.split = sim.scaling == "on-demand"
        self.result_bpt = sim.result_bytes_per_token  # what the last block returns
        self.links = Links.of(spec, profile.bytes_per_token)
        self.node = Node(sim.node_slots) if sim.node_slots else None
        common: dict[str, Any] = {"spec": spec, "sim": sim, "links": self.links, "meter": meter,
                                  "node": self.node}
        placement = plan.placement()
        self.segments = [
            FunctionPool(env, fn.name, "segment", b, None,
                         FunctionConfig(fn.memory_mb, 1, sim.concurrency),
                         profile=profile.segments[b], **common)
            for b, fn in enumerate(placement.segments)]
        self.experts: list[list[FunctionPool]] = []
        self.layer_plans: list[LayerPlan | None] = [None] * shape.num_layers
        self.layer_index: list[int] = [-1] * shape.num_layers
        for li, lp in enumerate(plan.layers):
            self.layer_plans[lp.layer] = lp
            self.layer_index[lp.layer] = li
            # one function per expert today: a pool's expert is its function's only one
            self.experts.append([
                FunctionPool(env, fn.name, "expert", lp.layer, fn.experts[0],
                             FunctionConfig(fn.memory_mb, fn.replicas, sim.concurrency),
                             profile=profile.expert(lp.layer), method=lp.method, beta=lp.beta,
                             **common)
                for fn in placement.expert_functions(lp.layer)])
        self.pools: dict[str, FunctionPool] = {p.name: p for p in self.all_pools()}
        n_layers = len(plan.layers)
        self.i_layer_tokens = [0] * n_layers
        self.i_layer_passes = [0] * n_layers
        self.client_puts = self.client_gets = 0
        for name, cfg in (initial or {}).items():  # deployed so from t = 0 (no restart)
            if name not in self.pools:
                raise SimError(f"initial config for unknown function {name!r}")
            self.pools[name].configure(cfg)
        if sim.prewarm:
            for p in self.all_pools():
                p.prewarm(p.config.replicas)

    def all_pools(self) -> list[FunctionPool]:
        return self.segments + [p for layer in self.experts for p in layer]

    def run_pass(self, n: int, request_id: str | None) -> Generator[simpy.Event, Any, None]:
        """Move ``n`` tokens through every block (pre -> experts -> post per MoE block)."""
        env, links, k = self.env, self.links, self.top_k
        last = len(self.segments) - 1
        for b, seg in enumerate(self.segments):
            lp = self.layer_plans[b]
            stored = lp is not None and lp.method in _STORE
            work: list[tuple[FunctionPool, int]] = []
            objects = 0
            if lp is not None:  # the gate runs in ``pre``: route now to know the objects
                work, objects = self._route(self.layer_index[b], lp, n, request_id)
            # pre: h in from the executor, compute, scatter upload, result back.
            in_s, in_spill = payload_s(n, links) if b else (0.0, False)
            out_s, out_spill = payload_s(n, links, self.result_bpt if b == last and lp is None
                                         else None)
            up_s = store_io_s(n * k, links) if stored else 0.0
            bar = Barrier(env, 1)
            seg.submit(Call(n, in_s + up_s, out_s, in_spill, objects + out_spill, bar,
                            request_id, True))
            self._client(in_spill, out_spill)
            yield bar
            if lp is None:
                continue
            yield self._scatter(lp, work, request_id)
            # post: executor sends x (+ the combined outputs when direct), gather download.
            in_s, in_spill = payload_s(n, links)
            out_s, out_spill = payload_s(n, links, self.result_bpt if b == last else None)
            down_s = store_io_s(n * k, links) if stored else 0.0
            bar = Barrier(env, 1)
            seg.submit(Call(n, in_s + down_s, out_s, objects + in_spill, out_spill, bar,
                            request_id, False))
            self._client(in_spill, out_spill)
            yield bar

    def _client(self, put: bool, get: bool) -> None:
        """The executor's own store requests for spilled payloads (billed to it)."""
        self.client_puts += put
        self.client_gets += get

    def _route(self, li: int, lp: LayerPlan, n: int, request_id: str | None
               ) -> tuple[list[tuple[FunctionPool, int]], int]:
        """Sample the layer's routing; (replica calls as (pool, tokens), stored objects)."""
        counts = self.router.counts(li, n, self.rng, request_id)
        self.i_layer_tokens[li] += n * self.top_k
        self.i_layer_passes[li] += 1
        pools = self.experts[li]
        work: list[tuple[FunctionPool, int]] = []
        for i, d in enumerate(counts.tolist()):
            if not d:
                continue
            pool = pools[i]
            pool.i_passes += 1
            pool.i_sub_tokens += d
            g = pool.config.replicas if self.split else 1
            if g == 1:
                work.append((pool, d))
            else:
                work.extend((pool, r) for r in split_tokens(d, g))
        if lp.method == "storage":
            return work, len(work)
        if lp.method == "pipelined":
            return work, sum(minibatches(r, lp.beta) for _, r in work)
        return work, 0

    def _scatter(self, lp: LayerPlan, work: list[tuple[FunctionPool, int]],
                 request_id: str | None) -> Barrier:
        """Submit every expert replica call of one MoE layer; the barrier of them all."""
        links = self.links
        bar = Barrier(self.env, len(work))
        method, beta = lp.method, lp.beta
        acc2 = 2 * links.access_s
        for pool, r in work:
            if method == "direct":
                in_s, in_spill = payload_s(r, links)
                out_s, out_spill = payload_s(r, links)
                self._client(in_spill, out_spill)
                pool.submit(Call(r, in_s, out_s, in_spill, out_spill, bar, request_id, True))
            elif method == "storage":
                pool.submit(Call(r, acc2 + 2 * links.store_s(r), 0.0, 1, 1, bar, request_id,
                                 True))
            else:  # pipelined: the pool computes the whole overlapped handler
                q = minibatches(r, beta)
                pool.submit(Call(r, 0.0, 0.0, q, q, bar, request_id, True))
        return bar
