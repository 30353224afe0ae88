"""Object-store requests of the segments and the coordinator, per MoE layer (our addition).

The paper's objective bills the experts only. A deployment also pays for the requests the
non-MoE segment functions and the coordinator (``runtime.segments``) make to move a MoE
layer's activations: on a platform with a few-MB inline limit these are most of the
requests of a direct plan (measured in ``moefleet demo``). This module counts them with
the runtime's own rules: which tensors a packet spills (``platform.inline.spill_names``,
one PUT each, one GET where it is read) and how often a poller asks
(``platform.polling``). Per MoE layer at block b with P positions, D_in bytes per position
and top-k K (sizes: h, residual, x, routed = P·D_in; ids = 8·P·K; w = 4·P·K; P is
``problem.positions``, padding included, else the batch's tokens):

1. seg-b ``pre`` returns residual, x, ids, w: the spilled ones are PUT by the segment;
   the coordinator GETs ids and w if spilled, and x too under ``direct`` (it slices x);
2. the coordinator sends seg-b ``post`` residual, x (a reference if still in the store)
   plus routed (``direct``) or ids (storage methods), spilling what does not fit (PUT);
   the segment GETs every reference;
3. seg-b ``post`` returns h: PUT if it spills, GET by the next segment;
4. ``pipelined`` only: the gate PUTs its routing, the coordinator asks for it while the
   gate runs (T_warm + T^NE of the block, one GET per ask, ``ROUTE_POLL``) and GETs it;
   each replica asks for a minibatch that is not up yet (:func:`minibatch_failed_asks`).

Per batch: one LIST (the coordinator's clean-up; deletes are free on S3). Not modelled,
stated where measured: the block-0 context tensors (masks, rotary tables) and the head's
output spill (its size is the vocabulary's, not the MoE layers').

Invariant: counts are the runtime's for a batch of P positions and the planning inline
budget (the backend's ``max_inline_bytes``: base64 on aws and on the local backend's
``wire="base64"``); zero when ``problem.storage_requests`` is off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from moefleet.plan.problem import PlanningProblem
from moefleet.platform import polling
from moefleet.platform.inline import spill_budget, spill_names

META_JSON_BYTES = 1024  # the JSON metadata of a segment packet (keys, replica lists)
INT64, FP32 = 8, 4  # ids_NK and w_NK element sizes


@dataclass(frozen=True)
class Requests:
    """Object-store requests (LIST billed as a PUT, HEAD/exists as a GET, as on S3)."""

    puts: int = 0
    gets: int = 0

    def __add__(self, other: Requests) -> Requests:
        return Requests(self.puts + other.puts, self.gets + other.gets)

    def usd(self, per_put: float, per_get: float) -> float:
        return self.puts * per_put + self.gets * per_get


def top_k(problem: PlanningProblem, li: int) -> int:
    """Experts per token of MoE layer ``li``: its token-slots over the batch's tokens."""
    return max(1, round(int(problem.counts(li).sum()) / problem.tokens))


def layer_requests(problem: PlanningProblem, li: int, method: int) -> Requests:
    """Segment + coordinator requests of MoE layer ``li`` under method a (module doc 1-4,
    without the replicas' minibatch polls, which depend on the plan's replicas)."""
    if not problem.storage_requests:
        return Requests()
    positions, k = problem.positions or problem.tokens, top_k(problem, li)
    act = positions * problem.bytes_in
    budget = spill_budget(problem.payload_limit_bytes, META_JSON_BYTES)
    pre = spill_names([("residual", act), ("x", act), ("ids", INT64 * positions * k),
                       ("w", FP32 * positions * k)], budget)
    puts, gets = len(pre), sum(n in pre for n in ("ids", "w"))
    refs = [n for n in ("residual", "x") if n in pre]
    if method == 3:
        if "x" in pre:  # the coordinator reads x to slice the replicas' tokens
            gets += 1
            refs.remove("x")
        extra = ("routed", act)
    else:
        extra = ("ids", INT64 * positions * k)
    inline = [(n, act) for n in ("residual", "x") if n not in refs] + [extra]
    post = spill_names(inline, budget)
    puts += len(post)
    gets += len(refs) + len(post)
    if spill_names([("h", act)], budget):
        puts, gets = puts + 1, gets + 1
    if method == 1:
        s = problem.platform
        assert s.startup is not None
        wait = s.startup.warm_start_s + problem.segment_time_s[problem.moe_layers[li]]
        asks = int(polling.failed_asks(wait, *polling.ROUTE_POLL))
        puts, gets = puts + 1, gets + 1 + asks + 1  # route PUT; asks, the found ask, GET
    return Requests(puts, gets)


def batch_requests(problem: PlanningProblem) -> Requests:
    """Per-batch requests independent of the plan: the coordinator's clean-up LIST."""
    return Requests(puts=1) if problem.storage_requests else Requests()


def layer_transfer_usd(problem: PlanningProblem, li: int, method: int, per_put: float,
                       per_get: float) -> float:
    """USD of :func:`layer_requests` (what the planners add to a layer's cost)."""
    return layer_requests(problem, li, method).usd(per_put, per_get)


def minibatch_failed_asks(problem: PlanningProblem, head_s: float, block_s: float,
                          nblk: int, beta: int, replicas: int, acc_s: float,
                          bs: float) -> int:
    """GETs a pipelined replica makes for minibatches not yet uploaded (module doc 4).

    Time 0 is the routing's publication. The gate uploads minibatch-major with
    ``STORE_IO_THREADS`` parallel PUTs of T_acc + β·D_in/B_s each, so every replica's
    minibatch m is up after (m + 1) waves of ceil(replicas / threads) PUTs; the replica asks
    for minibatch m at T_head + m·t_blk (it prefetches one ahead of its compute)."""
    if nblk < 1:
        return 0
    wave = math.ceil(replicas / polling.STORE_IO_THREADS) * (acc_s + beta * problem.bytes_in
                                                            / bs)
    m = np.arange(nblk, dtype=float)
    waits = (m + 1) * wave - (head_s + m * block_s)
    waits[waits < 1e-9] = 0.0  # a tie is no wait (float noise must not buy a GET)
    asks: Any = polling.failed_asks_array(waits, *polling.MINIBATCH_POLL)
    return int(asks.sum())
