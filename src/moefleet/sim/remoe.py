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
c_g·M_g + c_c·w, each remote call for its duration at c_c·y, optionally rounded up to
the platform's billing granularity; cold starts are not billed (as in the paper).
Units: seconds, USD.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from moefleet.plan.remoe.model import Layout, main_times
from moefleet.plan.remoe.problem import RemoeProblem
from moefleet.sim.config import SimError
from moefleet.sim.routing import DistributionRouter


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
    remote_calls: int = 0
    main_cold_starts: int = 0
    remote_cold_starts: int = 0

    @property
    def cost_usd(self) -> float:
        return self.main_cost + self.remote_prefill_cost + self.remote_decode_cost

    def summary(self) -> dict[str, Any]:
        def mean(v: list[float]) -> float:
            return float(np.mean(v)) if v else math.nan

        return {"requests": len(self.ttft_s), "cost_usd": self.cost_usd,
                "main_cost_usd": self.main_cost,
                "remote_prefill_cost_usd": self.remote_prefill_cost,
                "remote_decode_cost_usd": self.remote_decode_cost,
                "mean_ttft_s": mean(self.ttft_s), "mean_tpot_s": mean(self.tpot_s),
                "mean_prefill_s": mean(self.prefill_s), "mean_cold_s": mean(self.cold_s),
                "remote_calls": self.remote_calls, "main_cold_starts": self.main_cold_starts,
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
                 keep_alive_s: float = 600.0, billing_granularity_s: float = 0.0,
                 s_LE: np.ndarray | None = None) -> None:
        if not (math.isfinite(keep_alive_s) and keep_alive_s >= 0):
            raise SimError(f"keep_alive_s must be >= 0, got {keep_alive_s}")
        if not (math.isfinite(billing_granularity_s) and billing_granularity_s >= 0):
            raise SimError(f"billing_granularity_s must be >= 0, got {billing_granularity_s}")
        x = np.asarray(lay.remote_LE, bool)
        if x.shape != p.s_LE.shape or len(lay.groups) != p.num_layers:
            raise SimError(f"layout of shape {x.shape} does not match the problem's "
                           f"{p.s_LE.shape}", "plan the layout for this problem")
        self.p, self.lay, self.x = p, lay, x
        # The routing actually served: the plan's prediction unless the caller passes the
        # requests' real distribution (SPS error is then part of the simulated cost).
        self.router = DistributionRouter(p.s_LE if s_LE is None else s_LE, p.top_k)
        self.rng = np.random.default_rng(seed)
        self.gran = billing_granularity_s
        self.keep_alive_s = keep_alive_s
        self.m = main_times(p, lay)

    def _billed(self, s: float) -> float:
        if self.gran <= 0:
            return s
        return math.ceil(s / self.gran - 1e-9) * self.gran

    def run(self, arrivals_s: Sequence[float]) -> RemoeSimResult:
        """Simulate one request per arrival time (each the problem's n_in / n_out)."""
        p, lay, m = self.p, self.lay, self.m
        env = simpy.Environment()
        load = 1.0 / p.load_bytes_s if p.load_bytes_s > 0 else 0.0
        main = _Pool(env, p.cold_main_s + (p.nonexpert_bytes + m.main_experts
                                           * p.expert_bytes) * load, self.keep_alive_s)
        pools = [[_Pool(env, p.cold_remote_s + len(g) * p.expert_bytes * load,
                        self.keep_alive_s) for g in lay.groups[li]]
                 for li in range(p.num_layers)]
        res = RemoeSimResult()
        wire = 2.0 * p.token_bytes / p.transfer_bytes_s
        y_gb = [p.gb(mb) for mb in lay.remote_mb]
        units = [p.expert_s(y) if y > 0 else 0.0 for y in y_gb]
        rates = [p.cpu_rate(y) for y in y_gb]

        def remote_call(li: int, j: int, tokens: int, unit: float, prefill: bool
                        ) -> Generator[simpy.Event, Any, None]:
            pool = pools[li][j]
            yield from pool.acquire()
            dur = tokens * (unit + wire) + p.invoke_overhead_s  # eqs. 3 and 5
            yield env.timeout(dur)
            pool.release()
            res.remote_calls += 1
            cost = rates[li] * self._billed(dur)
            if prefill:
                res.remote_prefill_cost += cost
            else:
                res.remote_decode_cost += cost

        def layer(li: int, n: int, prefill: bool) -> Generator[simpy.Event, Any, None]:
            counts = self.router.counts(li, n, self.rng)
            xl = self.x[li]
            t_loc = m.t_loc_pre if prefill else m.t_loc
            local = float(np.sum(counts[~xl])) * t_loc
            unit = units[li] * (p.prefill_factor if prefill else 1.0)
            # attention and the gate (and the copies) come first: they decide the routing
            yield env.timeout((m.f_pre + m.sw_pre) if prefill else (m.f_dec + m.sw_dec))
            calls = [env.process(remote_call(li, j, int(sum(counts[k] for k in g)), unit,
                                             prefill))
                     for j, g in enumerate(lay.groups[li]) if sum(counts[k] for k in g)]
            yield env.all_of([env.timeout(local), *calls])

        def request(t_arr: float) -> Generator[simpy.Event, Any, None]:
            yield env.timeout(t_arr)
            for layer_pools in pools:  # remote cold starts overlap the main's
                for pool in layer_pools:
                    pool.prewarm()
            yield from main.acquire()
            start = env.now
            for li in range(p.num_layers):
                yield from layer(li, p.n_in, True)
            first = env.now
            for _ in range(p.n_out):
                for li in range(p.num_layers):
                    yield from layer(li, 1, False)
            end = env.now
            main.release()
            res.cold_s.append(start - t_arr)
            res.prefill_s.append(first - start)
            res.ttft_s.append(first - t_arr)
            res.tpot_s.append((end - first) / p.n_out)
            res.main_cost += m.rate_s * self._billed(end - start)

        for t in arrivals_s:
            if not (math.isfinite(t) and t >= 0):
                raise SimError(f"arrival times must be finite and >= 0, got {t}")
            env.process(request(float(t)))
        env.run()
        res.main_cold_starts = main.cold_starts
        res.remote_cold_starts = sum(pl.cold_starts for lp in pools for pl in lp)
        return res
