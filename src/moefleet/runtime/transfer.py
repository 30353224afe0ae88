"""Moving a layer's token shares through the object store (``storage`` / ``pipelined``).

Whoever scatters (a segment function in ODS/BO's layout, or :class:`RemoteExperts` in
the engine's process or Remoe's main function) uploads each share's inputs with
:func:`upload_shares`; the expert replicas read them by the keys
:func:`scatter.share_keys` derives, and whoever gathers downloads the outputs with
:func:`download_parts`. Both sides recompute the keys from the routing, so no index lists
travel.

Invariant: uploads go minibatch-major (every replica's first minibatch before anyone's
second), so under ``pipelined`` each replica can start computing as early as possible.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import torch

from moefleet.plan import DeploymentPlan
from moefleet.platform import ObjectStore, polling
from moefleet.runtime import scatter
from moefleet.runtime.errors import FunctionError
from moefleet.runtime.payload import need, pack, unpack
from moefleet.runtime.stores import CountingStore, RetryingStore

IO_THREADS = polling.STORE_IO_THREADS  # the cost model assumes the same (plan.transfers)


class CallerStore:
    """The object store as the side that drives a layer loop uses it (the ODS/BO
    coordinator, RemoteExperts in the engine or a main function): requests retried, and
    counted, because the caller's own requests are billed as storage. A plan with
    storage/pipelined layers and no store fails here, naming ``who``."""

    def __init__(self, plan: DeploymentPlan, store: ObjectStore | None, who: str) -> None:
        indirect = [lp.layer for lp in plan.layers if lp.method != "direct"]
        if indirect and store is None:
            raise FunctionError(
                f"layers {indirect} pass tokens through the object store, but {who} was "
                "given none", "pass the store the deployment uses (deployment.store)")
        self.client = CountingStore(store) if store is not None else None
        self.store = RetryingStore(self.client) if self.client is not None else None

    def requests(self) -> tuple[int, int]:
        """(PUT+LIST, GET) requests made through this caller so far."""
        if self.client is None:
            return 0, 0
        st = self.client.stats()
        return st.puts + st.lists, st.gets


def upload_jobs(prefix: str, method: str, beta: int, shares: list[scatter.Share],
                x_ND: torch.Tensor, w_NK: torch.Tensor) -> list[tuple[str, bytes]]:
    """``(key, packet)`` for every input object of ``shares``, minibatch-major."""
    per_share: list[list[tuple[str, bytes]]] = []
    for share in shares:
        obj_beta = scatter.object_beta(method, beta, share.size)
        in_keys, _ = scatter.share_keys(prefix, share, obj_beta)
        x_nD, w_n = scatter.share_inputs(share, x_ND, w_NK)
        per_share.append([(key, pack({"x": x_nD[s:e], "w": w_n[s:e]})) for key, (s, e)
                          in zip(in_keys, scatter.minibatches(share.size, obj_beta),
                                 strict=True)])
    return [job for wave in itertools.zip_longest(*per_share) for job in wave if job]


def put_all(store: ObjectStore, jobs: list[tuple[str, bytes]]) -> None:
    """PUT every job, ``IO_THREADS`` at a time (each PUT billed as one request)."""
    if not jobs:
        return
    with ThreadPoolExecutor(min(IO_THREADS, len(jobs))) as pool:
        list(pool.map(lambda job: store.put(*job), jobs))


def upload_shares(store: ObjectStore, prefix: str, method: str, beta: int,
                  shares: list[scatter.Share], x_ND: torch.Tensor, w_NK: torch.Tensor) -> None:
    put_all(store, upload_jobs(prefix, method, beta, shares, x_ND, w_NK))


def output_keys(prefix: str, method: str, beta: int,
                shares: list[scatter.Share]) -> list[list[str]]:
    """The output keys of each share, in share order."""
    return [scatter.share_keys(prefix, s, scatter.object_beta(method, beta, s.size))[1]
            for s in shares]


def download_parts(store: ObjectStore, shares: list[scatter.Share],
                   keys: list[list[str]]) -> list[tuple[scatter.Share, torch.Tensor]]:
    """Each share's gate-weighted output rows, its minibatches concatenated in order."""
    flat = [k for ks in keys for k in ks]
    if not flat:
        return []
    with ThreadPoolExecutor(min(IO_THREADS, len(flat))) as pool:
        blobs = dict(zip(flat, pool.map(store.get, flat), strict=True))
    return [(share, torch.cat([need(unpack(blobs[k]), "y")[0] for k in ks]))
            for share, ks in zip(shares, keys, strict=True)]
