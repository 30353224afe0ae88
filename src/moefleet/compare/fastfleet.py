"""The monolithic fleet of :mod:`moefleet.compare.fleet` without per-token events: the
same FCFS continuous-batching rule as the engine's ``Scheduler`` (running sequences
first, each its remaining prompt chunk or one decode token within the step's token
budget; then waiting ones admitted while there are free sequence slots and budget), the
same replica, cold-start and keep-alive rules, but a run of identical decode-only steps
is advanced in one stride.

A stride of ``k`` steps is taken only when nothing can change inside it: every running
sequence is decoding, no waiting sequence can be admitted, no sequence finishes before
its last step, no arrival comes before its last step starts, and (with a controller)
it spans at most ``controller_interval_s``. So the result equals the per-token model's
(tested against :class:`~moefleet.compare.fleet.Fleet`, which drives the real
``Scheduler``), at a cost that grows with requests, not with tokens.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from moefleet.compare.fleet import FleetResult

# (tokens in the step, rows, whether any row computes prompt tokens) -> seconds
StepFn = Callable[[int, int, bool], float]
# (step end, any prompt rows, step seconds, TTFTs of the requests whose first token it made)
OnStep = Callable[[float, bool, float, list[float]], None]


@dataclass
class _Rep:
    started: float
    ready: float
    running: list[int] = field(default_factory=list)
    waiting: deque[int] = field(default_factory=deque)
    busy: bool = False
    idle_since: float = 0.0
    dead_at: float | None = None

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)


class FastFleet:
    def __init__(self, step_time: StepFn, *, max_seqs: int, cold_s: float,
                 keep_alive_s: float, max_replicas: int = 1,
                 max_batched_tokens: int | None = 2048, on_step: OnStep | None = None,
                 controller_interval_s: float = 1.0) -> None:
        self.step_time, self.max_seqs, self.cold_s = step_time, max_seqs, cold_s
        self.keep_alive_s, self.max_replicas = keep_alive_s, max_replicas
        self.budget = max_batched_tokens or (1 << 40)
        self.on_step, self.ctl_s = on_step, controller_interval_s

    def run(self, times: np.ndarray, prompts: np.ndarray, outputs: np.ndarray) -> FleetResult:
        n = len(times)
        p_left = np.asarray(prompts, np.int64).copy()
        o_left = np.maximum(np.asarray(outputs, np.int64), 1).copy()
        first = np.zeros(n)
        done = np.zeros(n)
        reps: list[_Rep] = []
        events: list[tuple[float, int, int]] = []  # (step end, order, replica)
        order = 0
        steps = 0
        nxt = 0  # next arrival index

        def alive(r: _Rep, t: float) -> bool:
            if r.dead_at is not None:
                return False
            if (not r.busy and not r.load and not math.isinf(self.keep_alive_s)
                    and t - r.idle_since >= self.keep_alive_s and t >= r.ready):
                r.dead_at = r.idle_since + self.keep_alive_s
                return False
            return True

        def start_step(ri: int, t: float) -> None:
            nonlocal order, steps
            r = reps[ri]
            s = max(t, r.ready)
            budget, rows, tokens, prefill = self.budget, [], 0, False
            for i in r.running:
                if budget == 0:
                    break
                k = min(int(p_left[i]) if p_left[i] > 0 else 1, budget)
                rows.append((i, k))
                prefill |= p_left[i] > 0
                budget -= k
                tokens += k
            while r.waiting and budget > 0 and len(r.running) < self.max_seqs:
                i = r.waiting.popleft()
                r.running.append(i)
                k = min(int(p_left[i]), budget)
                rows.append((i, k))
                prefill = True
                budget -= k
                tokens += k
            dt = self.step_time(tokens, len(rows), prefill)
            stride = 1
            if not prefill and (not r.waiting or len(r.running) >= self.max_seqs):
                stride = int(min(o_left[i] for i, _ in rows))
                if nxt < n:
                    stride = min(stride, max(1, math.ceil((times[nxt] - s) / dt - 1e-12)))
                if self.on_step is not None:
                    stride = min(stride, max(1, int(self.ctl_s / dt)))
            end = s + stride * dt
            ttfts: list[float] = []
            for i, k in rows:
                if p_left[i] > 0:
                    p_left[i] -= k
                    if p_left[i] == 0:
                        first[i] = end
                        o_left[i] -= 1
                        ttfts.append(end - float(times[i]))
                else:
                    o_left[i] -= stride
            r.busy = True
            steps += stride
            order += 1
            heapq.heappush(events, (end, order, ri))
            if self.on_step is not None:
                self.on_step(end, prefill, dt, ttfts)

        def end_step(ri: int, t: float) -> None:
            r = reps[ri]
            r.busy = False
            keep = []
            for i in r.running:
                if o_left[i] <= 0 and p_left[i] == 0:
                    done[i] = t
                else:
                    keep.append(i)
            r.running = keep
            if r.load:
                start_step(ri, t)
            else:
                r.idle_since = t

        while nxt < n or events:
            t_arr = float(times[nxt]) if nxt < n else math.inf
            if events and events[0][0] <= t_arr:
                t, _, ri = heapq.heappop(events)
                end_step(ri, t)
                continue
            i, t = nxt, t_arr
            nxt += 1
            live = [k for k, r in enumerate(reps) if alive(r, t)]
            room = [k for k in live if reps[k].load < self.max_seqs]
            if room:
                ri = room[0]
            elif len(live) < self.max_replicas:
                reps.append(_Rep(t, t + self.cold_s, idle_since=t + self.cold_s))
                ri = len(reps) - 1
            else:
                ri = min(live, key=lambda k: reps[k].load)
            r = reps[ri]
            r.waiting.append(i)
            if not r.busy:
                start_step(ri, t)
        end = float(done.max()) if n else 0.0
        alive_s = 0.0
        for r in reps:
            stop = r.dead_at if r.dead_at is not None else (
                end if math.isinf(self.keep_alive_s) else r.idle_since + self.keep_alive_s)
            alive_s += stop - r.started
        ttft = first - times
        tpot = np.where(outputs > 1, (done - first) / np.maximum(outputs - 1, 1), 0.0)
        makespan = end if math.isinf(self.keep_alive_s) or not reps else max(
            end, max((r.dead_at or r.idle_since + self.keep_alive_s) for r in reps))
        return FleetResult(ttft, tpot, alive_s, len(reps), makespan, steps)
