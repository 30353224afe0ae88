"""The engine's own thread, and the bridge between it and asyncio.

The engine is not thread-safe, so exactly one thread (:class:`EngineWorker`) touches it and
its tokenizer. HTTP handlers hand it work as closures (:meth:`EngineWorker.call`) and
receive every streamed delta on a per-request ``asyncio.Queue``, filled with
``loop.call_soon_threadsafe``. Invariants: a request registered with a sink gets exactly
one finished delta or one :class:`WorkerDied` item; an aborted request gets nothing more
and its cache is freed at once. A request whose model step failed gets a finished delta
with ``finish_reason="error"`` (the handlers turn it into an error response) while the
engine keeps serving the rest. :attr:`EngineWorker.stalled_s` is how long the step now
running has run once it is past ``step_timeout_s`` (the watchdog ``/health`` and the
handlers read; an in-process step cannot be interrupted).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from moefleet.compose.billing import Biller, ByFunction, RequestCost
from moefleet.engine import Engine, RequestOutput
from moefleet.serve.metrics import ServeMetrics

log = logging.getLogger(__name__)


@dataclass
class Delta:
    """One engine delta for one choice, decorated in the engine thread."""

    index: int
    out: RequestOutput
    token_strs: list[str] = field(default_factory=list)
    top_strs: list[dict[str, float]] = field(default_factory=list)
    prompt_token_strs: list[str] | None = None
    prompt_top_strs: list[dict[str, float] | None] | None = None
    cost: RequestCost | None = None


def top_strs(tok: Any, top: dict[int, float]) -> dict[str, float]:
    """Token id -> log-probability, keyed by decoded text instead. Two ids can decode to
    the same text (partial UTF-8 bytes); the larger log-probability is kept, so the dict's
    maximum stays the distribution's maximum (what greedy checks compare against)."""
    out: dict[str, float] = {}
    for k, v in top.items():
        s = tok.decode([k])
        if s not in out or v > out[s]:
            out[s] = v
    return out


@dataclass
class WorkerDied:
    message: str


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any]
    index: int
    token_strs: bool
    prompt_strs: bool


class EngineWorker(threading.Thread):
    """Drives one engine: runs closures between steps, steps while work is pending."""

    def __init__(self, engine: Engine, metrics: ServeMetrics, biller: Biller, *,
                 slo_ttft_s: float | None = None, slo_tpot_s: float | None = None,
                 step_timeout_s: float | None = None,
                 retries: Callable[[], int] | None = None) -> None:
        super().__init__(name="moefleet-engine", daemon=True)
        self.engine = engine
        self._retries_of = retries  # expert calls retried so far (the expert stack's count)
        self.metrics = metrics
        self.biller = biller
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self._cmds: queue.SimpleQueue[tuple[Callable[[Engine], Any], Future[Any]] | None] = (
            queue.SimpleQueue())
        self._sinks: dict[str, _Sink] = {}
        self._expert_seen: dict[int, list[int]] = {}
        self._preemptions = 0
        self._retries = 0
        self.error: str | None = None
        self.pending = 0  # closures submitted and not yet run (read by the event loop)
        self._pending_lock = threading.Lock()
        self.num_waiting = 0  # engine's waiting queue, published after every step
        self._stopping = False
        self._lbl = metrics.model_name
        self.step_timeout_s = step_timeout_s
        self._step_started: float | None = None  # monotonic start of the running step

    @property
    def alive(self) -> bool:
        return self.error is None and self.is_alive()

    @property
    def stalled_s(self) -> float | None:
        """Seconds the running step has taken, once past ``step_timeout_s``; else None."""
        started, limit = self._step_started, self.step_timeout_s
        if started is None or limit is None:
            return None
        took = time.monotonic() - started
        return took if took > limit else None

    # -- called from other threads -----------------------------------------------------
    def call(self, fn: Callable[[Engine], Any]) -> asyncio.Future[Any]:
        """Run ``fn(engine)`` in the engine thread; await the result (or its exception)."""
        fut: Future[Any] = Future()
        if not self.alive:
            fut.set_exception(RuntimeError(self.error or "engine thread is not running"))
        else:
            with self._pending_lock:
                self.pending += 1
            self._cmds.put((fn, fut))
        return asyncio.wrap_future(fut)

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._cmds.put(None)
        if self.is_alive():
            self.join(timeout)

    # -- called in the engine thread (from closures) ------------------------------------
    def register(self, rid: str, sink_queue: asyncio.Queue[Any], loop: asyncio.AbstractEventLoop,
                 index: int, *, token_strs: bool = False, prompt_strs: bool = False) -> None:
        self._sinks[rid] = _Sink(loop, sink_queue, index, token_strs, prompt_strs)
        self.biller.register(rid)

    def abort(self, rid: str) -> bool:
        self._sinks.pop(rid, None)
        self.biller.forget(rid)
        aborted = self.engine.abort(rid)
        if aborted:
            self.metrics.aborted.labels(self._lbl).inc()
        self._publish()
        return aborted

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while not self._stopping:
                if not self.engine.has_unfinished:  # idle: sleep until work arrives
                    try:
                        item = self._cmds.get(timeout=0.5)
                    except queue.Empty:
                        continue
                    if item is None:
                        break
                    self._run_cmd(*item)
                while True:  # drain what else is queued before the next step
                    try:
                        item = self._cmds.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        return
                    self._run_cmd(*item)
                if self.engine.has_unfinished:
                    self._step()
        except Exception:
            self.error = "engine thread died: " + traceback.format_exc(limit=3).splitlines()[-1]
            log.exception("engine thread died; /health now answers 503")
            self._fail_all()

    def _run_cmd(self, fn: Callable[[Engine], Any], fut: Future[Any]) -> None:
        with self._pending_lock:  # += runs on the event loop's thread, -= on this one
            self.pending -= 1
        if not fut.set_running_or_notify_cancel():
            return  # its caller gave up waiting (a stalled step): do not act behind it
        try:
            fut.set_result(fn(self.engine))
        except Exception as err:
            fut.set_exception(err)
        self._publish()

    def _step(self) -> None:
        eng = self.engine
        prev = eng.stats.steps[-1] if eng.stats.steps else None
        self._step_started = time.monotonic()
        try:
            outs = eng.step()
        finally:
            self._step_started = None
        st = eng.stats.steps[-1] if eng.stats.steps else None
        # an empty schedule or a failed step records no step: nothing ran to bill
        if st is not None and st is not prev:
            served = {o.request_id for o in outs} | {s.request_id
                                                     for s in eng.scheduler.running}
            # before delivery: a request finishing now is billed this step's invocations
            self._bill(self.biller.step(served, st.forward_s))
            self.metrics.model_tokens.labels(self._lbl).inc(st.num_tokens)
        for o in outs:
            self._deliver(o)
        self._update_experts()
        self._publish()

    def _deliver(self, o: RequestOutput) -> None:
        m, lbl = self.metrics, self._lbl
        m.generation_tokens.labels(lbl).inc(len(o.new_token_ids))
        sink = self._sinks.get(o.request_id)
        if sink is None:
            return
        d = Delta(sink.index, o)
        tok = self.engine.tokenizer
        if sink.token_strs and tok is not None:
            d.token_strs = [tok.decode([t]) for t in o.new_token_ids]
            d.top_strs = [top_strs(tok, lp.top) for lp in (o.logprobs or [])]
        if sink.prompt_strs and o.prompt_token_ids is not None and tok is not None:
            d.prompt_token_strs = [tok.decode([t]) for t in o.prompt_token_ids]
            if o.prompt_top_logprobs is not None:
                d.prompt_top_strs = [None if t is None else top_strs(tok, t)
                                     for t in o.prompt_top_logprobs]
        if o.finished:
            del self._sinks[o.request_id]
            d.cost, billed = self.biller.finish(o.request_id)
            self._bill(billed)  # a failed request too: its steps ran (a failed Lambda bills)
            if o.finish_reason == "error":
                m.failed.labels(lbl).inc()
            else:
                self._finished(o)
        sink.loop.call_soon_threadsafe(sink.queue.put_nowait, d)

    def _bill(self, billed: ByFunction) -> None:
        for fn, c in billed.items():
            basis = self.biller.basis_of(fn)
            for part, usd in (("compute", c.compute), ("requests", c.request),
                              ("storage", c.storage)):
                self.metrics.billed_cost.labels(self._lbl, fn, part, basis).inc(usd)

    def _finished(self, o: RequestOutput) -> None:
        m, lbl = self.metrics, self._lbl
        m.success.labels(lbl, o.finish_reason or "stop").inc()
        t = o.times
        if t is None:
            return
        if t.ttft_s is not None:
            m.ttft.labels(lbl).observe(t.ttft_s)
            if self.slo_ttft_s is not None and t.ttft_s > self.slo_ttft_s:
                m.slo_violations.labels(lbl, "ttft").inc()
        if t.tpot_s is not None:
            m.tpot.labels(lbl).observe(t.tpot_s)
            if self.slo_tpot_s is not None and t.tpot_s > self.slo_tpot_s:
                m.slo_violations.labels(lbl, "tpot").inc()
        for gap in t.itl_s:
            m.itl.labels(lbl).observe(gap)
        if t.e2e_s is not None:
            m.e2e.labels(lbl).observe(t.e2e_s)
        if t.queue_s is not None:
            m.queue.labels(lbl).observe(t.queue_s)

    def _update_experts(self) -> None:
        for layer, counts in self.engine.stats.expert_tokens.items():
            now = [int(c) for c in counts.tolist()]
            seen = self._expert_seen.setdefault(layer, [0] * len(now))
            for e, (a, b) in enumerate(zip(seen, now, strict=True)):
                if b > a:
                    self.metrics.expert_tokens.labels(self._lbl, str(layer), str(e)).inc(b - a)
            self._expert_seen[layer] = now

    def _publish(self) -> None:
        eng, m, lbl = self.engine, self.metrics, self._lbl
        self.num_waiting = eng.num_waiting
        m.running.labels(lbl).set(eng.num_running)
        m.waiting.labels(lbl).set(eng.num_waiting)
        m.kv_usage.labels(lbl).set(eng.scheduler.cache_usage)
        retries = self._retries_of() if self._retries_of is not None else 0
        if retries > self._retries:
            m.expert_retries.labels(lbl).inc(retries - self._retries)
            self._retries = retries
        pre = eng.scheduler.num_preemptions
        if pre > self._preemptions:
            m.preemptions.labels(lbl).inc(pre - self._preemptions)
            self._preemptions = pre

    def _fail_all(self) -> None:
        for sink in self._sinks.values():
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait,
                                           WorkerDied(self.error or "engine died"))
        self._sinks.clear()
        while True:
            try:
                item = self._cmds.get_nowait()
            except queue.Empty:
                break
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(RuntimeError(self.error or "engine died"))


