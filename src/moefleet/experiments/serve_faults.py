"""Requests through the generation engine and the HTTP server under injected expert
faults, each one accounted for: accepted = completed + failed-with-a-clear-error + lost,
and ``lost`` must be 0.

- :func:`run_engine_under_faults` drives an engine whose experts go through
  :class:`~moefleet.runtime.faults.FaultyExperts`; a request still unfinished when the
  wall-clock bound runs out is *lost* (it hung).
- :func:`run_http_under_faults` sends ``requests`` completions (every other one
  streamed) to a running server over real HTTP, at most ``concurrency`` at a time, each
  with a client timeout. *Completed*: a 200 with a finish reason (streams: ending in
  ``[DONE]`` with no error event). *Failed*: an error in OpenAI's shape with a message
  (a status >= 400, or an in-stream error event followed by ``[DONE]``). *Lost*:
  anything else — a client timeout, a dropped connection, a stream cut short, a
  malformed answer.

Outputs are greedy, so a completed request's tokens are compared with a fault-free run
(``reference``); the engine's retries are exact, the server's batches depend on arrival
timing, so its equality count is informative rather than guaranteed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from moefleet.compose.root import OpenedEngine
from moefleet.engine import EngineError, SamplingParams
from moefleet.experiments.fault_runs import FaultRun
from moefleet.experts.faults import FaultyExperts
from moefleet.experts.stack import find
from moefleet.runtime.faults import FaultPlan
from moefleet.runtime.retry import POLICIES
from moefleet.serve.bench import sse_events

MAX_REQUESTS = 10_000  # bounds what a caller's number can queue


@dataclass
class EngineFaultRun(FaultRun):
    """A :class:`FaultRun` of the engine or the server; outputs compare to fault-free."""

    outputs: dict[int, list[int] | str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["outputs_equal_fault_free"] = d.pop("outputs_equal_monolithic")
        d["retry_policy"] = POLICIES["engine"].to_dict()
        d["emulated"] = True  # faults are injected at the in-process expert seam
        if not self.latencies_s:  # nothing completed: no latency to quote
            d["latency_p50_s"] = d["latency_p95_s"] = None
        return d


def _check(n: int) -> None:
    if not 1 <= n <= MAX_REQUESTS:
        raise EngineError(f"requests must be in [1, {MAX_REQUESTS}], got {n}", "e.g. 32")


def run_engine_under_faults(opened: OpenedEngine, prompts: Sequence[list[int]],
                            params: SamplingParams,
                            reference: Sequence[list[int]] | None = None,
                            bound_s: float = 300.0) -> EngineFaultRun:
    """Submit every prompt at once, step until all finish or ``bound_s`` passes.

    ``opened``'s expert stack injects the faults (and counts them); ``reference`` the
    fault-free output tokens per prompt."""
    _check(len(prompts))
    engine = opened.engine
    faulty = find(opened.stack, FaultyExperts)
    plan = faulty.plan if faulty is not None else FaultPlan("none", 0.0)
    run = EngineFaultRun("engine", plan.kind, plan.rate)
    retries0 = opened.retries
    t0 = time.perf_counter()
    rids = {engine.add_request(p, params): i for i, p in enumerate(prompts)}
    run.accepted = len(rids)
    tokens: dict[str, list[int]] = {r: [] for r in rids}
    deadline = time.monotonic() + bound_s
    while engine.has_unfinished and time.monotonic() < deadline:
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)
            if not o.finished:
                continue
            i = rids[o.request_id]
            if o.finish_reason == "error":
                run.failed += 1
                run.errors.append(o.error or "")
                continue
            run.completed += 1
            run.outputs[i] = tokens[o.request_id]
            if o.times is not None and o.times.e2e_s is not None:
                run.latencies_s.append(o.times.e2e_s)
            if reference is not None:
                run.outputs_equal += int(tokens[o.request_id] == list(reference[i]))
    for rid in list(rids):  # hung past the bound: lost; free them so the engine is reusable
        engine.abort(rid)
    wall = time.perf_counter() - t0
    run.cost_usd = _wall_cost(wall)
    run.injected = faulty.injected if faulty is not None else 0
    run.retries = opened.retries - retries0
    return run


def _wall_cost(wall_s: float) -> float:
    """The engine process priced as one aws-lambda function of 2048 MB for the run."""
    from moefleet.compose.billing import InProcessPricer
    from moefleet.platform import load_platform

    return InProcessPricer(load_platform("aws-lambda"), 2048).price(wall_s).total


@dataclass
class _Outcome:
    kind: str  # completed | failed | lost
    detail: str = ""
    text: str = ""
    latency_s: float = 0.0


async def _one(session: Any, url: str, model: str, prompt: str, max_tokens: int,
               stream: bool, timeout_s: float) -> _Outcome:
    import aiohttp

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream,
            "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if not stream or resp.status != 200:
                data = await resp.json(content_type=None)
                if resp.status != 200:
                    msg = (data.get("error") or {}).get("message") if isinstance(data, dict) \
                        else None
                    return _Outcome("failed", f"HTTP {resp.status}: {msg}") if msg else \
                        _Outcome("lost", f"HTTP {resp.status} without an error message")
                choice = data["choices"][0]
                if choice.get("finish_reason") is None:
                    return _Outcome("lost", "200 without a finish reason")
                return _Outcome("completed", text=choice["text"],
                                latency_s=time.perf_counter() - t0)
            return await _read_stream(resp, t0)
    except TimeoutError:
        return _Outcome("lost", f"client timeout after {timeout_s:g} s")
    except (aiohttp.ClientError, OSError, ValueError, KeyError, TypeError) as err:
        return _Outcome("lost", f"{type(err).__name__}: {err}")


async def _read_stream(resp: Any, t0: float) -> _Outcome:
    text, finish, error = "", None, None
    async for ev in sse_events(resp):
        if ev is None:  # data: [DONE]
            if error is not None:
                return _Outcome("failed", f"in-stream error: {error}")
            if finish is None:
                return _Outcome("lost", "[DONE] before a finish reason")
            return _Outcome("completed", text=text, latency_s=time.perf_counter() - t0)
        if "error" in ev:
            error = ev["error"].get("message") or None
            if error is None:
                return _Outcome("lost", "in-stream error without a message")
            continue
        for ch in ev.get("choices", []):
            text += ch.get("text", "")
            finish = ch.get("finish_reason") or finish
    return _Outcome("lost", "stream ended without [DONE]")


def _metric(metrics_text: str, name: str) -> float:
    """Sum of every series of ``name`` in a /metrics page."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _counters(metrics_text: str) -> tuple[float, float]:
    """(billed USD, failed requests included; expert calls retried) so far."""
    from moefleet.serve.metrics import BILLED_COST, EXPERT_RETRIES

    return _metric(metrics_text, BILLED_COST), _metric(metrics_text, EXPERT_RETRIES)


async def _get(session: Any, url: str, timeout_s: float) -> tuple[int, str]:
    import aiohttp

    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        return resp.status, await resp.text()


async def _http_run(url: str, prompts: Sequence[str], max_tokens: int, concurrency: int,
                    timeout_s: float) -> tuple[list[_Outcome], str, tuple[float, float]]:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        model = str(json.loads((await _get(session, url + "/v1/models", timeout_s))[1])
                    ["data"][0]["id"])
        before = _counters((await _get(session, url + "/metrics", timeout_s))[1])
        gate = asyncio.Semaphore(concurrency)

        async def bounded(i: int) -> _Outcome:
            async with gate:
                return await _one(session, url, model, prompts[i], max_tokens, i % 2 == 1,
                                  timeout_s)

        outs = await asyncio.gather(*(bounded(i) for i in range(len(prompts))))
        health = (await _get(session, url + "/health", timeout_s))[0]
        after = _counters((await _get(session, url + "/metrics", timeout_s))[1])
    return list(outs), str(health), (after[0] - before[0], after[1] - before[1])


def run_http_under_faults(url: str, plan: FaultPlan, prompts: Sequence[str], *,
                          max_tokens: int = 16, concurrency: int = 8, timeout_s: float = 60.0,
                          reference: Sequence[str] | None = None) -> tuple[EngineFaultRun, str]:
    """Send every prompt (odd ones streamed) to the server at ``url`` (whose experts
    inject ``plan``'s faults); returns the run and ``/health``'s status afterwards."""
    _check(len(prompts))
    if not 1 <= concurrency <= 1024:
        raise EngineError(f"concurrency must be in [1, 1024], got {concurrency}", "e.g. 8")
    outs, health, (billed, retries) = asyncio.run(_http_run(
        url.rstrip("/"), prompts, max_tokens, concurrency, timeout_s))
    run = EngineFaultRun("http", plan.kind, plan.rate, accepted=len(outs), cost_usd=billed,
                         retries=int(retries))
    for i, o in enumerate(outs):
        if o.kind == "completed":
            run.completed += 1
            run.latencies_s.append(o.latency_s)
            run.outputs[i] = o.text
            if reference is not None:
                run.outputs_equal += int(o.text == reference[i])
        elif o.kind == "failed":
            run.failed += 1
            run.errors.append(o.detail)
        else:
            run.errors.append("LOST " + o.detail)
    return run, health
