"""``RemoteExperts``: an ``ExpertFn`` whose experts run in a deployment's expert functions.

Seam 1 of DESIGN.md: wherever the layer loop runs (the engine's process, a Remoe main
function, a test), ``rx(layer, x_ND, ids_NK, w_NK) -> y_ND`` sends each layer's routed
token-slots to the functions that hold the experts, with the plan's scatter-gather method
for that layer, and sums the gate-weighted results:

- ``direct``: the tokens travel in the invocation payload. The shares a replica of one
  function gets (one per expert it holds, see :func:`scatter.assign`) are merged into one
  invocation, so a group function (Remoe) is called once per replica, not per expert.
  A group with ``replica_experts`` (Remoe's LPT) sends each expert's slots to its own
  replica; otherwise each expert's slots are split evenly over the replicas;
- ``storage``: this caller uploads every share's input object, invokes the replicas, then
  downloads their outputs;
- ``pipelined``: as storage with minibatches of β tokens, and the replicas are invoked
  while the uploads are still running (each replica polls for its next minibatch).

Slots whose expert id is -1 are skipped and contribute 0: a caller that keeps some experts
elsewhere (Remoe's :class:`~moefleet.experts.split.SplitExperts`) masks them. Invariants:
every other slot is gathered exactly once (:func:`scatter.gather` raises otherwise); y
equals the in-process experts to fp32 rounding; every invocation's record is kept, with
each owner's share of its tokens (:meth:`set_owners`), until :meth:`drain`.

Shape legend: N tokens, D hidden, K experts per token.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from moefleet.experts.stack import ExpertStack
from moefleet.platform import ObjectStore
from moefleet.runtime import scatter, transfer
from moefleet.runtime.base import Invoker
from moefleet.runtime.calls import ExpertDirect, expert_call
from moefleet.runtime.deploy import Deployment
from moefleet.runtime.errors import GatherError, PayloadTooLargeError
from moefleet.runtime.messages import encode
from moefleet.runtime.payload import pack, resolve, unpack
from moefleet.runtime.replies import AttributedCalls, Attribution

ANONYMOUS = "-"


@dataclass
class LayerCalls:
    """Running totals for one MoE layer since construction."""

    calls: int = 0  # forward calls that reached functions
    invocations: int = 0
    token_slots: int = 0
    seconds: float = 0.0  # wall time inside __call__


class RemoteExperts(ExpertStack):
    """See the module docstring. Thread-compatible: one forward at a time per instance."""

    def __init__(self, deployment: Deployment, invoker: Invoker, store: ObjectStore | None,
                 *, max_parallel: int = 16) -> None:
        if max_parallel < 1:
            raise ValueError(f"max_parallel must be >= 1, got {max_parallel}")
        self._caller = transfer.CallerStore(deployment.plan, store, "RemoteExperts")
        self.dep = deployment
        self.invoker = invoker
        self.store = self._caller.store
        self.run_id = uuid.uuid4().hex[:8]
        self._calls = itertools.count()
        self._pool = ThreadPoolExecutor(max_parallel, thread_name_prefix="moefleet-rx")
        self._attributed = AttributedCalls()
        self._owners: np.ndarray | None = None
        self.stats: dict[int, LayerCalls] = {}
        # direct shares over the payload limit sent as extra invocations (a plan whose
        # predictions undercounted an expert)
        self.oversize_splits = 0
        # per MoE layer: replicas of the function holding each expert, and its method
        self._replicas: dict[int, list[int]] = {}
        self._method: dict[int, tuple[str, int]] = {}
        self._local: dict[int, np.ndarray] = {}  # experts no function holds (Remoe: main's)
        for lp in deployment.plan.layers:
            held = deployment.placement.expert_functions(lp.layer)
            reps = {e: f.replicas for f in held for e in f.experts}
            self._replicas[lp.layer] = [reps.get(e, 1) for e in range(len(lp.experts))]
            self._local[lp.layer] = np.array(
                [e for e in range(len(lp.experts)) if e not in reps], dtype=np.int64)
            self._method[lp.layer] = (lp.method, lp.beta)
        # Remoe's LPT groups: replica j of a layer's group function serves its own experts
        self._replica_of: dict[int, dict[int, int]] = {}
        for g in deployment.plan.groups:
            replica_of = g.replica_of()
            if replica_of is not None:
                self._replica_of[g.layer] = replica_of

    # -- bookkeeping ---------------------------------------------------------------------
    def set_owners(self, owners_N: Sequence[str] | None) -> None:
        """Request id of each token row of the following calls (None: one owner)."""
        self._owners = None if owners_N is None else np.asarray(owners_N, dtype=object)

    def drain(self) -> list[Attribution]:
        """Records since the last drain, each with ``{owner: share of its tokens}``."""
        return self._attributed.drain()

    def store_requests(self) -> tuple[int, int]:
        """(PUT+LIST, GET) requests this caller made itself (billed as storage)."""
        return self._caller.requests()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> RemoteExperts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _shares_of(self, tokens_n: np.ndarray, N: int) -> dict[str, float]:
        if self._owners is None:
            return {ANONYMOUS: 1.0}
        if self._owners.shape[0] != N:
            raise ValueError(f"set_owners gave {self._owners.shape[0]} owners for {N} rows")
        names, counts = np.unique(self._owners[tokens_n], return_counts=True)
        total = float(counts.sum())
        return {str(n): float(c) / total for n, c in zip(names, counts, strict=True)}

    def _invoke(self, fn: str, body: bytes, shares_by_owner: dict[str, float]) -> bytes:
        return self._attributed.invoke(self.invoker, fn, body, shares_by_owner).payload

    # -- the ExpertFn ----------------------------------------------------------------------
    def __call__(self, layer: int, x_ND: torch.Tensor, ids_NK: torch.Tensor,
                 w_NK: torch.Tensor) -> torch.Tensor:
        if layer not in self._replicas:
            raise GatherError(f"the deployment has no expert functions for layer {layer}",
                              "deploy a plan for this model")
        t0 = time.perf_counter()
        home = x_ND.device  # a loop on CUDA: packets are host memory, the sum goes back
        x_ND, ids_NK, w_NK = x_ND.cpu(), ids_NK.cpu(), w_NK.cpu()
        local = self._local[layer]
        if local.size and np.isin(ids_NK.numpy(), local).any():
            raise GatherError(
                f"layer {layer}: tokens routed to experts {local.tolist()}, which no function "
                "of the deployment holds (they are the main function's)",
                "mask slots of local experts with -1 (SplitExperts does this)")
        shares = scatter.assign(layer, ids_NK, self._replicas[layer],
                                self._replica_of.get(layer))
        skipped_NK = (ids_NK == -1).numpy()
        if not shares:
            return torch.zeros_like(x_ND).to(home)
        method, beta = self._method[layer]
        dtype = x_ND.dtype  # packets and the gather run in fp32 (NumPy has no bf16)
        x_ND = x_ND.detach().to(torch.float32)
        w_NK = w_NK.detach().to(torch.float32)
        if method == "direct":
            parts = self._direct(layer, shares, x_ND, w_NK)
        else:
            parts = self._indirect(layer, method, beta, shares, x_ND, w_NK)
        y_ND = scatter.gather(layer, x_ND.shape[0], ids_NK.shape[1], parts, x_ND, skipped_NK)
        st = self.stats.setdefault(layer, LayerCalls())
        st.calls += 1
        st.token_slots += sum(s.size for s in shares)
        st.seconds += time.perf_counter() - t0
        return y_ND.to(device=home, dtype=dtype)

    def _direct(self, layer: int, shares: list[scatter.Share], x_ND: torch.Tensor,
                w_NK: torch.Tensor) -> list[tuple[scatter.Share, torch.Tensor]]:
        # One invocation per (function, replica): its shares' rows back to back.
        groups: dict[tuple[str, int], list[scatter.Share]] = {}
        for share in shares:
            fn = self.dep.expert_function(layer, share.expert)
            groups.setdefault((fn, share.replica), []).append(share)
        # Slice on this thread: pool threads only move bytes (torch ops from many threads
        # each start an OpenMP team, which starves a small machine).
        jobs = []
        limit = self.invoker.max_inline_bytes
        row_bytes = x_ND.shape[1] * x_ND.element_size() + w_NK.element_size()
        for (fn, _), members in groups.items():
            body = self._direct_body(members, x_ND, w_NK)
            if len(body) > limit:
                # A plan sizes direct shares from predicted counts; when the real count is
                # larger, each piece goes in its own (billed) invocation of the same
                # replica instead of failing the step, as a client of a real platform would.
                pieces = [piece for s in members
                          for piece, _, _ in scatter.fit_payload(s, row_bytes, limit)]
                self.oversize_splits += len(pieces) - 1
                batches = [[piece] for piece in pieces]
            else:
                batches = [members]
            for batch in batches:
                if batch is not members:
                    body = self._direct_body(batch, x_ND, w_NK)
                    if len(body) > limit:
                        raise PayloadTooLargeError(
                            f"layer {layer}: {fn} would get {len(body)} bytes for one token "
                            f"row, over the {limit}-byte payload limit (method 'direct')",
                            "use method 'storage' or 'pipelined' for this layer")
                tokens = np.concatenate([m.tokens_n for m in batch])
                jobs.append((fn, body, batch, self._shares_of(tokens, x_ND.shape[0])))
        self.stats.setdefault(layer, LayerCalls()).invocations += len(jobs)

        def one(job: tuple[str, bytes, list[scatter.Share], dict[str, float]]) -> bytes:
            return self._invoke(job[0], job[1], job[3])

        parts: list[tuple[scatter.Share, torch.Tensor]] = []
        for (_, _, members, _), payload in zip(jobs, self._pool.map(one, jobs), strict=True):
            packet = unpack(payload)
            resolve(packet, self.store)
            y = packet.tensors["y"]
            start = 0
            for s in members:
                parts.append((s, y[start:start + s.size]))
                start += s.size
        return parts

    @staticmethod
    def _direct_body(members: list[scatter.Share], x_ND: torch.Tensor,
                     w_NK: torch.Tensor) -> bytes:
        """One invocation's packet: the members' rows back to back, one run per expert."""
        xs, ws = zip(*(scatter.share_inputs(s, x_ND, w_NK) for s in members), strict=True)
        return pack({"x": torch.cat(xs), "w": torch.cat(ws)},
                    encode(ExpertDirect(tuple((s.expert, s.size) for s in members))))

    def run_staged(self, layer: int, ids_NK: torch.Tensor, prefix: str,
                   owners_N: Sequence[str] | None = None) -> list[scatter.Share]:
        """Invoke layer ``layer``'s replicas on inputs a producer (a segment function)
        stages in the store under ``prefix``, for the layer's storage or pipelined method;
        the consumer downloads and gathers the outputs. Returns the shares (what the
        consumer must gather). Owners as in :meth:`set_owners`,
        for the ``N`` rows of ``ids_NK`` (slots -1 are padding: nobody's)."""
        method, beta = self._method[layer]
        if method == "direct":
            raise GatherError(f"layer {layer} uses method 'direct': its tokens travel in the "
                              "payload, nothing is staged", "call the experts with the rows")
        ids_NK = ids_NK.cpu()
        shares = scatter.assign(layer, ids_NK, self._replicas[layer],
                                self._replica_of.get(layer))
        t0 = time.perf_counter()
        saved, self._owners = self._owners, (None if owners_N is None
                                             else np.asarray(owners_N, dtype=object))
        try:
            self._run_replicas(layer, method, beta, shares, prefix, ids_NK.shape[0])
        finally:
            self._owners = saved
        st = self.stats.setdefault(layer, LayerCalls())
        st.calls += 1
        st.invocations += len(shares)
        st.token_slots += sum(s.size for s in shares)
        st.seconds += time.perf_counter() - t0
        return shares

    def _indirect(self, layer: int, method: str, beta: int, shares: list[scatter.Share],
                  x_ND: torch.Tensor, w_NK: torch.Tensor
                  ) -> list[tuple[scatter.Share, torch.Tensor]]:
        assert self.store is not None  # checked in __init__ for indirect layers
        prefix = f"{self.dep.prefix}/rx/{self.run_id}/c{next(self._calls)}"
        jobs = transfer.upload_jobs(prefix, method, beta, shares, x_ND, w_NK)
        self.stats.setdefault(layer, LayerCalls()).invocations += len(shares)
        try:
            if method == "pipelined":  # replicas start while the minibatches go up
                uploads: Future[None] = self._pool.submit(transfer.put_all, self.store, jobs)
                self._run_replicas(layer, method, beta, shares, prefix, x_ND.shape[0])
                uploads.result()
            else:
                transfer.put_all(self.store, jobs)
                self._run_replicas(layer, method, beta, shares, prefix, x_ND.shape[0])
            keys = transfer.output_keys(prefix, method, beta, shares)
            return transfer.download_parts(self.store, shares, keys)
        finally:
            for key in self.store.list(prefix + "/"):
                self.store.delete(key)

    def _run_replicas(self, layer: int, method: str, beta: int, shares: list[scatter.Share],
                      prefix: str, N: int) -> None:
        def one(share: scatter.Share) -> None:
            in_keys, out_keys = scatter.share_keys(
                prefix, share, scatter.object_beta(method, beta, share.size))
            meta = encode(expert_call(method, share.expert, in_keys, out_keys, share.size))
            fn = self.dep.expert_function(layer, share.expert)
            out = unpack(self._invoke(fn, pack(meta=meta), self._shares_of(share.tokens_n, N)))
            if out.meta.get("tokens") != share.size:
                raise GatherError(f"layer {layer}: replica {share.label} processed "
                                  f"{out.meta.get('tokens')} of {share.size} tokens",
                                  "a replica returned early; retry")

        list(self._pool.map(one, shares))
