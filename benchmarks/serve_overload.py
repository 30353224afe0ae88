"""Goodput under overload: closed-loop clients against ``moefleet serve`` on loopback.

N clients (64, 256, 512, 1024 by default) each send one streamed completion, wait for
its end, and send the next, for ``--level-s`` seconds per level. A 503 or 429 is either
retried at once (clients that ignore ``Retry-After``, as guidellm's do) or after the
``Retry-After`` the server sent. The server runs twice, side by side in one run: BEFORE
(``--no-admission``: the old shedding after the body is parsed) and AFTER (the admission
gate, the defaults). Per level: output tokens/s and completed requests/s (of requests
that finished inside the level), p50/p99 TTFT of those requests (from the send of the
attempt that succeeded), the 503/429 counts, and the fewest requests completed in any
10 s window (sliding by 1 s). The bar (issue #27): at 512 and 1024 clients ignoring
``Retry-After``, AFTER's output throughput >= 80% of the best at any level, and no 10 s
window without a completion.

    python benchmarks/serve_overload.py [--model tiny-moe-lm] [--levels 64,256,512,1024]
        [--level-s 15] [--max-tokens 8] [--procs 4]

Bounded: every level ends at its deadline (open requests are cancelled), each server
is stopped by its pid, and the client runs in ``--procs`` processes so that 1,024
clients are not limited by one client process's event loop. Writes
benchmarks/results/serve_overload.json (with the machine's load averages: on a shared
machine the client, the server and other work compete for the same cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "results" / "serve_overload.json"
WINDOW_S = 10.0
PROMPTS = ["The old castle stood on the hill", "Once upon a time a river",
           "In the morning the market was", "She opened the letter and read"]


# -- the client (one process: n closed-loop clients) -------------------------------------
async def _clients(url: str, model: str, n: int, start: float, level_s: float,
                   honour: bool, max_tokens: int, offset: int) -> dict[str, Any]:
    import aiohttp

    done: list[tuple[float, float, int]] = []  # (finish time, ttft, output tokens)
    counts = {"503": 0, "429": 0, "other": 0, "conn_errors": 0}
    end = start + level_s
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=60)
    conn = aiohttp.TCPConnector(limit=0, force_close=False)

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        k = 0
        while time.time() < end:
            body = {"model": model, "prompt": PROMPTS[(i + k) % len(PROMPTS)],
                    "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                    "stream": True}
            k += 1
            sent = time.time()
            try:
                async with session.post(url + "/v1/completions", json=body) as r:
                    if r.status != 200:
                        await r.read()
                        key = str(r.status) if r.status in (503, 429) else "other"
                        counts[key] += 1
                        if honour and key != "other":
                            wait = float(r.headers.get("Retry-After", "1"))
                            await asyncio.sleep(min(wait, max(end - time.time(), 0)))
                        continue
                    first, tokens = None, 0
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            first = first or time.time()
                            tokens += 1
                    if first is not None and time.time() <= end:
                        done.append((time.time(), first - sent, tokens))
            except (aiohttp.ClientError, OSError):
                counts["conn_errors"] += 1
                await asyncio.sleep(0.05)

    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        tasks = [asyncio.create_task(one(session, offset + i)) for i in range(n)]
        await asyncio.sleep(max(end - time.time(), 0))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"done": done, **counts}


def _client_proc(args: tuple[Any, ...]) -> dict[str, Any]:
    return asyncio.run(_clients(*args))


def run_level(url: str, model: str, n: int, level_s: float, honour: bool, max_tokens: int,
              procs: int) -> dict[str, Any]:
    procs = max(1, min(procs, n))
    start = time.time() + 1.0  # every process starts its clients together
    shares = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    jobs = [(url, model, k, start, level_s, honour, max_tokens, sum(shares[:i]))
            for i, k in enumerate(shares)]
    with mp.get_context("spawn").Pool(procs) as pool:
        parts = pool.map(_client_proc, jobs)
    done = sorted(d for p in parts for d in p["done"])
    finish = [d[0] - start for d in done]
    ttft = sorted(d[1] for d in done)
    windows = [sum(1 for f in finish if t <= f < t + WINDOW_S)
               for t in range(0, max(int(level_s - WINDOW_S) + 1, 1))]
    return {"clients": n, "honour_retry_after": honour, "level_s": level_s,
            "completed": len(done), "completed_per_s": len(done) / level_s,
            "output_tok_per_s": sum(d[2] for d in done) / level_s,
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "rejected_503": sum(p["503"] for p in parts),
            "rejected_429": sum(p["429"] for p in parts),
            "other_status": sum(p["other"] for p in parts),
            "connection_errors": sum(p["conn_errors"] for p in parts),
            "min_completed_per_10s_window": min(windows) if windows else None}


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


# -- the server ------------------------------------------------------------------------
def start_server(model: str, admission: bool, seqs: int) -> tuple[subprocess.Popen, str]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH",
                                                                            "")])}
    cmd = [sys.executable, "-m", "moefleet", "serve", "--model", model, "--port", "0",
           "--max-num-seqs", str(seqs)]
    if not admission:
        cmd.append("--no-admission")
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    assert proc.stderr is not None
    deadline = time.monotonic() + 300
    text = ""
    while "serving" not in text:
        line = proc.stderr.readline().decode()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"serve exited: {text[-2000:]}")
        text += line
        if time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError("serve did not come up in 300 s")
    m = re.search(r"http://127\.0\.0\.1:(\d+)", text)
    assert m, text
    url = f"http://127.0.0.1:{m.group(1)}"
    while True:
        try:
            if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                return proc, url
        except OSError:
            time.sleep(0.2)
        if time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError("serve never became healthy")


def wait_idle(url: str, limit_s: float = 120.0) -> None:
    """Until the engine has nothing running or waiting (requests of the last level that
    were cancelled are aborted server-side)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
        vals = [float(ln.split()[-1]) for ln in text.splitlines()
                if ln.startswith(("moefleet:num_requests_running{",
                                  "moefleet:num_requests_waiting{"))]
        if vals and not any(vals):
            return
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-moe-lm")
    ap.add_argument("--levels", default="64,256,512,1024")
    ap.add_argument("--level-s", type=float, default=15.0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--modes", default="before,after")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    levels = [int(x) for x in a.levels.split(",")]
    if not 10 <= a.level_s <= 120 or any(not 1 <= n <= 4096 for n in levels):
        ap.error("--level-s must be in [10, 120] and each level in [1, 4096]")
    load_before = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {}
    for mode in a.modes.split(","):
        proc, url = start_server(a.model, mode == "after", a.max_num_seqs)
        try:
            runs[mode] = []
            for n in levels:
                for honour in (False, True):
                    r = run_level(url, a.model, n, a.level_s, honour, a.max_tokens, a.procs)
                    runs[mode].append(r)
                    print(f"{mode:6s} n={n:5d} honour={honour!s:5s} "
                          f"{r['output_tok_per_s']:7.1f} tok/s {r['completed_per_s']:6.2f} "
                          f"req/s ttft p50 {r['ttft_p50_s']} p99 {r['ttft_p99_s']} "
                          f"503={r['rejected_503']} min10s="
                          f"{r['min_completed_per_10s_window']}", flush=True)
                    wait_idle(url)
        finally:
            stop(proc)
    out = {"model": a.model, "max_num_seqs": a.max_num_seqs, "max_tokens": a.max_tokens,
           "level_s": a.level_s, "client_procs": a.procs, "cpus": os.cpu_count(),
           "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
           "runs": runs, "bar": bar(runs)}
    from moefleet.io import write_json_atomic

    write_json_atomic(a.out, out)
    print(json.dumps(out["bar"], indent=2))


def bar(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per mode: the best output tok/s at any level, and at 512/1024 ignoring
    Retry-After the ratio to it and the fewest completions in a 10 s window."""
    out: dict[str, Any] = {}
    for mode, rs in runs.items():
        best = max((r["output_tok_per_s"] for r in rs), default=0.0)
        heavy = [r for r in rs if r["clients"] >= 512 and not r["honour_retry_after"]]
        out[mode] = {"best_output_tok_per_s": best, "at_512_1024_ignoring_retry_after": [
            {"clients": r["clients"], "ratio_to_best": r["output_tok_per_s"] / best
             if best else None, "min_completed_per_10s_window":
             r["min_completed_per_10s_window"]} for r in heavy],
            "median_ratio": statistics.median([r["output_tok_per_s"] / best for r in heavy])
            if heavy and best else None}
        out[mode]["meets_bar"] = bool(heavy) and all(
            x["ratio_to_best"] is not None and x["ratio_to_best"] >= 0.8
            and (x["min_completed_per_10s_window"] or 0) > 0
            for x in out[mode]["at_512_1024_ignoring_retry_after"])
    return out


if __name__ == "__main__":
    main()
