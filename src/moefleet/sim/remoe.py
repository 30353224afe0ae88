"""Discrete-event simulation (SimPy) of a Remoe deployment: one main function per request
and, per MoE layer, remote expert functions (one per LPT group, i.e. per replica).

    arrival -> every remote function of the plan starts an instance if none is idle (its
    cold start overlaps the main's, IV-C) -> main cold start (unless a warm main is idle)
    -> prefill: per layer, non-experts + 2τ_sw, then local experts (in turn, on the main's
       CPU) alongside one call per remote group that got tokens -> wait for both
    -> n_out decode steps, each the same per layer with one token
    -> the main instance stays warm ``keep_alive_s``

Routing is sampled per pass from the plan's activation distribution with the
simulator's :class:`~moefleet.sim.routing.DistributionRouter` (the analytical model uses
its expectation). Times per layer come from :func:`moefleet.plan.remoe.model.main_times`
and the same per-token laws as eqs. 1-5, so with deterministic routing the simulator
reproduces :func:`~moefleet.plan.remoe.evaluate` exactly; with sampled routing it
differs by the routing's randomness and in two places on purpose:

- a remote group that receives no token is not called (eq. 3 bills t_rem to every
  replica); a decode token whose remote experts sit in different groups calls them in
  parallel (eq. 5 serialises all of a layer's remote experts);
- remote functions are real pools: an instance runs one call at a time, a busy pool
  starts another (cold) instance, idle instances live ``keep_alive_s``.

Billing follows eqs. 6, 8, 9: the main from its first prefill to its last token at
c_g·M_g + c_c·w, each remote call for its duration at c_c·y; cold starts are not billed
(as in the paper). Durations are billed exactly (the paper), or, given the platform's
``billing`` block, by the platform meter's one rule (``Billing.billed_s``: rounded up to
the granularity, at least the minimum billed duration); where that block bills INIT
(``init_billed``), every cold start is billed too, at its instance's rate
(``main_init_cost``, ``remote_init_cost``; both in ``cost_usd``).

Two options make it model this project's runtime (``moefleet.remoe``) instead of the
paper, for checking one against the other (``benchmarks/remoe_sim_vs_runtime.py``):

- ``dispatch="split"``: every replica of a layer's remote function holds all of its
  remote experts and each expert's token-slots are cut into ``ceil(d / z)`` chunks over
  the replicas in order (``runtime.scatter.assign``), one call per replica that got a
  chunk; ``"lpt"`` (default) is the paper's: replica j holds LPT group j;
- ``billed_overhead_s``: the part of a call's overhead t_rem its remote function is billed
  for (a platform bills the handler, not the caller's round trip: the handler is billed
  its slots' compute and wire time plus this); None bills all of t_rem;
- ``run(..., passes=...)`` replays recorded engine steps (:class:`Pass`: tokens and
  routed slots per layer and expert) instead of n_in / n_out tokens with sampled routing.

Units: seconds, USD.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import simpy

from moefleet.plan.plan import even_chunks
from moefleet.plan.remoe.model import Layout, main_times
from moefleet.plan.remoe.problem import RemoeProblem
from moefleet.platform.spec_blocks import Billing
from moefleet.sim.config import SimError
from moefleet.sim.routing import DistributionRouter

Dispatch = Literal["lpt", "split"]


@dataclass(frozen=True)
class Pass:
    """One engine step of a request's main invocation, replayed: whether it is the prompt
    (prefill) pass, the tokens it carries and the routed token-slots per MoE layer and
    expert (``counts_LE``, what the router chose)."""

    prefill: bool
    tokens: int
    counts_LE: np.ndarray


def split_chunks(counts_E: np.ndarray, remote_E: np.ndarray, replicas: int) -> list[int]:
    """Token-slots each replica of a layer's remote function receives under
    ``dispatch="split"``: expert e's d slots go ``ceil(d / z)`` at a time to replicas
    0, 1, ... (as ``runtime.scatter.assign`` cuts them). Zeros are replicas not called."""
    z = max(1, int(replicas))
    out = [0] * z
    for e in np.flatnonzero(remote_E):
        for r, n in enumerate(even_chunks(int(counts_E[e]), z)):
            out[r] += n
    return out


@dataclass
class RemoeSimResult:
    """Per-request measurements and the bill of one simulated run."""

    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)
    cold_s: list[float] = field(default_factory=list)  # arrival -> first prefill step
    main_cost: float = 0.0
    remote_prefill_cost: float = 0.0
    remote_decode_cost: float = 0.0
    main_init_cost: float = 0.0  # cold starts, where the platform bills INIT
    remote_init_cost: float = 0.0
    remote_calls: int = 0
    remote_slots: int = 0  # token-slots sent to remote functions
    main_billed_s: float = 0.0  # billed seconds (after the granularity)
    remote_billed_s: float = 0.0
    calls_by_layer: dict[int, int] = field(default_factory=dict)  # layer index -> calls
    slots_by_layer: dict[int, int] = field(default_factory=dict)
    main_cold_starts: int = 0
    remote_cold_starts: int = 0

    @property
    def cost_usd(self) -> float:
        return (self.main_cost + self.remote_prefill_cost + self.remote_decode_cost
                + self.main_init_cost + self.remote_init_cost)

    def summary(self) -> dict[str, Any]:
        def mean(v: list[float]) -> float:
            return float(np.mean(v)) if v else math.nan

        return {"requests": len(self.ttft_s), "cost_usd": self.cost_usd,
                "main_cost_usd": self.main_cost,
                "remote_prefill_cost_usd": self.remote_prefill_cost,
                "remote_decode_cost_usd": self.remote_decode_cost,
                "main_init_cost_usd": self.main_init_cost,
                "remote_init_cost_usd": self.remote_init_cost,
                "mean_ttft_s": mean(self.ttft_s), "mean_tpot_s": mean(self.tpot_s),
                "mean_prefill_s": mean(self.prefill_s), "mean_cold_s": mean(self.cold_s),
                "remote_calls": self.remote_calls, "remote_slots": self.remote_slots,
                "main_billed_s": self.main_billed_s, "remote_billed_s": self.remote_billed_s,
                "main_cold_starts": self.main_cold_starts,
                "remote_cold_starts": self.remote_cold_starts}


class _Pool:
    """One function: instances with one call at a time, cold starts, keep-alive."""

    def __init__(self, env: simpy.Environment, cold_s: float, keep_alive_s: float) -> None:
        self.env, self.cold_s, self.keep_alive_s = env, cold_s, keep_alive_s
        self.idle: list[float] = []  # the times idle instances became idle
        self.starting: list[simpy.Event] = []  # instances in their cold start
        self.cold_starts = 0

    def _expire(self) -> None:
        now = self.env.now
        self.idle = [t for t in self.idle if now - t <= self.keep_alive_s]

    def start_one(self) -> None:
        """Begin a cold start now (an instance that is idle when it ends)."""
        self.cold_starts += 1
        ev = self.env.timeout(self.cold_s)
        self.starting.append(ev)

        def ready(_e: simpy.Event) -> None:
            self.starting.remove(ev)
            self.idle.append(self.env.now)
        ev.callbacks.append(ready)

    def prewarm(self) -> None:
        self._expire()
        if not self.idle and not self.starting:
            self.start_one()

    def acquire(self) -> Generator[simpy.Event, Any, None]:
        """Wait for an instance: an idle one, one already starting, or a new one."""
        while True:
            self._expire()
            if self.idle:
                self.idle.pop()
                return
            if not self.starting:
                self.start_one()
            yield self.env.any_of(list(self.starting))

    def release(self) -> None:
        self.idle.append(self.env.now)


class RemoeSimulator:
    """Simulate requests on one Remoe (or baseline) layout; see the module docstring."""

    def __init__(self, p: RemoeProblem, lay: Layout, *, seed: int = 0,
                 keep_alive_s: float = 600.0, billing: Billing | None = None,
                 s_LE: np.ndarray | None = None, dispatch: Dispatch = "lpt",
                 billed_overhead_s: float | None = None) -> None:
        if not (math.isfinite(keep_alive_s) and keep_alive_s >= 0):
            raise SimError(f"keep_alive_s must be >= 0, got {keep_alive_s}")
        if dispatch not in ("lpt", "split"):
            raise SimError(f"dispatch must be 'lpt' or 'split', got {dispatch!r}")
        if billed_overhead_s is not None and not (
                math.isfinite(billed_overhead_s) and billed_overhead_s >= 0):
            raise SimError(f"billed_overhead_s must be >= 0, got {billed_overhead_s}")
        self.dispatch, self.billed_overhead_s = dispatch, billed_overhead_s
        x = np.asarray(lay.remote_LE, bool)
        if x.shape != p.s_LE.shape or len(lay.groups) != p.num_layers:
            raise SimError(f"layout of shape {x.shape} does not match the problem's "
                           f"{p.s_LE.shape}", "plan the layout for this problem")
        self.p, self.lay, self.x = p, lay, x
        # The routing actually served: the plan's prediction unless the caller passes the
        # requests' real distribution (SPS error is then part of the simulated cost).
        self.router = DistributionRouter(p.s_LE if s_LE is None else s_LE, p.top_k)
        self.rng = np.random.default_rng(seed)
        self.billing = billing
        self.keep_alive_s = keep_alive_s
        self.m = main_times(p, lay)

    def _billed(self, s: float) -> float:
        return s if self.billing is None else self.billing.billed_s(s)

    def _call_tokens(self, li: int, counts_E: np.ndarray) -> list[tuple[int, int]]:
        """(replica or group index, token-slots) of every remote call a layer makes."""
        groups = self.lay.groups[li]
        if not groups:
            return []
        if self.dispatch == "split":
            sizes = split_chunks(counts_E, self.x[li], len(groups))
        else:
            sizes = [int(sum(counts_E[k] for k in g)) for g in groups]
        return [(j, n) for j, n in enumerate(sizes) if n > 0]

    def _check_passes(self, passes: Sequence[Sequence[Pass]], n: int) -> None:
        if len(passes) != n:
            raise SimError(f"{len(passes)} pass lists for {n} arrivals",
                           "give one list of recorded passes per request")
        shape = self.p.s_LE.shape
        for reqs in passes:
            kinds = [ps.prefill for ps in reqs]
            if not kinds or not kinds[0] or kinds != sorted(kinds, reverse=True):
                raise SimError("a request's passes must be its prefill pass(es), then its "
                               "decode passes", "replay the passes in the engine's order")
            for ps in reqs:
                c = np.asarray(ps.counts_LE)
                if c.shape != shape or ps.tokens < 1 or np.any(c < 0):
                    raise SimError(f"a pass has counts of shape {c.shape} for {ps.tokens} "
                                   f"tokens; expected {shape}, >= 1 token",
                                   "record the passes on this problem's model")

    def run(self, arrivals_s: Sequence[float],
            passes: Sequence[Sequence[Pass]] | None = None) -> RemoeSimResult:
        """Simulate one request per arrival time: each the problem's n_in / n_out with
        sampled routing, or, with ``passes``, request i replays ``passes[i]`` (its prefill
        pass or passes first; TTFT ends with them, TPOT is the rest over its passes)."""
        p, lay, m = self.p, self.lay, self.m
        if passes is not None:
            self._check_passes(passes, len(arrivals_s))
        env = simpy.Environment()
        load = 1.0 / p.load_bytes_s if p.load_bytes_s > 0 else 0.0
        main = _Pool(env, p.cold_main_s + (p.nonexpert_bytes + m.main_experts
                                           * p.expert_bytes) * load, self.keep_alive_s)

        def held(li: int, g: tuple[int, ...]) -> int:  # experts one instance loads
            return int(self.x[li].sum()) if self.dispatch == "split" else len(g)

        pools = [[_Pool(env, p.cold_remote_s + held(li, g) * p.expert_bytes * load,
                        self.keep_alive_s) for g in lay.groups[li]]
                 for li in range(p.num_layers)]
        res = RemoeSimResult()
        wire = 2.0 * p.token_bytes / p.transfer_bytes_s
        y_gb = [p.gb(mb) for mb in lay.remote_mb]
        units = [p.expert_s(y) if y > 0 else 0.0 for y in y_gb]
        rates = [p.cpu_rate(y) for y in y_gb]
        # per token of a pass: non-experts and GPU<->CPU copies
        f_pre, sw_pre = m.f_pre / p.n_in, m.sw_pre / p.n_in

        def remote_call(li: int, j: int, tokens: int, unit: float, prefill: bool
                        ) -> Generator[simpy.Event, Any, None]:
            pool = pools[li][j]
            yield from pool.acquire()
            dur = tokens * (unit + wire) + p.invoke_overhead_s  # eqs. 3 and 5
            yield env.timeout(dur)
            pool.release()
            res.remote_calls += 1
            res.remote_slots += tokens
            res.calls_by_layer[li] = res.calls_by_layer.get(li, 0) + 1
            res.slots_by_layer[li] = res.slots_by_layer.get(li, 0) + tokens
            billed = dur if self.billed_overhead_s is None else (
                tokens * (unit + wire) + self.billed_overhead_s)
            res.remote_billed_s += self._billed(billed)
            cost = rates[li] * self._billed(billed)
            if prefill:
                res.remote_prefill_cost += cost
            else:
                res.remote_decode_cost += cost

        def layer(li: int, counts: np.ndarray, tokens: int, prefill: bool
                  ) -> Generator[simpy.Event, Any, None]:
            xl = self.x[li]
            t_loc = m.t_loc_pre if prefill else m.t_loc
            local = float(np.sum(counts[~xl])) * t_loc
            unit = units[li] * (p.prefill_factor if prefill else 1.0)
            # attention and the gate (and the copies) come first: they decide the routing
            yield env.timeout(tokens * (f_pre + sw_pre) if prefill
                              else tokens * (m.f_dec + m.sw_dec))
            calls = [env.process(remote_call(li, j, n, unit, prefill))
                     for j, n in self._call_tokens(li, counts)]
            yield env.all_of([env.timeout(local), *calls])

        def run_pass(counts_LE: np.ndarray | None, tokens: int, prefill: bool
                     ) -> Generator[simpy.Event, Any, None]:
            for li in range(p.num_layers):  # sampled routing is drawn as each layer starts
                counts = (self.router.counts(li, tokens, self.rng) if counts_LE is None
                          else np.asarray(counts_LE[li]))
                yield from layer(li, counts, tokens, prefill)

        def request(t_arr: float, replay: Sequence[Pass] | None
                    ) -> Generator[simpy.Event, Any, None]:
            yield env.timeout(t_arr)
            for layer_pools in pools:  # remote cold starts overlap the main's
                for pool in layer_pools:
                    pool.prewarm()
            yield from main.acquire()
            start = env.now
            first: float | None = None
            if replay is None:
                yield from run_pass(None, p.n_in, True)
                first = env.now
                for _ in range(p.n_out):
                    yield from run_pass(None, 1, False)
                decodes = p.n_out
            else:
                decodes = 0
                for ps in replay:
                    if not ps.prefill and first is None:
                        first = env.now
                    yield from run_pass(ps.counts_LE, ps.tokens, ps.prefill)
                    decodes += 0 if ps.prefill else 1
            end = env.now
            first = end if first is None else first
            main.release()
            res.cold_s.append(start - t_arr)
            res.prefill_s.append(first - start)
            res.ttft_s.append(first - t_arr)
            res.tpot_s.append((end - first) / decodes if decodes else 0.0)
            res.main_billed_s += self._billed(end - start)
            res.main_cost += m.rate_s * self._billed(end - start)

        for i, t in enumerate(arrivals_s):
            if not (math.isfinite(t) and t >= 0):
                raise SimError(f"arrival times must be finite and >= 0, got {t}")
            env.process(request(float(t), None if passes is None else passes[i]))
        env.run()
        res.main_cold_starts = main.cold_starts
        res.remote_cold_starts = sum(pl.cold_starts for lp in pools for pl in lp)
        if self.billing is not None and self.billing.init_billed:
            res.main_init_cost = m.rate_s * main.cold_s * main.cold_starts
            res.remote_init_cost = sum(rates[li] * pl.cold_s * pl.cold_starts
                                       for li, lp in enumerate(pools) for pl in lp)
        return res
