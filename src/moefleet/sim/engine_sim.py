"""The engine's own :class:`~moefleet.engine.Scheduler` in simulated time.

A :class:`SimEngine` is one engine replica: requests join its scheduler, and its loop
runs schedule -> pass -> update exactly like :meth:`moefleet.engine.Engine.step`, except
that the pass is timed (a SimPy process given by the caller: the serverless pipeline,
or a fitted in-process step-time model) instead of computed. Token values do not matter
to the timing, so prompts are dummy ids and every request produces exactly its output
length (end-of-sequence ignored). TTFT, TPOT and batching therefore come from the same
scheduling decisions the real engine makes.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import simpy

from moefleet.engine.request import SamplingParams
from moefleet.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from moefleet.engine.stops import token_stop

PassFn = Callable[[SchedulerOutput], Generator[simpy.Event, Any, None]]

UNBOUNDED = 1 << 40  # the simulator does not model KV memory: no preemption


def sim_scheduler_config(max_num_seqs: int, max_num_batched_tokens: int | None = None,
                         ) -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens or UNBOUNDED,
                           num_cache_blocks=UNBOUNDED, block_size=16, max_model_len=UNBOUNDED)


@dataclass
class SimRequest:
    """A request's simulated life; ``done`` fires when its last token is produced."""

    request_id: str
    arrival: float
    done: simpy.Event
    first_token: float | None = None
    token_times: list[float] | None = None
    scheduled: float | None = None  # first step that ran any of its tokens


class SimEngine:
    """One engine replica driven by SimPy (see module docstring)."""

    def __init__(self, env: simpy.Environment, config: SchedulerConfig, run_pass: PassFn,
                 keep_token_times: bool = False) -> None:
        self.env = env
        self.scheduler = Scheduler(config)
        self.run_pass = run_pass
        self.keep_token_times = keep_token_times
        self._reqs: dict[int, SimRequest] = {}
        self._wake: simpy.Event | None = None
        self.steps = 0
        env.process(self._loop())

    @property
    def load(self) -> int:
        return len(self.scheduler.seqs)

    def add(self, request_id: str, prompt_tokens: int, output_tokens: int) -> SimRequest:
        params = SamplingParams(max_tokens=max(1, output_tokens), temperature=0,
                                ignore_eos=True)
        seq = self.scheduler.add(request_id, [0] * max(1, prompt_tokens), params,
                                 self.env.now)
        req = SimRequest(request_id, self.env.now, simpy.Event(self.env),
                         token_times=[] if self.keep_token_times else None)
        self._reqs[seq.seq_id] = req
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()
        return req

    def _loop(self) -> Generator[simpy.Event, Any, None]:
        sched = self.scheduler
        while True:
            if not sched.has_unfinished:
                self._wake = simpy.Event(self.env)
                yield self._wake
                continue
            out = sched.schedule()
            for row in out.rows:
                r = self._reqs[row.seq_id]
                if r.scheduled is None:
                    r.scheduled = self.env.now
            yield from self.run_pass(out)
            self.steps += 1
            now = self.env.now
            for row in out.rows:
                if row.sample:
                    r = self._reqs[row.seq_id]
                    if r.first_token is None:
                        r.first_token = now
                    if r.token_times is not None:
                        r.token_times.append(now)
            sampled = {r.seq_id: 0 for r in out.rows if r.sample and r.seq_id in sched.seqs}
            sched.update(out, sampled)
            for seq_id, token in sampled.items():  # the engine's stop rule, EOS unknown here
                seq = sched.seqs[seq_id]
                reason = token_stop(seq.params, token, len(seq.output_ids), None)
                if reason is not None:
                    sched.finish(seq_id, reason)
                    self._reqs.pop(seq_id).done.succeed()


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds of one engine step: ``base + per_token * tokens + per_row * rows``, fitted
    to an engine's measured steps (how real runs parametrise the simulator).

    The fit is robust (Huber loss, by iteratively reweighted least squares): a few steps
    the machine stalled on (a GC pause, another process on the core) would pull a plain
    least-squares fit up and make every simulated step slower than the engine's typical
    one. Residuals within ``1.345`` robust standard deviations (from the median absolute
    deviation) count fully, larger ones with weight falling as ``1/|r|``.
    """

    base_s: float
    per_token_s: float
    per_row_s: float

    def __call__(self, tokens: int, rows: int) -> float:
        return max(0.0, self.base_s + self.per_token_s * tokens + self.per_row_s * rows)

    @classmethod
    def fit(cls, steps: list[tuple[int, int, float]], *, iterations: int = 20) -> StepTimeModel:
        """``steps``: (tokens, rows, seconds) of measured engine steps (>= 3)."""
        import numpy as np

        if len(steps) < 3:
            raise ValueError(f"need >= 3 measured steps to fit a step-time model, got {len(steps)}")
        a = np.array([[1.0, t, r] for t, r, _ in steps])
        y = np.array([s for _, _, s in steps])
        w = np.ones_like(y)
        coef = np.zeros(3)
        for _ in range(iterations):
            sw = np.sqrt(w)
            coef, *_ = np.linalg.lstsq(a * sw[:, None], y * sw, rcond=None)
            r = y - a @ coef
            sigma = 1.4826 * float(np.median(np.abs(r - np.median(r))))
            if sigma <= 0.0:  # (near-)exact fit: nothing to down-weight
                break
            k = 1.345 * sigma
            w_new = np.minimum(1.0, k / np.maximum(np.abs(r), 1e-300))
            if np.allclose(w_new, w, rtol=1e-6, atol=1e-9):
                break
            w = w_new
        return cls(float(coef[0]), float(coef[1]), float(coef[2]))


def simulate_engine(arrivals: list[tuple[float, int, int]], config: SchedulerConfig,
                    step_time: Callable[[int, int], float]) -> list[SimRequest]:
    """One engine replica in simulated time. ``arrivals``: (t_s, prompt, output tokens);
    returns each request's times, in arrival order."""
    env = simpy.Environment()

    def timed(out: SchedulerOutput) -> Generator[simpy.Event, Any, None]:
        yield env.timeout(step_time(out.num_tokens, len(out.rows)))

    engine = SimEngine(env, config, timed, keep_token_times=True)
    reqs: list[SimRequest] = []

    def feed() -> Generator[simpy.Event, Any, None]:
        for i, (t, p, o) in enumerate(arrivals):
            if t > env.now:
                yield env.timeout(t - env.now)
            reqs.append(engine.add(f"r{i}", p, o))

    env.process(feed())
    env.run()
    return reqs
