"""Function handlers: what runs inside a function instance, on any backend.

A handler factory is called once per instance (the cold start) as
``factory(config, InitContext) -> handler`` and loads the instance's weights from the
object store; the handler is then called per invocation as ``handler(payload, CallContext)
-> bytes``. Payloads are packets (:mod:`moefleet.runtime.payload`).

Requests are typed messages (:mod:`moefleet.runtime.calls`).

- :func:`segment_handler` — the non-expert part of block ``l``. ``segment.pre``: (embed on block
  0) attention + gate, and for storage methods the *scatter*: each expert replica's input
  minibatches are uploaded by this function. ``segment.post``: the *gather* (storage methods
  download the replicas' outputs here; ``direct`` receives them from the caller), shared
  experts, residual, and the head on the last block. Dense blocks run whole in
  ``segment.pre``.
- :func:`expert_handler` — one or more experts of one MoE layer; ``direct`` (tokens in the
  payload), ``storage`` (one object in, one out) or ``pipelined`` (minibatches of β tokens:
  the download of minibatch m+1 and the upload of m-1 run in threads while m computes).
- :func:`debug_handler` — echo / sleep / crash / fail / store ops for contract and fault
  tests and the overhead benchmark.

Invariant: expert outputs are already gate-weighted (y = w · expert(x)); the gatherer only
sums, and checks every token-slot arrives exactly once (:func:`scatter.gather`).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moefleet.models.base import ForwardContext
from moefleet.platform import ObjectNotFoundError, ObjectStore, polling
from moefleet.runtime import scatter, transfer, weights
from moefleet.runtime.calls import (
    ExpertDirect,
    ExpertPipelined,
    ExpertStorage,
    SegmentPost,
    SegmentPre,
    Transfer,
)
from moefleet.runtime.errors import FunctionError, PayloadError
from moefleet.runtime.host import CallContext, Handler, InitContext, make_handler
from moefleet.runtime.messages import Warm, decode, encode
from moefleet.runtime.payload import (
    flatten_context,
    need,
    pack,
    pack_spilling,
    resolve,
    unflatten_context,
    unpack,
)

_WAIT_S = 120.0  # how long a pipelined expert waits for a minibatch the gate uploads
MB = 1024 * 1024
Tensors = dict[str, torch.Tensor]
Json = dict[str, Any]


# The instance-side types live in the host (one for every backend); re-exported here for
# handler authors, who import them from this module.
__all__ = ["CallContext", "Handler", "InitContext", "debug_handler", "expert_handler",
           "make_handler", "segment_handler"]


def _require_store(store: ObjectStore | None, function: str) -> ObjectStore:
    if store is None:
        raise FunctionError(f"{function}: needs an object store", "configure the backend store")
    return store


def _load_object(store: ObjectStore, key: str, function: str) -> bytes:
    try:
        return store.get(key)
    except ObjectNotFoundError:
        raise FunctionError(
            f"{function}: weights object {key!r} is missing from {store.url}",
            "deploy the model again (moefleet deploy PLAN) so its weights are uploaded",
        ) from None


def _check_memory(function: str, memory_mb: int, nbytes: int) -> None:
    if nbytes > memory_mb * MB:
        raise FunctionError(
            f"{function}: weights need {nbytes / MB:.1f} MB but memory_mb={memory_mb}",
            "give the function more memory in the plan",
        )


# -- segment functions --------------------------------------------------------------------
class _Segment:
    def __init__(self, config: dict[str, Any], init: InitContext) -> None:
        store = _require_store(init.store, init.function)
        self.function = init.function
        self.block = int(config["block"])
        self.adapter = weights.build_skeleton(
            _load_object(store, config["skeleton"], self.function))
        tensors = weights.from_bytes(_load_object(store, config["weights"], self.function))
        _check_memory(self.function, init.memory_mb, weights.module_bytes(tensors))
        weights.assign_tensors(self.adapter.model, tensors)
        self.is_moe = self.block in self.adapter.moe_layers
        self.is_last = self.block == self.adapter.num_layers - 1

    def __call__(self, payload: bytes, ctx: CallContext) -> bytes:
        packet = unpack(payload)
        resolve(packet, ctx.store)
        msg = decode(packet.meta, SegmentPre, SegmentPost)
        out: dict[str, torch.Tensor] = {}
        info: dict[str, Any] = {}
        with torch.no_grad():
            if isinstance(msg, SegmentPre):
                self._pre(packet.tensors, msg, out, info, ctx)
            else:
                self._post(packet.tensors, msg, out, info, ctx)
        return pack_spilling(out, info, None, max_bytes=ctx.max_inline_bytes, store=ctx.store,
                             prefix=msg.spill_prefix)

    def _context(self, t: dict[str, torch.Tensor], skeleton: Json | None) -> ForwardContext:
        if skeleton is None:
            raise PayloadError(f"{self.function}: block {self.block} needs the forward "
                               "context block 0 returned", "pass its 'ctx' along")
        return unflatten_context(t, skeleton)

    def _pre(self, t: Tensors, msg: SegmentPre, out: Tensors, info: Json,
             ctx: CallContext) -> None:
        a = self.adapter
        if self.block == 0:
            (ids_BT,) = need(t, "input_ids_BT")
            h_BTD, fctx = a.begin(ids_BT, t.get("attention_mask_BT"))
            ctx_tensors, info["ctx"] = flatten_context(fctx)
            out.update(ctx_tensors)
        else:
            (h_BTD,) = need(t, "h_BTD")
            fctx = self._context(t, msg.ctx)
        residual_BTD, x_BTD = a.pre_moe(self.block, h_BTD, fctx)
        if not self.is_moe:
            h_BTD = a.post_moe(self.block, residual_BTD, x_BTD, None)
            if self.is_last:
                out["out"] = a.finish(h_BTD, fctx)
            else:
                out["h_BTD"] = h_BTD
            return
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        ids_NK, w_NK = a.route(self.block, x_ND)
        if fctx.attention_mask_BT is not None:
            # Padding never reaches an expert (nor is billed): its slots become -1, which
            # scatter.assign leaves out and scatter.gather sums as 0.
            pad_N = fctx.attention_mask_BT.reshape(-1) == 0
            ids_NK = ids_NK.masked_fill(pad_N[:, None], -1)
        out.update(residual_BTD=residual_BTD, x_BTD=x_BTD, ids_NK=ids_NK, w_NK=w_NK)
        spec = msg.transfer
        if spec is not None:
            t0 = time.perf_counter()
            self._scatter(spec, x_ND, ids_NK, w_NK, ctx)
            info["scatter_s"] = time.perf_counter() - t0

    def _scatter(self, spec: Transfer, x_ND: torch.Tensor, ids_NK: torch.Tensor,
                 w_NK: torch.Tensor, ctx: CallContext) -> None:
        store = _require_store(ctx.store, self.function)
        if spec.method == "pipelined":
            # Routing first: the coordinator starts the experts on it, and each expert
            # computes its first minibatch while this gate still uploads the rest.
            store.put(scatter.route_key(spec.prefix, self.block), pack({"ids_NK": ids_NK}))
        shares = scatter.assign(self.block, ids_NK, list(spec.replicas))
        transfer.upload_shares(store, spec.prefix, spec.method, spec.beta, shares, x_ND, w_NK)

    def _post(self, t: Tensors, msg: SegmentPost, out: Tensors, info: Json,
              ctx: CallContext) -> None:
        a = self.adapter
        residual_BTD, x_BTD = need(t, "residual_BTD", "x_BTD")
        spec = msg.transfer
        if spec is not None:
            t0 = time.perf_counter()
            (ids_NK,) = need(t, "ids_NK")
            routed_ND = self._gather(spec, ids_NK, x_BTD, info, ctx)
            info["gather_s"] = time.perf_counter() - t0
        else:
            (routed_ND,) = need(t, "routed_ND")
        h_BTD = a.post_moe(self.block, residual_BTD, x_BTD, routed_ND.reshape(x_BTD.shape))
        if self.is_last:
            out["out"] = a.finish(h_BTD, self._context(t, msg.ctx))
        else:
            out["h_BTD"] = h_BTD

    def _gather(self, spec: Transfer, ids_NK: torch.Tensor, x_BTD: torch.Tensor, info: Json,
                ctx: CallContext) -> torch.Tensor:
        store = _require_store(ctx.store, self.function)
        shares = scatter.assign(self.block, ids_NK, list(spec.replicas))
        keys = transfer.output_keys(spec.prefix, spec.method, spec.beta, shares)
        parts = transfer.download_parts(store, shares, keys)
        info["gathered"] = [[s.label, s.size] for s in shares]
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        return scatter.gather(self.block, ids_NK.shape[0], ids_NK.shape[1], parts, x_ND,
                              skipped_NK(ids_NK))


def skipped_NK(ids_NK: torch.Tensor) -> np.ndarray | None:
    """Padding slots (-1, set by the gate) for :func:`scatter.gather`, or None."""
    skip = ids_NK.detach().numpy() == -1
    return skip if skip.any() else None


def segment_handler(config: dict[str, Any], init: InitContext) -> Handler:
    """Factory; config: ``block``, ``skeleton`` (key), ``weights`` (key)."""
    return _Segment(config, init)


# -- expert functions ---------------------------------------------------------------------
class _Expert:
    def __init__(self, config: dict[str, Any], init: InitContext) -> None:
        store = _require_store(init.store, init.function)
        self.function = init.function
        self.layer = int(config["layer"])
        skeleton = weights.build_skeleton(_load_object(store, config["skeleton"], self.function))
        self.modules: dict[int, torch.nn.Module] = {}
        total = 0
        for index, key in config["weights"].items():
            tensors = weights.from_bytes(_load_object(store, key, self.function))
            total += weights.module_bytes(tensors)
            self.modules[int(index)] = weights.load_expert(skeleton, self.layer, int(index),
                                                           tensors)
        _check_memory(self.function, init.memory_mb, total)

    def _run(self, expert: int, x_nD: torch.Tensor, w_n: torch.Tensor) -> torch.Tensor:
        if expert not in self.modules:
            raise PayloadError(f"{self.function} does not hold expert {expert} "
                               f"(holds {sorted(self.modules)})", "check the deployment")
        with torch.no_grad():
            return self.modules[expert](x_nD) * w_n[:, None].to(x_nD.dtype)

    def __call__(self, payload: bytes, ctx: CallContext) -> bytes:
        packet = unpack(payload)
        msg = decode(packet.meta, Warm, ExpertDirect, ExpertStorage, ExpertPipelined)
        if isinstance(msg, Warm):  # the cold start is all it asks for
            return pack(meta=encode(msg))
        if isinstance(msg, ExpertDirect):
            resolve(packet, ctx.store)
            x_nD, w_n = need(packet, "x", "w")
            # Several experts of a group function in one call, their rows consecutive
            # in x (RemoteExperts merges a replica's shares).
            if msg.rows != x_nD.shape[0]:
                raise PayloadError(f"{self.function}: runs {list(msg.runs)} cover "
                                   f"{msg.rows} of {x_nD.shape[0]} rows",
                                   "the caller must give one row count per expert")
            ys, start = [], 0
            for e, n in msg.runs:
                ys.append(self._run(e, x_nD[start:start + n], w_n[start:start + n]))
                start += n
            return pack({"y": torch.cat(ys) if ys else x_nD[:0]})
        store = _require_store(ctx.store, self.function)
        t0 = time.perf_counter()
        if isinstance(msg, ExpertStorage):
            for key_in, key_out in zip(msg.in_keys, msg.out_keys, strict=True):
                x_nD, w_n = need(unpack(store.get(key_in)), "x", "w")
                store.put(key_out, pack({"y": self._run(msg.expert, x_nD, w_n)}))
        else:
            self._pipelined(store, msg.expert, msg.in_keys, msg.out_keys)
        return pack(meta={"tokens": msg.tokens, "compute_io_s": time.perf_counter() - t0})

    def _pipelined(self, store: ObjectStore, expert: int, in_keys: tuple[str, ...],
                   out_keys: tuple[str, ...]) -> None:
        # Two I/O threads: one prefetches minibatch m+1 while m computes on this thread,
        # the other uploads finished minibatches, so transfers hide behind compute.
        with ThreadPoolExecutor(2) as pool:
            uploads = []
            pending = pool.submit(_wait_get, store, in_keys[0], self.function)
            for m, key_out in enumerate(out_keys):
                x_nD, w_n = need(unpack(pending.result()), "x", "w")
                if m + 1 < len(in_keys):
                    pending = pool.submit(_wait_get, store, in_keys[m + 1], self.function)
                y = pack({"y": self._run(expert, x_nD, w_n)})
                uploads.append(pool.submit(store.put, key_out, y))
            for u in uploads:
                u.result()


def _wait_get(store: ObjectStore, key: str, function: str,
              timeout_s: float = _WAIT_S) -> bytes:
    """GET ``key``, waiting (polling, backing off to 50 ms) while the gate, which runs
    concurrently under the pipelined method, has not uploaded it yet; every poll is a
    billed GET, as on S3."""
    deadline = time.monotonic() + timeout_s
    for delay in polling.delays(*polling.MINIBATCH_POLL):  # the cost model counts these
        try:
            return store.get(key)
        except ObjectNotFoundError:
            if time.monotonic() > deadline:
                raise FunctionError(
                    f"{function}: minibatch {key!r} did not appear within {timeout_s:g} s",
                    "the gate function failed or is too slow; see its error") from None
            time.sleep(delay)
    raise AssertionError("unreachable: delays() never ends")


def expert_handler(config: dict[str, Any], init: InitContext) -> Handler:
    """Factory; config: ``layer``, ``skeleton`` (key), ``weights`` ({index: key})."""
    return _Expert(config, init)


# -- diagnostics --------------------------------------------------------------------------
def debug_handler(config: dict[str, Any], init: InitContext) -> Handler:
    """A model-free handler. Config: ``init_sleep_s``, ``init_fail`` (raise at cold start),
    ``init_get`` (a key to read at cold start), ``emulated_host_mb`` (host memory it
    declares for an emulated device, charged by the local limits). Per call, ``meta.op`` is one of
    ``echo`` (return the request bytes), ``sleep`` (``seconds``), ``crash`` (the process
    exits at once), ``crash_once`` (exit unless ``flag`` file exists; creates it),
    ``fail`` (raise ValueError), ``store`` (``puts`` PUTs then GETs of one key), ``copy``
    (GET ``in``, PUT it as ``out``), ``big`` (return ``nbytes`` of tensor), ``alloc`` (hold
    ``nbytes`` of touched memory for the call), ``spin`` (burn ``seconds`` of CPU), ``pid``,
    ``nested`` (``calls`` concurrent ``ctx.functions`` calls of ``target`` with meta
    ``inner``; returns their pids and whether each was cold)."""
    time.sleep(float(config.get("init_sleep_s", 0.0)))
    if config.get("init_fail"):
        raise ValueError(f"{init.function}: init_fail was set")
    if config.get("init_get"):
        _load_object(_require_store(init.store, init.function), config["init_get"],
                     init.function)

    def handle(payload: bytes, ctx: CallContext) -> bytes:
        meta = unpack(payload).meta
        op = meta.get("op", "echo")
        if op == "echo":
            return payload
        if op == "sleep":
            time.sleep(float(meta["seconds"]))
        elif op == "crash":
            os._exit(17)
        elif op == "crash_once":
            flag = Path(meta["flag"])
            if not flag.exists():
                flag.write_text(str(os.getpid()))
                os._exit(17)
        elif op == "fail":
            raise ValueError(f"{ctx.function}: asked to fail")
        elif op == "store":
            store = _require_store(ctx.store, ctx.function)
            for i in range(int(meta.get("puts", 1))):
                store.put(f"debug/{ctx.function}/{i}", b"x" * 16)
                store.get(f"debug/{ctx.function}/{i}")
        elif op == "copy":  # one GET, one PUT: the storage path of a transfer
            store = _require_store(ctx.store, ctx.function)
            store.put(meta["out"], store.get(meta["in"]))
        elif op == "big":
            return pack({"blob": torch.zeros(int(meta["nbytes"]), dtype=torch.uint8)})
        elif op == "alloc":  # ones, not zeros: every page is written, so it is resident
            held = torch.ones(int(meta["nbytes"]), dtype=torch.uint8)
            meta["sum"] = int(held[:: 4096].sum())
            del held
        elif op == "spin":
            until = time.process_time() + float(meta["seconds"])
            while time.process_time() < until:
                pass
        elif op == "nested":  # ``calls`` concurrent calls of ``target``
            return _nested_debug(meta, ctx)
        elif op != "pid":
            raise PayloadError(f"{ctx.function}: unknown debug op {op!r}", "see debug_handler")
        return pack(meta={"pid": os.getpid(), "op": op})

    emulated = int(float(config.get("emulated_host_mb", 0)) * MB)
    handle.emulated_host_bytes = emulated  # type: ignore[attr-defined]
    return handle


def _nested_debug(meta: Json, ctx: CallContext) -> bytes:
    if ctx.functions is None:
        raise FunctionError(f"{ctx.function}: this backend gives handlers no functions",
                            "run it on the local, ray or aws backend")
    functions = ctx.functions
    body = pack(meta=dict(meta.get("inner", {"op": "pid"})))
    calls = max(1, min(64, int(meta.get("calls", 1))))
    with ThreadPoolExecutor(calls) as pool:
        results = list(pool.map(
            lambda _: functions.invoke(str(meta["target"]), body, request_id=ctx.request_id),
            range(calls)))
    return pack(meta={"pid": os.getpid(), "op": "nested",
                      "pids": [unpack(r.payload).meta.get("pid") for r in results],
                      "cold": [r.record.cold for r in results],
                      "functions": [r.record.function for r in results]})
