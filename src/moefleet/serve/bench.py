"""A load generator for an OpenAI-compatible server: replay arrivals, stream, measure.

Each arrival of a workload (see :mod:`moefleet.workloads`) becomes one streamed
``/v1/completions`` request sent at its time; the client records when every chunk came
back. Bounded: at most ``max_requests`` requests, and requests still open
``drain_s`` after the last arrival are cancelled (counted as failed). Latencies are
client-side (network and HTTP included); billed cost is what the server put in ``usage``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from moefleet.errors import MoefleetError
from moefleet.metric_names import COST_PARTS, named_figures
from moefleet.workloads import Arrival

MAX_REQUESTS = 100_000


@dataclass
class BenchConfig:
    url: str
    prompts: list[str]
    arrivals: list[Arrival]
    model: str | None = None
    max_tokens: int = 64
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    api_key: str | None = None
    drain_s: float = 60.0
    ignore_eos: bool = True

    def __post_init__(self) -> None:
        if not self.prompts:
            raise MoefleetError("no prompts to send", "pick a dataset with prompts")
        if not 1 <= self.max_tokens <= 65_536:
            raise MoefleetError(f"max_tokens must be in [1, 65536], got {self.max_tokens}",
                                "e.g. --max-tokens 64")
        if len(self.arrivals) > MAX_REQUESTS:
            raise MoefleetError(f"{len(self.arrivals)} arrivals; at most {MAX_REQUESTS}",
                                "shorten --duration or lower the rate")


@dataclass
class RequestRecord:
    t_arrival_s: float  # scheduled send time, seconds after the bench started
    sent_s: float = math.nan
    chunk_s: list[float] = field(default_factory=list)
    done_s: float = math.nan
    ok: bool = False
    error: str | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    cost_usd: float = 0.0
    cost_parts: dict[str, float] = field(default_factory=dict)  # compute/requests/storage

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] - self.sent_s if self.chunk_s else None

    @property
    def itl_s(self) -> list[float]:
        c = self.chunk_s
        return [b - a for a, b in itertools.pairwise(c)]

    @property
    def tpot_s(self) -> float | None:
        c = self.chunk_s
        return (c[-1] - c[0]) / (len(c) - 1) if len(c) > 1 else None

    @property
    def e2e_s(self) -> float | None:
        return self.done_s - self.sent_s if self.ok else None


def _pcts(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    q = statistics.quantiles(xs, n=100, method="inclusive") if len(xs) > 1 else xs * 99
    return {"mean": statistics.fmean(xs), "p50": q[49], "p90": q[89], "p99": q[98]}


def _meets(r: RequestRecord, cfg: BenchConfig) -> tuple[bool, bool]:
    ttft_ok = cfg.slo_ttft_s is None or (r.ttft_s is not None and r.ttft_s <= cfg.slo_ttft_s)
    tpot_ok = cfg.slo_tpot_s is None or r.tpot_s is None or r.tpot_s <= cfg.slo_tpot_s
    return ttft_ok, tpot_ok


def summarize(records: list[RequestRecord], wall_s: float, cfg: BenchConfig) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    meets = [_meets(r, cfg) for r in ok]
    good = sum(a and b for a, b in meets)
    out_tokens = sum(r.output_tokens for r in ok)
    ttft = _pcts([r.ttft_s for r in ok if r.ttft_s is not None])
    tpot = _pcts([r.tpot_s for r in ok if r.tpot_s is not None])
    e2e = _pcts([r.e2e_s for r in ok if r.e2e_s is not None])
    violations = {"ttft": sum(not a for a, _ in meets), "tpot": sum(not b for _, b in meets)}
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "wall_s": wall_s,
        "request_throughput_rps": len(ok) / wall_s if wall_s > 0 else 0.0,
        "output_token_throughput_tps": out_tokens / wall_s if wall_s > 0 else 0.0,
        "goodput_rps": good / wall_s if wall_s > 0 else 0.0,
        "slo": {"ttft_s": cfg.slo_ttft_s, "tpot_s": cfg.slo_tpot_s},
        "slo_violation_rate": 1 - good / len(ok) if ok else None,
        "slo_violations": violations,
        "ttft_s": ttft, "tpot_s": tpot,
        "itl_s": _pcts([g for r in ok for g in r.itl_s]),
        "e2e_s": e2e,
        "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
        "billed_cost_usd": sum(r.cost_usd for r in ok),
        "errors": sorted({r.error for r in records if r.error})[:10],
        # the same figures under the server's metric names; a client cannot see the
        # server's queue time, so that one is None
        "named_metrics": named_figures(
            ttft=ttft, tpot=tpot, e2e=e2e, queue=None, prompt_tokens=prompt_tokens,
            generation_tokens=out_tokens, completed=len(ok), slo_violations=violations,
            cost={p: sum(r.cost_parts.get(p, 0.0) for r in ok) for p in COST_PARTS}),
    }


async def sse_events(resp: Any) -> AsyncIterator[dict[str, Any] | None]:
    """The JSON events of an OpenAI-style SSE stream (an aiohttp response), in order, then
    ``None`` for ``data: [DONE]``; nothing after it. Other lines are skipped."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            yield None
            return
        yield json.loads(data)


async def _one(session: Any, cfg: BenchConfig, model: str, prompt: str, max_tokens: int,
               rec: RequestRecord, t0: float) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": cfg.ignore_eos,
            "temperature": 0}
    rec.sent_s = time.perf_counter() - t0
    try:
        async with session.post(cfg.url.rstrip("/") + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}"
                return
            async for ev in sse_events(resp):
                if ev is None:  # data: [DONE]
                    break
                if "error" in ev:
                    rec.error = str(ev["error"].get("code") or "stream error")
                    return
                if ev.get("choices"):
                    rec.chunk_s.append(time.perf_counter() - t0)
                if ev.get("usage"):
                    u = ev["usage"]
                    rec.output_tokens = int(u.get("completion_tokens", 0))
                    rec.prompt_tokens = int(u.get("prompt_tokens", 0))
                    billed = u.get("billed_cost") or {}
                    rec.cost_usd = float(billed.get("usd", 0.0))
                    rec.cost_parts = {p: float(billed.get(p, 0.0)) for p in COST_PARTS}
        rec.done_s = time.perf_counter() - t0
        rec.ok = rec.error is None and bool(rec.chunk_s)
    except (TimeoutError, OSError, ValueError) as err:
        rec.error = type(err).__name__


async def _model_of(session: Any, cfg: BenchConfig) -> str:
    async with session.get(cfg.url.rstrip("/") + "/v1/models") as resp:
        if resp.status != 200:
            raise MoefleetError(f"GET {cfg.url}/v1/models answered {resp.status}",
                                "check --url and --api-key")
        return str((await resp.json())["data"][0]["id"])


async def run_bench(cfg: BenchConfig) -> tuple[list[RequestRecord], float]:
    """Send every arrival at its time; return the records and the wall time."""
    import aiohttp

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(headers=headers, connector=conn) as session:
        try:
            model = cfg.model or await _model_of(session, cfg)
        except aiohttp.ClientError as err:
            raise MoefleetError(f"cannot reach {cfg.url}: {err}",
                                "start it with `moefleet serve`") from None
        records = [RequestRecord(a.t_s) for a in cfg.arrivals]
        t0 = time.perf_counter()
        tasks = []
        for i, (a, rec) in enumerate(zip(cfg.arrivals, records, strict=True)):
            delay = a.t_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            mt = min(a.output_tokens or cfg.max_tokens, cfg.max_tokens)
            tasks.append(asyncio.create_task(_one(session, cfg, model,
                                                  cfg.prompts[i % len(cfg.prompts)], max(mt, 1),
                                                  rec, t0)))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=cfg.drain_s)
            for t in pending:
                t.cancel()
            for r in records:
                if not r.ok and r.error is None:
                    r.error = "cancelled after drain timeout"
        return records, time.perf_counter() - t0


def plot(records: list[RequestRecord], path: str, title: str) -> None:
    """Latency of each request over its send time, and billed cost accumulating."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = sorted((r for r in records if r.ok), key=lambda r: r.sent_s)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax1.scatter([r.sent_s for r in ok], [r.ttft_s for r in ok], s=8, label="TTFT")
    ax1.scatter([r.sent_s for r in ok], [r.e2e_s for r in ok], s=8, label="end-to-end")
    ax1.set_ylabel("latency (s)")
    ax1.legend()
    ax1.set_title(title)
    done = sorted(ok, key=lambda r: r.done_s)
    cum, total = [], 0.0
    for r in done:
        total += r.cost_usd
        cum.append(total)
    ax2.step([r.done_s for r in done], cum, where="post")
    ax2.set_xlabel("time since start (s)")
    ax2.set_ylabel("billed cost (USD, cumulative)")
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
