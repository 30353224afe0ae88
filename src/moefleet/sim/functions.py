"""One deployed function in the simulator: its instances, their slots, its queue, its bill.

Life of a call: ``submit`` -> a free slot on a warm instance (most recently used first,
like Lambda), else a new instance if below the cap (cold start), else the FIFO queue ->
one SimPy event of start delay + handler -> ``finish``: free the slot, bill the call
with the platform's prices, start the next queued call, tell the caller's barrier.

A cold start delays the call by the invoke round trip (warm start) plus INIT (runtime
start + parameter download; billed where the platform bills INIT). Invariants:
``0 <= inst.active <= concurrency`` for every live instance; an instance is warm from
``ready_s`` until ``keep_alive_s`` after its last call ends, then it is dead
(scale to zero; expiry is detected lazily, with the exact death time); a memory change
bumps ``version``: old instances finish their calls and die, new calls cold-start new
ones. Concurrent calls on one instance share its vCPUs (each call's speed is fixed at
its start from the calls running then).

GPU slices (emulated): a function with ``gpu_share`` s > 0 runs each call's compute on
its slice: the profile's per-call overhead on the host vCPUs, plus
:func:`moefleet.profiles.gpu.gpu_call_s` (the roofline kernel / s and the host <-> device
copy of the call's tokens); concurrent calls split the slice as they split vCPUs. It is
billed at the platform's GPU price x s on top of memory and vCPUs, and a share change
restarts instances like a memory change (a pod's GPU request is not resized in place).
Units: seconds, MB, USD.
"""

from __future__ import annotations

from collections import deque
from typing import Literal

import simpy
from simpy.events import NORMAL

from moefleet.control import FunctionConfig, FunctionMetrics
from moefleet.plan.plan import Method
from moefleet.platform.billing import InvocationRecord, Meter
from moefleet.platform.specs import MB_PER_GB, PlatformSpec
from moefleet.profiles.gpu import gpu_call_s
from moefleet.profiles.model import FunctionProfile
from moefleet.sim.config import SimConfig
from moefleet.sim.entities import Call, Instance, Node
from moefleet.sim.metrics import percentile
from moefleet.sim.timing import Links, expert_handler_s


class FunctionPool:
    """A function (segment of a block, or one expert) and everything it runs."""

    def __init__(self, env: simpy.Environment, name: str, kind: Literal["segment", "expert"],
                 layer: int, expert: int | None, config: FunctionConfig, *,
                 profile: FunctionProfile, spec: PlatformSpec, sim: SimConfig, links: Links,
                 method: Method = "direct", beta: int = 1, meter: Meter | None = None,
                 node: Node | None = None) -> None:
        assert spec.limits is not None and spec.startup is not None and spec.storage is not None
        self.env = env
        self.name, self.kind, self.layer, self.expert = name, kind, layer, expert
        self.profile, self.spec, self.links = profile, spec, links
        self.method, self.beta = method, beta
        self.meter = meter
        self.node = node
        self.keep_alive = sim.keep_alive_s
        self.on_demand = sim.scaling == "on-demand"
        self.platform_cap = spec.limits.max_replicas
        self.warm_s = spec.startup.warm_start_s if sim.warm_start_s is None else sim.warm_start_s
        self.caller_s = sim.caller_overhead_s  # after the handler, off every slot
        cold = spec.startup.cold_start_s if sim.cold_start_s is None else sim.cold_start_s
        self.param_load_s = links.access_s + profile.param_bytes / links.storage_bps
        self.reload = sim.reload_params
        # Cold start = runtime start + (unless reloaded per call) the parameter download.
        self.init_s = cold + (0.0 if self.reload else self.param_load_s)
        self.call_overhead_s = sim.overhead_s(kind)
        self.compute_scale = sim.scale_of(kind)
        self.gpu = sim.gpu
        self.bytes_per_token = links.bytes_per_token
        self.pipelined = kind == "expert" and method == "pipelined"
        billing = spec.billing
        assert billing is not None
        self.billing = billing  # its ``billed_s`` is the platform meter's one rule
        self.req_fee = spec.request_cost(1)
        self.put_fee = spec.storage.price_per_put
        self.get_fee = spec.storage.price_per_get
        self.version = 0
        self.queue: deque[Call] = deque()
        self.avail: list[Instance] = []
        self.live: dict[int, Instance] = {}
        self.dead_recent: list[Instance] = []
        self.n_live = self.peak_live = self.in_flight = 0
        # Whole-run totals (bill, counts) and per-interval counters.
        self.cost_compute = self.cost_storage = 0.0
        self.billed_s_total = self.gb_s = 0.0  # gb_s accumulates MB x s (see gb_s_total)
        self.invocations = self.cold_starts = self.total_tokens = 0
        self.total_busy_s = self.work_s = 0.0  # work_s: handler seconds (billed, INIT aside)
        self.i_calls = self.i_tokens = self.i_cold = self.i_passes = self.i_sub_tokens = 0
        self.i_busy_s = 0.0
        self.i_lat: list[float] = []
        self.config = config
        self._speed: dict[float, float] = {}
        self.configure(config)

    # ---- configuration --------------------------------------------------------------
    def configure(self, config: FunctionConfig) -> None:
        """Apply a new configuration now (the caller adds the propagation delay)."""
        if (config.memory_mb, config.gpu_share) != (self.config.memory_mb,
                                                    self.config.gpu_share):
            self.version += 1  # running instances keep the old size until they finish
        self.config = config
        self.vcpus = self.spec.vcpus(config.memory_mb)
        self.gpu_share = config.gpu_share
        # USD per billed second: memory, vCPUs and (GPU share x the GPU price)
        self.rate = self.spec.compute_cost(config.memory_mb, 1.0, None, config.gpu_share)
        self.concurrency = config.concurrency
        self.cap = self.platform_cap if self.on_demand else config.replicas
        if not self.on_demand:
            self._shrink(self.env.now)
        self._drain(self.env.now)

    def _shrink(self, now: float) -> None:
        """Pods: a scale-down terminates idle instances above the new replica count now
        (busy ones retire when their calls finish, in ``finish``)."""
        extra = self.n_live - self.cap
        if extra <= 0:
            return
        keep: list[Instance] = []
        for inst in self.avail:
            if extra > 0 and not inst.dead and inst.active == 0:
                inst.in_avail = False
                self._kill(inst, now)
                extra -= 1
            elif not inst.dead:
                keep.append(inst)
        self.avail = keep

    def prewarm(self, count: int) -> None:
        """``count`` instances warm at the current time (provisioned, init not billed)."""
        now = self.env.now
        for _ in range(count):
            inst = Instance(self.version, self.config.memory_mb, self.vcpus, self.rate,
                            now, now, self.gpu_share)
            inst.fresh = False
            self._add_live(inst)
            inst.in_avail = True
            self.avail.append(inst)

    # ---- timing ---------------------------------------------------------------------
    def compute_s(self, tokens: int, vcpus: float, gpu_share: float = 0.0) -> float:
        """Compute seconds of one call: on the vCPUs by the profile's laws, or with a GPU
        share the per-call overhead on the host plus the slice's time (module doc)."""
        speed = self._speed.get(vcpus)
        if speed is None:
            speed = self._speed[vcpus] = self.profile.threads.speed_factor(vcpus)
        law = self.profile.batch
        if gpu_share > 0:
            return (law.overhead_s * speed + self.call_overhead_s
                    + gpu_call_s(self.gpu, gpu_share, tokens, self.profile.param_bytes,
                                 self.bytes_per_token))
        return ((law.overhead_s + law.per_token_s * tokens) * speed * self.compute_scale
                + self.call_overhead_s)

    def handler_s(self, call: Call, vcpus: float, gpu_share: float = 0.0) -> float:
        extra = self.param_load_s if self.reload else 0.0
        if self.pipelined:
            return extra + expert_handler_s("pipelined", call.tokens, self.beta,
                                            lambda m: self.compute_s(m, vcpus, gpu_share),
                                            self.links)
        if not call.compute:
            return extra + call.fixed_s + self.call_overhead_s
        return extra + call.fixed_s + self.compute_s(call.tokens, vcpus, gpu_share)

    def billed_s(self, handler_s: float, init_s: float) -> float:
        """Billed seconds of one call: the platform meter's rule (``Billing.billed_s``)."""
        return self.billing.billed_s(handler_s, init_s)

    # ---- calls ----------------------------------------------------------------------
    def submit(self, call: Call) -> None:
        now = self.env._now
        call.submit_s = now
        inst = self._acquire(now)
        if inst is None:
            self.queue.append(call)
        else:
            self._launch(inst, call, now)

    def _launch(self, inst: Instance, call: Call, now: float) -> None:
        node = self.node
        if node is not None:
            if not node.free:
                node.waiting.append((self, inst, call))
                return
            node.free -= 1
        self.start_call(inst, call, now)

    def _acquire(self, now: float) -> Instance | None:
        avail = self.avail
        while avail:
            inst = avail[-1]
            if inst.dead or inst.active >= self.concurrency or inst.version != self.version:
                avail.pop()
                inst.in_avail = False
                if not inst.dead and inst.active == 0:
                    self._kill(inst, now)  # an idle instance of an old configuration
                continue
            if inst.active == 0 and now - inst.last_end > self.keep_alive:
                avail.pop()  # LIFO: everything below has been idle longer, reaped lazily
                inst.in_avail = False
                self._kill(inst, inst.last_end + self.keep_alive)
                continue
            inst.active += 1
            if inst.active >= self.concurrency:
                avail.pop()
                inst.in_avail = False
            return inst
        if self.n_live >= self.cap:
            self._reap(now)
        if self.n_live >= self.cap:
            return None
        # The invoke round trip (warm start) is paid cold too, before INIT.
        inst = Instance(self.version, self.config.memory_mb, self.vcpus, self.rate, now,
                        now + self.warm_s + self.init_s, self.gpu_share)
        self._add_live(inst)
        inst.active = 1
        if self.concurrency > 1:
            inst.in_avail = True
            avail.append(inst)
        return inst

    def start_call(self, inst: Instance, call: Call, now: float) -> None:
        """Run ``call`` on ``inst`` (a slot already held) from ``now``."""
        if inst.fresh:
            inst.fresh = False
            call.cold = True
            call.init_s = self.init_s
            delay = inst.ready_s - now
        elif inst.ready_s > now:
            delay = inst.ready_s - now  # joins an instance that is still starting
        else:
            delay = self.warm_s
        vcpus = inst.vcpus / inst.active if inst.active > 1 else inst.vcpus
        share = inst.gpu_share / inst.active if inst.active > 1 else inst.gpu_share
        call.inst = inst
        call.begin_s = now
        call.handler_s = handler = self.handler_s(call, vcpus, share)
        self.in_flight += 1
        # The call is its own timeout event: triggered now, processed at its end.
        call.env = self.env
        call.callbacks = [self.finish]
        call._ok = True
        call._value = None
        self.env.schedule(call, NORMAL, delay + handler)

    def finish(self, call: simpy.Event) -> None:
        assert isinstance(call, Call)
        now = self.env._now
        inst = call.inst
        inst.active -= 1
        inst.last_end = now
        self.in_flight -= 1
        busy = now - call.begin_s
        tokens = call.tokens
        self.i_calls += 1
        self.i_tokens += tokens
        self.i_busy_s += busy
        self.i_lat.append(now - call.submit_s)
        self.total_tokens += tokens
        self.total_busy_s += busy
        self.work_s += call.handler_s
        # Bill with the meter's rule (``Billing.billed_s``) x the (memory, vCPU, GPU) price
        # per second (inst.rate = spec.compute_cost(mem, 1 s)), a request fee, storage
        # request fees.
        billed = self.billing.billed_s(call.handler_s, call.init_s)
        self.cost_compute += inst.rate * billed
        self.billed_s_total += billed
        self.gb_s += inst.memory_mb * billed
        self.invocations += 1
        gets = call.gets + self.reload
        if gets or call.puts:
            self.cost_storage += gets * self.get_fee + call.puts * self.put_fee
        if call.cold:
            self.cold_starts += 1
            self.i_cold += 1
        if self.meter is not None:
            self._record(call, inst, gets, now)
        if inst.version != self.version or (self.n_live > self.cap and inst.active == 0):
            if inst.active == 0:
                self._kill(inst, now)  # retire: old size, or more instances than allowed
        elif not inst.in_avail and inst.active < self.concurrency:
            inst.in_avail = True
            self.avail.append(inst)
        if self.node is not None:
            self.node.release(now)
        if self.queue:
            self._drain(now)
        bar = call.barrier
        visible = now + call.resp_s + self.caller_s
        if visible > bar.until:
            bar.until = visible
        bar.pending -= 1
        if not bar.pending:
            bar.release()

    def _drain(self, now: float) -> None:
        while self.queue:
            inst = self._acquire(now)
            if inst is None:
                return
            self._launch(inst, self.queue.popleft(), now)

    def _record(self, call: Call, inst: Instance, gets: int, now: float) -> None:
        assert self.meter is not None
        nbytes = call.tokens * self.links.bytes_per_token
        self.meter.add(InvocationRecord(
            function=self.name, kind=self.kind, memory_mb=inst.memory_mb,
            gpu_share=inst.gpu_share,
            start_s=now - call.handler_s, end_s=now, layer=self.layer, expert=self.expert,
            request_id=call.request_id, init_s=call.init_s, cold=call.cold,
            bytes_in=nbytes, bytes_out=nbytes, storage_puts=call.puts, storage_gets=gets))

    @property
    def cost_request(self) -> float:
        return self.invocations * self.req_fee

    @property
    def gb_s_total(self) -> float:
        return self.gb_s / MB_PER_GB

    # ---- instances ------------------------------------------------------------------
    def _add_live(self, inst: Instance) -> None:
        self.live[id(inst)] = inst
        self.n_live += 1
        self.peak_live = max(self.peak_live, self.n_live)

    def _kill(self, inst: Instance, death_s: float) -> None:
        inst.dead = True
        inst.death_s = death_s
        del self.live[id(inst)]
        self.n_live -= 1
        self.dead_recent.append(inst)

    def _reap(self, now: float) -> None:
        """Kill every idle instance whose keep-alive ran out (at its exact expiry)."""
        keep: list[Instance] = []
        for inst in self.avail:
            if inst.dead:
                continue
            if inst.active == 0 and now - inst.last_end > self.keep_alive:
                inst.in_avail = False
                self._kill(inst, inst.last_end + self.keep_alive)
            else:
                keep.append(inst)
        self.avail = keep

    # ---- metrics --------------------------------------------------------------------
    def close_interval(self, t0: float, t1: float, layer_tokens: int,
                       layer_passes: int) -> FunctionMetrics:
        """Metrics of [t0, t1) for the policy and the timeline; resets the counters."""
        self._reap(t1)
        inst_s = sum(t1 - max(i.spawn_s, t0) for i in self.live.values())
        inst_s += sum(max(0.0, min(i.death_s, t1) - max(i.spawn_s, t0))
                      for i in self.dead_recent)
        self.dead_recent = []
        per_token = (gpu_call_s(self.gpu, self.gpu_share, 64, self.profile.param_bytes,
                                self.bytes_per_token) / 64 if self.gpu_share > 0
                     else self.profile.per_token_s(self.vcpus))
        m = FunctionMetrics(
            name=self.name, kind=self.kind, layer=self.layer, expert=self.expert,
            config=self.config, instances=self.n_live, in_flight=self.in_flight,
            queued=len(self.queue), calls=self.i_calls, tokens=self.i_tokens,
            cold_starts=self.i_cold, busy_s=self.i_busy_s, instance_s=inst_s,
            p95_latency_s=percentile(self.i_lat, 0.95),
            token_share=self.i_sub_tokens / layer_tokens if layer_tokens else 0.0,
            request_share=self.i_passes / layer_passes if layer_passes else 0.0,
            capacity_tokens_per_s=1.0 / per_token if per_token > 0 else 0.0,
            interval_s=max(t1 - t0, 1e-12))
        self.i_calls = self.i_tokens = self.i_cold = self.i_passes = self.i_sub_tokens = 0
        self.i_busy_s = 0.0
        self.i_lat = []
        return m
