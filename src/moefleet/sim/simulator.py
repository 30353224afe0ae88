"""The simulator: requests arrive, run prefill and decode passes, get measured and billed.

    arrivals -> request process: prefill pass (P tokens) -> G decode steps (1 token
    each; batched across requests or per request) -> latency, TTFT, TPOT, SLO
    control process, every ``interval_s``: close the interval's metrics -> timeline row
    -> controller.decide(snapshot, state) -> decisions applied ``apply_delay_s`` later

Deterministic: the same inputs and seed give the same result (SimPy orders ties by
insertion; every random draw comes from one numpy Generator). Units: seconds, USD.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import numpy as np
import simpy
from simpy.core import EmptySchedule
from simpy.events import Timeout

from moefleet.control import (
    FunctionConfig,
    FunctionMetrics,
    MetricsSnapshot,
    PolicyState,
    ScalingController,
)
from moefleet.engine.scheduler import SchedulerOutput
from moefleet.errors import DataError, MoefleetError
from moefleet.models.shape import ModelShape
from moefleet.plan.plan import DeploymentPlan, PlanError
from moefleet.platform.billing import Meter
from moefleet.platform.catalog import load_platform
from moefleet.platform.specs import PlatformSpec
from moefleet.profiles.model import ComputeProfile
from moefleet.sim.config import SimConfig, SimError
from moefleet.sim.engine_sim import SimEngine, sim_scheduler_config
from moefleet.sim.metrics import IntervalStats, RequestStats, percentile
from moefleet.sim.pipeline import Pipeline
from moefleet.sim.result import SimResult, build_result
from moefleet.sim.routing import DistributionRouter, Router
from moefleet.workloads.base import Arrival, Workload

ProgressFn = Callable[[float, float], None]  # (simulated seconds, horizon seconds)


class Simulator:
    """Simulate ``plan`` of a model (``profile``) on ``platform``.

    ``router`` defaults to uniform routing with ``top_k``; ``decoder`` (default True)
    makes requests generate output tokens. ``controller`` (a
    :class:`~moefleet.control.ScalingController`, the same objects the runtime control
    loop drives; None = the static plan) decides every ``config.interval_s``.
    """

    def __init__(self, plan: DeploymentPlan, profile: ComputeProfile,
                 platform: PlatformSpec | str, *, router: Router | None = None,
                 config: SimConfig | None = None,
                 controller: ScalingController | None = None,
                 seed: int = 0, top_k: int = 2, decoder: bool = True,
                 initial: Mapping[str, FunctionConfig] | None = None) -> None:
        self.spec = load_platform(platform) if isinstance(platform, str) else platform
        self.initial = dict(initial or {})  # configs deployed from t = 0 (not the plan's)
        self.config = config or SimConfig()
        self.controller = controller
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise SimError(f"seed must be a non-negative integer, got {seed!r}")
        self.seed = seed
        self.plan = plan
        self.profile = profile
        num_experts = (list(router.num_experts) if router is not None
                       else [len(lp.experts) for lp in plan.layers])
        # The plan must fit the model (profile blocks and layers, router experts) first.
        plan.check_model(list(profile.moe_layers), num_experts, len(profile.segments))
        self.router = router or DistributionRouter.uniform(num_experts, top_k)
        try:
            self.shape = ModelShape(name=profile.model, num_layers=len(profile.segments),
                                    moe_layers=list(profile.moe_layers),
                                    num_experts=list(self.router.num_experts),
                                    top_k=self.router.top_k, causal=decoder)
        except DataError as err:  # a simulator input error, whatever class found it
            raise SimError(err.message, err.hint) from err
        _check_inputs(plan, profile, self.spec, self.shape, self.config)
        self._used = False

    # ---- running ----------------------------------------------------------------------
    def run(self, arrivals: Sequence[Arrival] | Workload, duration_s: float,
            progress: ProgressFn | None = None) -> SimResult:
        """Serve every arrival in ``[0, duration_s)`` to completion; one run per object."""
        if isinstance(duration_s, bool) or not isinstance(duration_s, int | float) or not (
                math.isfinite(duration_s) and duration_s >= 0):
            raise SimError(f"duration must be a finite number of seconds >= 0, got "
                           f"{duration_s!r}", "pass e.g. --duration 600")
        if self._used:
            raise SimError("a Simulator runs once", "create a new Simulator for another run")
        self._used = True
        if isinstance(arrivals, Workload):
            arrivals = arrivals.arrivals(duration_s, self.seed)
        _check_arrivals(arrivals, duration_s)
        wall0 = time.perf_counter()
        env = self.env = simpy.Environment()
        rng = np.random.default_rng(self.seed)
        self.meter = Meter(self.spec) if self.config.keep_records else None
        for name, cfg in self.initial.items():
            self._check_config(name, cfg)
        self.pipe = Pipeline(env, self.plan, self.profile, self.spec, self.shape, self.router,
                             self.config, rng, self.meter, self.initial)
        self.stats = RequestStats()
        self.interval = IntervalStats()
        self.in_flight = 0
        self.last_completion_s = 0.0
        self.pending_arrivals = len(arrivals)
        self.timeline: list[dict[str, Any]] = []
        self.request_log: list[dict[str, Any]] = []
        self.reconfigurations = 0
        self._replicas: list[SimEngine] = []
        self._control_state: PolicyState = (self.controller.initial_state()
                                            if self.controller is not None else None)
        env.process(self._arrivals(arrivals))
        env.process(self._control(duration_s, progress))
        events = _drain(env)
        wall = time.perf_counter() - wall0
        return build_result(self, duration_s=duration_s, events=events, wall_s=wall)

    def _arrivals(self, arrivals: Sequence[Arrival]) -> Generator[simpy.Event, Any, None]:
        env = self.env
        for a in arrivals:
            if a.t_s > env.now:
                yield Timeout(env, a.t_s - env.now)
            self.pending_arrivals -= 1
            env.process(self._request(a))

    def _request(self, a: Arrival) -> Generator[simpy.Event, Any, None]:
        cfg, env = self.config, self.env
        prompt = a.prompt_tokens if a.prompt_tokens else cfg.prompt_tokens
        out = 0
        if self.shape.decoder:
            out = a.output_tokens if a.output_tokens is not None else cfg.output_tokens
        t0 = env.now
        self.in_flight += 1
        self.stats.arrived += 1
        self.interval.arrivals += 1
        if out and cfg.decode == "batched":
            req = self._replica().add(a.request_id, prompt, out)
            yield req.done
            assert req.first_token is not None and req.scheduled is not None
            t_first, queue = req.first_token, req.scheduled - t0
        else:
            # no batching: the prefill pass yields the first token, then one pass each;
            # the request is scheduled on arrival (its waits are inside the functions)
            yield from self.pipe.run_pass(prompt, a.request_id)
            t_first, queue = env.now, 0.0
            for _ in range(out - 1):
                yield from self.pipe.run_pass(1, a.request_id)
        self.stats.queue.add(queue)
        self._complete(env.now - t0, t_first - t0, out, prompt)
        if cfg.keep_requests:
            self.request_log.append({"request_id": a.request_id, "t_s": t0,
                                     "latency_s": env.now - t0, "ttft_s": t_first - t0})

    def _complete(self, latency: float, ttft: float, out: int, prompt: int) -> None:
        cfg, st = self.config, self.stats
        self.in_flight -= 1
        self.last_completion_s = self.env.now
        st.completed += 1
        st.prompt_tokens += prompt
        st.output_tokens += out
        st.latency.add(latency)
        st.ttft.add(ttft)
        # time per output token after the first, as the engine reports it
        tpot = (latency - ttft) / (out - 1) if out > 1 else 0.0
        if out > 1:
            st.tpot.add(tpot)
        over = {"e2e": cfg.slo_s is not None and latency > cfg.slo_s,
                "ttft": cfg.ttft_slo_s is not None and ttft > cfg.ttft_slo_s,
                "tpot": out > 1 and cfg.tpot_slo_s is not None and tpot > cfg.tpot_slo_s}
        for phase, hit in over.items():
            st.slo_by_phase[phase] += int(hit)
        bad = any(over.values())
        st.slo_violations += 1 if bad else 0
        iv = self.interval
        iv.completions += 1
        iv.violations += 1 if bad else 0
        iv.latencies.append(latency)

    # ---- batched generation: the engine's scheduler, one per replica ------------------
    def _replica(self) -> SimEngine:
        """The first engine replica with room, or a new one: each runs its own step loop,
        so replicas proceed concurrently (functions scale)."""
        cap = self.config.max_decode_batch
        for r in self._replicas:
            if r.load < cap:
                return r
        replica = SimEngine(self.env, sim_scheduler_config(cap, self.config.max_batched_tokens),
                            self._pass)
        self._replicas.append(replica)
        return replica

    def _pass(self, out: SchedulerOutput) -> Generator[simpy.Event, Any, None]:
        yield from self.pipe.run_pass(out.num_tokens, None)

    # ---- control: metrics, timeline, controller --------------------------------------
    def _control(self, horizon: float,
                 progress: ProgressFn | None) -> Generator[simpy.Event, Any, None]:
        env, step = self.env, self.config.interval_s
        t0 = 0.0
        while True:
            yield Timeout(env, step)
            snap = self._snapshot(t0, env.now)
            t0 = env.now
            if progress is not None:
                progress(min(env.now, horizon), horizon)
            done = self.pending_arrivals == 0 and self.in_flight == 0
            if self.controller is not None and not done:
                decisions, self._control_state = self.controller.decide(snap,
                                                                        self._control_state)
                for name, cfg in sorted(decisions.items()):
                    self._schedule(name, cfg)
            if done:
                return

    def _schedule(self, name: str, cfg: FunctionConfig) -> None:
        pool = self.pipe.pools.get(name)
        if pool is None:
            raise SimError(f"controller decided for unknown function {name!r}")
        self._check_config(name, cfg)
        self.reconfigurations += 1

        def apply(_ev: simpy.Event) -> None:
            pool.configure(cfg)

        Timeout(self.env, self.config.apply_delay_s).callbacks.append(apply)

    def _check_config(self, name: str, cfg: FunctionConfig) -> None:
        """A config the platform offers, else a SimError naming the function."""
        try:
            self.spec.check_memory(cfg.memory_mb)
            self.spec.check_gpu_share(cfg.gpu_share)
        except MoefleetError as err:
            raise SimError(f"controller decision for {name}: {err.message}", err.hint) from err
        limits = self.spec.limits
        assert limits is not None
        if cfg.concurrency > limits.max_concurrency_per_instance:
            raise SimError(f"controller decision for {name}: concurrency {cfg.concurrency} exceeds "
                           f"the platform's {limits.max_concurrency_per_instance}")
        if cfg.replicas > limits.max_replicas:
            raise SimError(f"controller decision for {name}: {cfg.replicas} replicas exceed the "
                           f"platform's {limits.max_replicas}")

    def _snapshot(self, t0: float, t1: float) -> MetricsSnapshot:
        pipe, iv = self.pipe, self.interval
        functions: dict[str, FunctionMetrics] = {}
        for seg in pipe.segments:
            functions[seg.name] = seg.close_interval(t0, t1, 0, 0)
        util: list[list[float]] = []
        for li, pools in enumerate(pipe.experts):
            row = []
            for p in pools:
                m = p.close_interval(t0, t1, pipe.i_layer_tokens[li], pipe.i_layer_passes[li])
                functions[p.name] = m
                row.append(round(m.utilisation, 6))
            util.append(row)
            pipe.i_layer_tokens[li] = pipe.i_layer_passes[li] = 0
        p95 = percentile(iv.latencies, 0.95)
        viol = iv.violations / iv.completions if iv.completions else 0.0
        snap = MetricsSnapshot(
            t_s=t1, interval_s=t1 - t0, functions=functions, arrivals=iv.arrivals,
            completions=iv.completions, in_flight_requests=self.in_flight, p95_latency_s=p95,
            slo_s=self.config.slo_s, slo_violation_rate=viol)
        self.timeline.append({
            "t_s": t1, "arrivals": iv.arrivals, "completions": iv.completions,
            "in_flight": self.in_flight, "p95_latency_s": p95,
            "mean_latency_s": sum(iv.latencies) / len(iv.latencies) if iv.latencies else 0.0,
            "slo_violation_rate": viol,
            "cost_usd": sum(p.cost_compute + p.cost_request + p.cost_storage
                            for p in pipe.all_pools()),
            "instances": sum(m.instances for m in functions.values()),
            "queued": sum(m.queued for m in functions.values()),
            "cold_starts": sum(m.cold_starts for m in functions.values()),
            "expert_utilisation": util,
            "expert_replicas": [[p.config.replicas for p in pools] for pools in pipe.experts],
        })
        iv.reset()
        return snap


def _drain(env: simpy.Environment) -> int:
    """Run to the end, counting processed events (the throughput benchmark's unit)."""
    step = env.step
    n = 0
    try:
        while True:
            step()
            n += 1
    except EmptySchedule:
        return n


def check_not_remoe(plan: DeploymentPlan) -> None:
    """This simulator bills segment and expert functions; a Remoe plan has neither (one
    main function + expert groups), so it would report $0 and 0 s: refused."""
    if plan.main is not None:
        raise SimError("this is a Remoe plan (a main function + expert groups); the "
                       "serverless simulator models segment + expert-function plans only",
                       "its predicted cost and latency are in the plan (moefleet plan show); "
                       "benchmarks/remoe_cost.py runs the Remoe simulator")


def _check_inputs(plan: DeploymentPlan, profile: ComputeProfile, spec: PlatformSpec,
                  shape: ModelShape, cfg: SimConfig) -> None:
    if not spec.is_faas:
        raise SimError(f"platform {spec.name!r} is a {spec.kind}, not serverless",
                       "simulate a FaaS platform (moefleet platforms list)")
    check_not_remoe(plan)
    if plan.platform != spec.name:
        raise PlanError(f"plan was made for platform {plan.platform!r}, not {spec.name!r}",
                        f"simulate on --platform {plan.platform} or re-plan")
    for lp in plan.layers:
        if lp.layer not in profile.experts:
            raise PlanError(f"compute profile has no expert law for MoE layer {lp.layer}",
                            "re-measure the profile for this model")
    plan.check_platform(spec)
    limits = spec.limits
    assert limits is not None
    if cfg.concurrency > limits.max_concurrency_per_instance:
        raise SimError(f"concurrency {cfg.concurrency} exceeds platform {spec.name!r}'s "
                       f"{limits.max_concurrency_per_instance} calls per instance")


def _check_arrivals(arrivals: Sequence[Arrival], duration_s: float) -> None:
    prev = 0.0
    for i, a in enumerate(arrivals):
        if not (math.isfinite(a.t_s) and 0 <= a.t_s < duration_s):
            raise SimError(f"arrival {i} ({a.request_id}) at t={a.t_s!r} s is outside "
                           f"[0, {duration_s:g}) s", "trim the workload to the duration")
        if a.t_s < prev:
            raise SimError(f"arrivals are not sorted: {a.request_id} at t={a.t_s:g} s comes "
                           f"after t={prev:g} s", "sort the workload by time")
        prev = a.t_s
