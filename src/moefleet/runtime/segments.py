"""The segment runner: a deployment whose non-expert parts run in segment functions (ODS/BO's
layout), seen by the engine as one more runner.

    seg-l pre (attention, gate; staged methods: uploads the replicas' inputs)
      -> expert replicas -> seg-l post (gather, residual; the head on the last block)

Each engine step is one prefill batch: the step's rows, right-padded, go through every
block's segment function. The layer loop is the one loop (:func:`moefleet.models.step.
run_layers`); :class:`SegmentStack` is the :class:`~moefleet.models.step.LayerStack` whose
blocks are invocations. Activations between segments stay where the functions left them
(inline in the packets, or in the store when they exceed the payload limit); only what the
experts need reaches this process:

- ``direct`` layers: ``x`` and the routing come back here and the expert stack (retries,
  brownout, remote dispatch: seam 1) runs on the real token rows;
- ``storage`` / ``pipelined`` layers: the segment uploads each replica's inputs itself (under
  the pipelined method it publishes its routing first and the replicas start on it while it
  still uploads), :meth:`StagedExperts.run_staged` invokes the replicas, and the segment's
  ``post`` downloads and gathers their outputs (checked: exactly the shares expected).

Only prompts: a segment function keeps no state between invocations, so there is no KV
cache and no decode step. A step asking to decode, or a prompt chunked over several steps,
is refused with :class:`SegmentLayoutError`. Prefill-only requests (``max_tokens`` 0) score
prompts; a request for one token gets its first token (sampled from the last position).

Billing: every segment invocation's record is split over the step's requests by their real
tokens (:meth:`SegmentRunner.drain`, the biller reads it beside the remote experts').
Shape legend: B rows, T tokens (padded), N = B*T, D hidden, K top-k, V vocabulary.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from moefleet.engine.request import EngineError
from moefleet.engine.runner import RunnerOutput, StepExperts, StepFailedError
from moefleet.engine.scheduler import SchedulerOutput
from moefleet.models.step import StepInput, run_layers
from moefleet.platform import ObjectStore, polling
from moefleet.runtime import scatter, transfer
from moefleet.runtime.base import FunctionBackend
from moefleet.runtime.calls import SegmentPost, SegmentPre, Transfer
from moefleet.runtime.deploy import Deployment
from moefleet.runtime.errors import FunctionError, GatherError
from moefleet.runtime.messages import encode
from moefleet.runtime.payload import Packet, pack_spilling, resolve, unpack
from moefleet.runtime.replies import AttributedCalls, Attribution

UNBOUNDED_BLOCKS = 1 << 30  # no KV cache: the scheduler's block count never binds


class SegmentLayoutError(EngineError):
    """A step the segment layout cannot run (decode, a chunked prompt)."""


class StagedExperts(Protocol):
    """Remote dispatch for inputs a segment function staged in the store (the expert
    stack's ``RemoteExperts`` is one)."""

    def run_staged(self, layer: int, ids_NK: torch.Tensor, prefix: str,
                   owners_N: Sequence[str] | None = None) -> list[scatter.Share]: ...


@dataclass
class LayerTimes:
    """Wall time per step of one MoE layer: ``scatter_s`` (uploads inside seg pre),
    ``experts_s`` (the layer's expert calls), ``gather_s`` (seg post); one entry a step."""

    method: str
    beta: int
    scatter_s: list[float] = field(default_factory=list)
    experts_s: list[float] = field(default_factory=list)
    gather_s: list[float] = field(default_factory=list)

    @property
    def moe_s(self) -> list[float]:
        # a step that failed half-way leaves its layer's lists uneven: count whole steps
        return [a + b + c for a, b, c in zip(self.scatter_s, self.experts_s, self.gather_s,
                                             strict=False)]


@dataclass
class _Handle:
    """Activations a segment returned, inline or by reference; ``pending`` is a pipelined
    gate still uploading (its packet comes when it returns)."""

    packet: Packet | None
    pending: Future[tuple[Packet, float]] | None = None
    shares: list[scatter.Share] = field(default_factory=list)
    ids_NK: torch.Tensor | None = None
    scatter_s: float = 0.0

    def result(self) -> Packet:
        if self.packet is None:
            assert self.pending is not None
            self.packet, _ = self.pending.result()
        return self.packet


class SegmentRunner:
    """See the module docstring. ``experts``: the expert stack (direct layers); ``staged``:
    remote dispatch for storage and pipelined layers."""

    def __init__(self, deployment: Deployment, backend: FunctionBackend,
                 store: ObjectStore | None, *, experts: StepExperts, staged: StagedExperts,
                 vocab_size: int, max_model_len: int, max_parallel: int = 8) -> None:
        self._caller = transfer.CallerStore(deployment.plan, store, "the segment runner")
        self.dep, self.backend, self.store = deployment, backend, self._caller.store
        self.experts, self.staged = experts, staged
        self._vocab = vocab_size
        self.max_model_len = max_model_len
        self.num_cache_blocks, self.block_size = UNBOUNDED_BLOCKS, 16
        self.run_id = uuid.uuid4().hex[:8]
        self._steps = itertools.count()
        self._side = ThreadPoolExecutor(max_parallel, thread_name_prefix="moefleet-seg")
        self._attributed = AttributedCalls()
        self.layers = {lp.layer: LayerTimes(lp.method, lp.beta) for lp in deployment.plan.layers}
        self._replicas = {lp.layer: [deployment.placement.holder(lp.layer, i).replicas
                                     for i in range(len(lp.experts))]
                          for lp in deployment.plan.layers}

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def free(self, seq_ids: list[int]) -> None:
        """Nothing to free: segment functions keep no state between steps."""

    def close(self) -> None:
        self._side.shutdown(wait=True)

    # -- billing -------------------------------------------------------------------------
    def drain(self) -> list[Attribution]:
        return self._attributed.drain()

    def store_requests(self) -> tuple[int, int]:
        return self._caller.requests()

    # -- a step --------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        for r in out.rows:
            if r.start != 0 or not r.prefill:
                raise SegmentLayoutError(
                    "this plan runs its non-expert layers in segment functions, which keep "
                    "no KV cache: it computes whole prompts only (scoring, loglikelihood, "
                    "embeddings), not decode steps or chunked prompts",
                    "ask for max_tokens 0 or 1, raise the token budget over the longest "
                    "prompt, or run the plan with the in-process runner (non-experts here, "
                    "KV cache here) or a Remoe plan (a main function holds the KV cache)")
        rows = out.rows
        step = StepInput.from_lists([r.seq_id for r in rows], [r.token_ids for r in rows],
                                    [0] * len(rows), logits="all")
        owners = [str(r.seq_id) for r in rows]
        lengths = step.lengths
        total = float(sum(lengths))
        shares = {o: n / total for o, n in zip(owners, lengths, strict=True) if n}
        seg = SegmentStack(self, f"{self.dep.prefix}/runs/{self.run_id}/s{next(self._steps)}",
                           step, owners, shares)
        counts: dict[int, torch.Tensor] = {}
        t0 = time.perf_counter()
        try:
            h, ctx = seg.begin()
            out_BTX = run_layers(seg, step, h, ctx, self.experts, counts)
        except Exception as err:
            raise StepFailedError([r.seq_id for r in rows], err) from err
        finally:
            seg.cleanup()
        forward_s = time.perf_counter() - t0
        prompt = {r.seq_id: out_BTX[b, :n] for b, (r, n) in enumerate(zip(rows, lengths,
                                                                           strict=True))
                  if r.prompt_logprobs}
        sample_ids = [r.seq_id for r in rows if r.sample]
        logits = (torch.stack([out_BTX[b, n - 1] for b, (r, n) in
                               enumerate(zip(rows, lengths, strict=True)) if r.sample])
                  if sample_ids else None)
        return RunnerOutput(sample_ids, logits, prompt, counts, forward_s)

    def invoke(self, fn: str, tensors: dict[str, torch.Tensor], refs: dict[str, str],
               meta: dict[str, Any], spill_prefix: str,
               shares: dict[str, float]) -> tuple[Packet, float]:
        """One segment invocation; its record is kept with the step's request shares."""
        t0 = time.perf_counter()
        body = pack_spilling(tensors, meta, refs, max_bytes=self.backend.max_inline_bytes,
                             store=self.store, prefix=spill_prefix)
        # retried attempts are billed: the step's too
        res = self._attributed.invoke(self.backend, fn, body, shares)
        return unpack(res.payload), time.perf_counter() - t0


class SegmentStack:
    """One step's blocks as segment invocations (a ``LayerStack``, see the module doc)."""

    def __init__(self, runner: SegmentRunner, prefix: str, step: StepInput,
                 owners: list[str], shares: dict[str, float]) -> None:
        self.r, self.prefix, self.step = runner, prefix, step
        self.owners, self.shares = owners, shares
        self.num_layers = runner.dep.num_layers
        self.moe_layers = list(runner.dep.moe_layers)
        self._ctx_tensors: dict[str, torch.Tensor] = {}
        self._ctx_refs: dict[str, str] = {}
        self._ctx_skel: dict[str, Any] | None = None

    def begin(self) -> tuple[_Handle, None]:
        inputs = {"input_ids_BT": self.step.input_ids_BT,
                  "attention_mask_BT": self.step.valid_BT.long()}
        return _Handle(Packet(tensors=inputs)), None

    def cleanup(self) -> None:
        store = self.r.store
        if store is not None:
            for key in store.list(self.prefix + "/"):
                store.delete(key)

    def _transfer(self, layer: int) -> Transfer | None:
        lt = self.r.layers.get(layer)
        if lt is None or lt.method == "direct":
            return None
        return Transfer(self.prefix, lt.method, lt.beta, tuple(self.r._replicas[layer]))

    def _call(self, layer: int, handle: _Handle, names: tuple[str, ...], extra: dict[str, Any],
              meta: dict[str, Any], tag: str, with_ctx: bool) -> tuple[Packet, float]:
        src = handle.result()
        tensors = {n: src.tensors[n] for n in names if n in src.tensors}
        refs = {n: src.refs[n] for n in names if n in src.refs}
        missing = set(names) - set(tensors) - set(refs)
        if missing:
            raise GatherError(f"a segment function returned no {sorted(missing)}",
                              "the deployment's handlers are out of date; redeploy")
        tensors.update(extra)
        if with_ctx:  # the forward context block 0 returned: masks, positions
            tensors.update(self._ctx_tensors)
            refs.update(self._ctx_refs)
        return self.r.invoke(self.r.dep.segment_function(layer), tensors, refs, meta,
                             f"{self.prefix}/spill-{layer}-{tag}", self.shares)

    # -- LayerStack ----------------------------------------------------------------------
    def pre_moe(self, layer: int, h: _Handle, ctx: None) -> tuple[_Handle, _Handle]:
        spec = self._transfer(layer)
        meta = encode(SegmentPre(self._ctx_skel, f"{self.prefix}/spill-{layer}-pre",
                                 spec.to_json() if spec is not None else None))
        names = ("input_ids_BT", "attention_mask_BT") if layer == 0 else ("h_BTD",)
        if spec is not None and spec.method == "pipelined":
            pending = self.r._side.submit(self._call, layer, h, names, {}, meta, "pre",
                                          layer > 0)
            handle = _Handle(None, pending)
            handle.ids_NK = self._wait_route(layer, pending)
            return handle, handle
        packet, _ = self._call(layer, h, names, {}, meta, "pre", layer > 0)
        handle = _Handle(packet)
        self._take_ctx(layer, handle)
        return handle, handle

    def _take_ctx(self, layer: int, pre: _Handle) -> None:
        """Keep the forward context block 0's pre call returned (masks, positions): every
        later segment needs it."""
        if layer != 0 or self._ctx_skel is not None:
            return
        packet = pre.result()
        ctx_names = [n for n in packet.names() if n.startswith("ctx.")]
        self._ctx_tensors = {n: packet.tensors[n] for n in ctx_names if n in packet.tensors}
        self._ctx_refs = {n: packet.refs[n] for n in ctx_names if n in packet.refs}
        self._ctx_skel = packet.meta["ctx"]

    def moe(self, layer: int, x: _Handle, step: StepInput, experts: StepExperts,
            counts: dict[int, torch.Tensor]) -> _Handle:
        lt = self.r.layers[layer]
        if x.ids_NK is None:  # not pipelined: the routing came back with the pre call
            packet = x.result()
            resolve(packet, self.r.store, {"ids_NK", "w_NK"})
            x.ids_NK = packet.tensors["ids_NK"]
            x.scatter_s = float(packet.meta.get("scatter_s", 0.0))
        ids_NK = x.ids_NK
        real = ids_NK[ids_NK[:, 0] >= 0]  # padding rows are all -1
        counts[layer] = torch.bincount(real.reshape(-1),
                                       minlength=len(self.r._replicas[layer])).cpu()
        if lt.method == "direct":
            packet = x.result()
            t0 = time.perf_counter()  # the layer's expert time: fetching x, the calls
            resolve(packet, self.r.store, {"x_BTD", "w_NK"})
            x_BTD, w_NK = packet.tensors["x_BTD"], packet.tensors["w_NK"]
            valid_N = step.valid_BT.reshape(-1)
            x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
            experts.set_owners([o for o, n in zip(self.owners, step.lengths, strict=True)
                                for _ in range(n)])
            yv_ND = experts(layer, x_ND[valid_N], ids_NK[valid_N], w_NK[valid_N])
            lt.experts_s.append(time.perf_counter() - t0)
            y_ND = torch.zeros_like(x_ND)
            y_ND[valid_N] = yv_ND.to(y_ND.dtype)
            return _Handle(Packet(tensors={"routed_ND": y_ND}))
        T = step.input_ids_BT.shape[1]
        row_owner = [self.owners[n // T] for n in range(ids_NK.shape[0])]
        t0 = time.perf_counter()
        x.shares = self.r.staged.run_staged(layer, ids_NK, self.prefix, row_owner)
        lt.experts_s.append(time.perf_counter() - t0)
        return _Handle(None)

    def post_moe(self, layer: int, residual: _Handle, x: _Handle,
                 routed: _Handle | None) -> _Handle:
        if routed is None:  # a dense block ran whole in its pre call
            return residual
        lt = self.r.layers[layer]
        spec = self._transfer(layer)
        extra: dict[str, torch.Tensor] = {}
        if routed.packet is not None:
            extra["routed_ND"] = routed.packet.tensors["routed_ND"]
        else:
            assert x.ids_NK is not None
            extra["ids_NK"] = x.ids_NK
        if x.pending is not None:  # the pipelined gate's own upload time
            x.scatter_s = float(x.result().meta.get("scatter_s", 0.0))
            self._take_ctx(layer, x)
        meta = encode(SegmentPost(self._ctx_skel, f"{self.prefix}/spill-{layer}-post",
                                  spec.to_json() if spec is not None else None))
        packet, gather_s = self._call(layer, x, ("residual_BTD", "x_BTD"), extra, meta, "post",
                                      layer == self.num_layers - 1)
        lt.scatter_s.append(x.scatter_s)
        lt.gather_s.append(gather_s)
        if spec is not None:
            expected = [[s.label, s.size] for s in x.shares]
            if packet.meta.get("gathered") != expected:
                raise GatherError(f"layer {layer}: the segment gathered "
                                  f"{packet.meta.get('gathered')}, expected {expected}",
                                  "a replica's output went missing; retry")
        return _Handle(packet)

    def finish(self, h: _Handle, ctx: None) -> torch.Tensor:
        packet = h.result()
        resolve(packet, self.r.store, {"out"})
        out: torch.Tensor = packet.tensors["out"]
        return out

    def _wait_route(self, layer: int, gate: Future[tuple[Packet, float]]) -> torch.Tensor:
        """``ids_NK`` of a pipelined layer once its gate has published it."""
        store = self.r.store
        assert store is not None  # pipelined layers need a store (CallerStore checks)
        key = scatter.route_key(self.prefix, layer)
        for delay in polling.delays(*polling.ROUTE_POLL):  # each ask is billed (costmodel)
            if store.exists(key):
                return unpack(store.get(key)).tensors["ids_NK"]
            if gate.done():
                gate.result()  # the gate failed: raise its error
                raise FunctionError(f"layer {layer}: the gate returned without publishing "
                                    "its routing", "redeploy: the segment code is stale")
            time.sleep(delay)
        raise AssertionError("unreachable: delays() never ends")
