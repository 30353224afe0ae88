"""Run batches through a deployment, layer by layer, with ODS/BO's scatter-gather methods.

    seg-l pre (attn, gate, scatter) -> expert replicas -> seg-l post (gather, residual) -> seg-l+1

Shape legend: B batch, T sequence, N = B*T tokens, D hidden, K top-k.

The executor is the coordinator (an orchestrator outside the functions, like a step
function): it never holds weights. Per MoE layer with method
- ``direct``: it receives x from seg-l, sends each replica its tokens in the payload, sums
  the weighted outputs (checked gather) and hands them to seg-l ``post``;
- ``storage`` / ``pipelined``: seg-l uploads every replica's input objects (one, or one per
  β tokens), the replicas download/compute/upload (pipelined: overlapped in threads), and
  seg-l ``post`` downloads and sums them; the executor passes only object keys and checks
  the post function gathered exactly the shares it expects. Pipelined (ODS/BO's gate →
  expert overlap): seg-l publishes its routing before the minibatches, the executor
  invokes the replicas as soon as the routing is in the store, while seg-l is still
  uploading, and each replica waits for its next minibatch (polling GETs, billed).
Replicas split an expert's tokens in chunks of ceil(d/g) (:func:`scatter.assign`). Tensors
between the executor and segments travel inline, or through the store when they would
exceed the payload limit. Padding positions never reach an expert (the gate marks their
slots -1; their MoE output is 0). Invariant (tested): outputs at real tokens equal
``adapter.reference_forward``
(same routing) to 1e-4 in fp32, for every method.

Timings per MoE layer: ``scatter_s`` (uploads inside seg-l pre), ``experts_s`` (wall time
of the layer's expert invocations, issued concurrently), ``gather_s`` (wall time of seg-l
post: download + combine); ``moe_s`` is their sum.
"""

from __future__ import annotations

import itertools
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moefleet.platform import InvocationRecord, ObjectStore, PlatformSpec, polling
from moefleet.runtime import scatter, transfer
from moefleet.runtime.base import FunctionBackend, InvokeResult
from moefleet.runtime.calls import ExpertDirect, SegmentPost, SegmentPre, Transfer, expert_call
from moefleet.runtime.deploy import Deployment
from moefleet.runtime.errors import FunctionError, GatherError, PayloadTooLargeError
from moefleet.runtime.handlers import skipped_NK
from moefleet.runtime.messages import encode
from moefleet.runtime.payload import Packet, pack, pack_spilling, resolve, unpack

# record -> {request id: share of its cost}
Attribution = tuple[InvocationRecord, dict[str, float]]


@dataclass
class LayerStats:
    layer: int
    method: str
    beta: int
    scatter_s: float = 0.0
    experts_s: float = 0.0
    gather_s: float = 0.0
    invocations: int = 0
    token_slots: int = 0

    @property
    def moe_s(self) -> float:
        return self.scatter_s + self.experts_s + self.gather_s


@dataclass
class BatchResult:
    """One batch: the model output, its end-to-end latency and what it cost (records)."""

    output: torch.Tensor
    latency_s: float
    layers: list[LayerStats]
    attribution: list[Attribution]
    request_ids: list[str]
    tokens: int  # real (unpadded) tokens
    positions: int  # B*T, padding included (every position is computed)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def records(self) -> list[InvocationRecord]:
        return [r for r, _ in self.attribution]


def _pick(packet: Packet, *names: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Forward named values as they came: inline tensors stay inline, refs stay refs."""
    t = {n: packet.tensors[n] for n in names if n in packet.tensors}
    r = {n: packet.refs[n] for n in names if n in packet.refs}
    missing = set(names) - set(t) - set(r)
    if missing:
        raise GatherError(f"a segment function returned no {sorted(missing)}",
                          "the deployment's handlers are out of date; redeploy")
    return t, r


class Executor:
    """Runs batches on ``backend`` for ``deployment``; ``store`` is the object store the
    functions use (needed for storage methods and for tensors over the payload limit)."""

    def __init__(self, deployment: Deployment, backend: FunctionBackend,
                 store: ObjectStore | None, platform: PlatformSpec, *,
                 max_parallel: int = 32) -> None:
        self._caller = transfer.CallerStore(deployment.plan, store, "the executor")
        self.dep = deployment
        self.backend = backend
        self.platform = platform
        self.limit = backend.max_inline_bytes  # spill bigger packets to the store
        self.store = self._caller.store  # its requests are billed separately
        self.run_id = uuid.uuid4().hex[:8]
        # direct shares over the payload limit sent as extra invocations (see
        # scatter.fit_payload): a plan whose predictions undercounted an expert
        self.oversize_splits = 0
        self._batches = itertools.count()
        self._pool = ThreadPoolExecutor(max_parallel, thread_name_prefix="moefleet-exec")
        # The gate call of a pipelined layer runs here while its experts start.
        self._side = ThreadPoolExecutor(1, thread_name_prefix="moefleet-gate")
        # replicas per expert id, from the placement (one function per expert today)
        self._replicas = {lp.layer: [deployment.placement.holder(lp.layer, i).replicas
                                     for i in range(len(lp.experts))]
                          for lp in deployment.plan.layers}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._side.shutdown(wait=True)

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one invocation ------------------------------------------------------------------
    def _invoke(self, fn: str, tensors: dict[str, torch.Tensor], refs: dict[str, str],
                meta: dict[str, Any], prefix: str, shares: dict[str, float],
                out: list[Attribution], spill: bool = True) -> tuple[Packet, float]:
        t0 = time.perf_counter()
        if spill:  # segment I/O may go through the store when it is too big to send
            body = pack_spilling(tensors, meta, refs, max_bytes=self.limit, store=self.store,
                                 prefix=f"{prefix}/in-{fn}-{uuid.uuid4().hex[:6]}")
        else:  # 'direct' means the tokens travel in the payload, or not at all
            body = pack(tensors, meta, refs)
        res: InvokeResult = self.backend.invoke(fn, body)
        out.append((res.record, shares))
        return unpack(res.payload), time.perf_counter() - t0

    # -- one batch -----------------------------------------------------------------------
    def run_batch(self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None = None,
                  request_ids: list[str] | None = None) -> BatchResult:
        B, T = input_ids_BT.shape
        batch_no = next(self._batches)
        rids = request_ids or [f"{self.run_id}:{batch_no}:{b}" for b in range(B)]
        if len(rids) != B:
            raise ValueError(f"{len(rids)} request ids for {B} rows")
        real_B = (attention_mask_BT.numpy().sum(1).tolist() if attention_mask_BT is not None
                  else [T] * B)
        row_share = _normalise(dict(zip(rids, real_B, strict=True)))
        prefix = f"{self.dep.prefix}/runs/{self.run_id}/b{batch_no}"
        att: list[Attribution] = []
        layers: list[LayerStats] = []
        t_start = time.perf_counter()
        try:
            out = self._forward(input_ids_BT, attention_mask_BT, rids, row_share, prefix, att,
                                layers)
        finally:
            self._cleanup(prefix)
        return BatchResult(out, time.perf_counter() - t_start, layers, att, rids,
                           int(sum(real_B)), B * T)

    def _forward(self, ids_BT: torch.Tensor, mask_BT: torch.Tensor | None, rids: list[str],
                 row_share: dict[str, float], prefix: str, att: list[Attribution],
                 layers: list[LayerStats]) -> torch.Tensor:
        inputs: dict[str, torch.Tensor] = {"input_ids_BT": ids_BT}
        if mask_BT is not None:
            inputs["attention_mask_BT"] = mask_BT
        refs: dict[str, str] = {}
        ctx_t: dict[str, torch.Tensor] = {}
        ctx_r: dict[str, str] = {}
        ctx_skel: dict[str, Any] | None = None
        moe = set(self.dep.moe_layers)
        T = ids_BT.shape[1]
        for block in range(self.dep.num_layers):
            seg = self.dep.segment_function(block)
            lp = self.dep.plan.layer(block) if block in moe else None
            spread = None
            if lp is not None and lp.method != "direct":
                spread = Transfer(prefix, lp.method, lp.beta,
                                  tuple(self._replicas[block])).to_json()
            meta = encode(SegmentPre(ctx_skel, f"{prefix}/spill-{block}-pre", spread))
            early_s: float | None = None
            if lp is not None and lp.method == "pipelined":
                gate = self._side.submit(self._invoke, seg, {**inputs, **ctx_t},
                                         {**refs, **ctx_r}, meta, prefix, row_share, att)
                ids_early = self._wait_route(prefix, block, gate)
                t0 = time.perf_counter()
                self._indirect(block, lp.method, lp.beta,
                               scatter.assign(block, ids_early, self._replicas[block]), rids,
                               T, prefix, att)
                early_s = time.perf_counter() - t0
                pre, _ = gate.result()
            else:
                pre, _ = self._invoke(seg, {**inputs, **ctx_t}, {**refs, **ctx_r}, meta,
                                      prefix, row_share, att)
            if block == 0:
                names = [n for n in pre.names() if n.startswith("ctx.")]
                ctx_t, ctx_r = _pick(pre, *names)
                ctx_skel = pre.meta["ctx"]
            if lp is None:
                name = "out" if block == self.dep.num_layers - 1 else "h_BTD"
                inputs, refs = _pick(pre, name)
                continue
            stats = LayerStats(block, lp.method, lp.beta,
                               scatter_s=float(pre.meta.get("scatter_s", 0.0)))
            resolve(pre, self.store, {"ids_NK", "w_NK"})
            ids_NK, w_NK = pre.tensors["ids_NK"], pre.tensors["w_NK"]
            shares = scatter.assign(block, ids_NK, self._replicas[block])
            stats.token_slots = sum(s.size for s in shares)
            stats.invocations = len(shares)
            post_t, post_r = _pick(pre, "residual_BTD", "x_BTD")
            gather = None
            t0 = time.perf_counter()
            if lp.method == "direct":
                post_t["routed_ND"] = self._direct(block, pre, shares, w_NK, rids, T, prefix,
                                                   att)
            else:
                if early_s is None:
                    self._indirect(block, lp.method, lp.beta, shares, rids, T, prefix, att)
                post_t["ids_NK"] = ids_NK
                gather = Transfer(prefix, lp.method, lp.beta,
                                  tuple(self._replicas[block])).to_json()
            post_meta = encode(SegmentPost(ctx_skel, f"{prefix}/spill-{block}-post", gather))
            stats.experts_s = time.perf_counter() - t0 if early_s is None else early_s
            if block == self.dep.num_layers - 1:
                post_t.update(ctx_t)
                post_r.update(ctx_r)
            post, stats.gather_s = self._invoke(seg, post_t, post_r, post_meta, prefix,
                                                row_share, att)
            if lp.method != "direct":
                expected = [[s.label, s.size] for s in shares]
                if post.meta.get("gathered") != expected:
                    raise GatherError(
                        f"layer {block}: {seg} gathered {post.meta.get('gathered')}, "
                        f"expected {expected}", "a replica's output went missing; retry")
            layers.append(stats)
            name = "out" if block == self.dep.num_layers - 1 else "h_BTD"
            inputs, refs = _pick(post, name)
        packet = Packet(tensors=inputs, refs=refs)
        resolve(packet, self.store)
        return packet.tensors["out"]

    def _direct(self, layer: int, pre: Packet, shares: list[scatter.Share], w_NK: torch.Tensor,
                rids: list[str], T: int, prefix: str, att: list[Attribution]) -> torch.Tensor:
        resolve(pre, self.store, {"x_BTD"})
        x_BTD = pre.tensors["x_BTD"]
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        # Slice on this thread: torch ops from many threads each spin up an OpenMP team,
        # which starves the workers on a small machine. Pool threads only move bytes.
        jobs = []
        pieces: list[scatter.Share] = []
        for share in shares:
            x_nD, w_n = scatter.share_inputs(share, x_ND, w_NK)
            fn = self.dep.expert_function(layer, share.expert)
            row_bytes = x_nD.shape[1] * x_nD.element_size() + w_n.element_size()
            cut = scatter.fit_payload(share, row_bytes, self.limit)
            self.oversize_splits += len(cut) - 1
            for piece, s, e in cut:
                pieces.append(piece)
                jobs.append((fn, {"x": x_nD[s:e], "w": w_n[s:e]},
                             encode(ExpertDirect(((share.expert, piece.size),))),
                             _token_share(piece, rids, T)))

        def one(job: tuple[str, dict[str, torch.Tensor], dict[str, Any], dict[str, float]]
                ) -> torch.Tensor:
            fn, tensors, meta, shares_by_request = job
            try:
                packet, _ = self._invoke(fn, tensors, {}, meta, prefix, shares_by_request, att,
                                         spill=False)
            except PayloadTooLargeError as err:
                raise PayloadTooLargeError(
                    f"{err.message} (layer {layer} uses method 'direct')",
                    f"give layer {layer}'s experts more replicas (each gets ceil(d/g) tokens)"
                    ", send smaller batches, or use method 'storage' or 'pipelined'") from err
            resolve(packet, self.store)
            return packet.tensors["y"]

        parts = list(zip(pieces, self._pool.map(one, jobs), strict=True))
        return scatter.gather(layer, x_ND.shape[0], w_NK.shape[1], parts, x_ND,
                              skipped_NK(pre.tensors["ids_NK"]))

    def _indirect(self, layer: int, method: str, beta: int, shares: list[scatter.Share],
                  rids: list[str], T: int, prefix: str, att: list[Attribution]) -> None:
        jobs = []
        for share in shares:
            in_keys, out_keys = scatter.share_keys(
                prefix, share, scatter.object_beta(method, beta, share.size))
            meta = encode(expert_call(method, share.expert, in_keys, out_keys, share.size))
            jobs.append((share, meta, _token_share(share, rids, T)))

        def one(job: tuple[scatter.Share, dict[str, Any], dict[str, float]]) -> None:
            share, meta, shares_by_request = job
            fn = self.dep.expert_function(layer, share.expert)
            packet, _ = self._invoke(fn, {}, {}, meta, prefix, shares_by_request, att)
            if packet.meta.get("tokens") != share.size:
                raise GatherError(f"layer {layer}: replica {share.label} processed "
                                  f"{packet.meta.get('tokens')} of {share.size} tokens",
                                  "a replica returned early; retry the batch")

        list(self._pool.map(one, jobs))

    def _wait_route(self, prefix: str, layer: int, gate: Any) -> torch.Tensor:
        """``ids_NK`` of a pipelined layer once its gate has published it (module doc)."""
        assert self.store is not None  # pipelined layers need a store (checked in __init__)
        key = scatter.route_key(prefix, layer)
        for delay in polling.delays(*polling.ROUTE_POLL):  # each ask is billed (costmodel)
            if self.store.exists(key):
                return unpack(self.store.get(key)).tensors["ids_NK"]
            if gate.done():
                gate.result()  # the gate failed: raise its error
                raise FunctionError(f"layer {layer}: the gate returned without publishing "
                                    "its routing", "redeploy: the segment code is stale")
            time.sleep(delay)
        raise AssertionError("unreachable: delays() never ends")

    def _cleanup(self, prefix: str) -> None:
        if self.store is None:
            return
        for key in self.store.list(prefix + "/"):
            self.store.delete(key)

    def client_requests(self) -> tuple[int, int]:
        """(PUT+LIST, GET) requests the executor itself made (billed as storage)."""
        return self._caller.requests()


def _normalise(weights: dict[str, float]) -> dict[str, float]:
    total = sum(weights.values())
    if total <= 0:
        return {k: 1.0 / len(weights) for k in weights}
    return {k: v / total for k, v in weights.items() if v > 0}


def _token_share(share: scatter.Share, rids: list[str], T: int) -> dict[str, float]:
    rows = np.bincount(share.tokens_n // T, minlength=len(rids)).tolist()
    return _normalise({rid: float(n) for rid, n in zip(rids, rows, strict=True)})
