"""Monolithic engines in simulated time: the engine's own scheduler (``sim.engine_sim.
SimEngine``: FCFS continuous batching, chunked prefill) driven by a step-time model, with
replicas that start cold, serve, and are reclaimed after ``keep_alive_s`` idle.

``Fleet.run`` feeds the scenario's arrivals: a request goes to the first live replica
with room (``max_seqs`` sequences); when none has room and fewer than ``max_replicas``
live, a new replica cold-starts (``cold_s``) and the request waits for it (requests that
arrive meanwhile queue behind it). A replica idle for ``keep_alive_s`` is reclaimed
(scale to zero); ``keep_alive_s = inf`` keeps it (an always-on server). TTFT counts
from the true arrival, so a cold start is in it. ``on_step`` sees every step's kind,
duration and finished rows (SALC's latency samples).

Invariants: every arrival completes; each replica's alive intervals are disjoint and
sorted; the run is deterministic for the same inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from moefleet.engine.scheduler import SchedulerOutput
from moefleet.sim.engine_sim import SimEngine, sim_scheduler_config

StepTime = Callable[[SchedulerOutput], float]


@dataclass
class _Replica:
    engine: SimEngine
    started: float
    ready: simpy.Event
    in_flight: int = 0
    last_done: float = 0.0
    alive: list[tuple[float, float]] = field(default_factory=list)
    dead: bool = False


@dataclass
class FleetResult:
    ttft_s: np.ndarray
    tpot_s: np.ndarray
    alive_s: float  # replica-seconds alive (cold start included)
    cold_starts: int
    makespan_s: float
    steps: int


class Fleet:
    def __init__(self, step_time: StepTime, *, max_seqs: int, cold_s: float,
                 keep_alive_s: float, max_replicas: int = 1,
                 max_batched_tokens: int | None = 2048,
                 on_step: Callable[[float, SchedulerOutput, float], None] | None = None
                 ) -> None:
        self.step_time, self.max_seqs, self.cold_s = step_time, max_seqs, cold_s
        self.keep_alive_s, self.max_replicas = keep_alive_s, max_replicas
        self.max_batched_tokens, self.on_step = max_batched_tokens, on_step

    def run(self, times: np.ndarray, prompts: np.ndarray, outputs: np.ndarray) -> FleetResult:
        env = simpy.Environment()
        n = len(times)
        first = np.zeros(n)
        done = np.zeros(n)
        replicas: list[_Replica] = []
        steps = [0]

        def timed(out: SchedulerOutput) -> Generator[simpy.Event, Any, None]:
            dt = self.step_time(out)
            yield env.timeout(dt)
            steps[0] += 1
            if self.on_step is not None:
                self.on_step(env.now, out, dt)

        def new_replica() -> _Replica:
            cfg = sim_scheduler_config(self.max_seqs, self.max_batched_tokens)
            r = _Replica(SimEngine(env, cfg, timed), env.now, env.timeout(self.cold_s))
            replicas.append(r)
            env.process(reaper(r))
            return r

        def reaper(r: _Replica) -> Generator[simpy.Event, Any, None]:
            if math.isinf(self.keep_alive_s):
                return
            while True:
                idle_since = max(r.last_done, r.started)
                wait = (self.keep_alive_s if r.in_flight
                        else max(1e-6, idle_since + self.keep_alive_s - env.now))
                yield env.timeout(wait)
                if r.in_flight == 0 and env.now - max(r.last_done, r.started) >= \
                        self.keep_alive_s - 1e-9:
                    r.dead = True
                    r.alive.append((r.started, env.now))
                    return

        def serve(i: int, r: _Replica) -> Generator[simpy.Event, Any, None]:
            r.in_flight += 1
            if not r.ready.processed:
                yield r.ready
            req = r.engine.add(str(i), int(prompts[i]), int(outputs[i]))
            yield req.done
            first[i] = req.first_token if req.first_token is not None else env.now
            done[i] = env.now
            r.in_flight -= 1
            r.last_done = env.now

        def feed() -> Generator[simpy.Event, Any, None]:
            for i in range(n):
                if times[i] > env.now:
                    yield env.timeout(times[i] - env.now)
                live = [r for r in replicas if not r.dead]
                room = [r for r in live if r.in_flight < self.max_seqs]
                if room:
                    r = room[0]
                elif len(live) < self.max_replicas:
                    r = new_replica()
                else:  # every replica full: the least loaded queues it
                    r = min(live, key=lambda x: x.in_flight)
                env.process(serve(i, r))

        env.process(feed())
        env.run()
        end = env.now
        alive = 0.0
        for r in replicas:
            if not r.dead:
                r.alive.append((r.started, end))
            alive += sum(b - a for a, b in r.alive)
        ttft = first - times
        tpot = np.where(outputs > 1, (done - first) / np.maximum(outputs - 1, 1), 0.0)
        return FleetResult(ttft, tpot, alive, len(replicas), end, steps[0])
