"""What HTTP serving costs on top of the engine: the same workload straight into the
engine in process, and through ``moefleet serve`` (a subprocess) on loopback.

Two measurements, both paths side by side:

- *throughput*: ``--requests`` wikitext2 prompts, all arriving at once (a closed burst,
  so throughput is the engine's, not the arrival rate's), greedy, ``--max-tokens`` each
  with end-of-sequence ignored so both paths generate exactly the same tokens. Its TTFT
  is mostly queueing, and over HTTP the requests reach the engine spread over the first
  steps, so the burst's TTFT difference is batch composition, not HTTP;
- *added TTFT*: ``--single`` prompts one at a time on an idle engine (one token each, a
  kept-alive connection), so TTFT is one prefill plus, over HTTP, the request's parsing,
  the hop to the engine thread and the first SSE chunk: the per-request overhead. The server runs
the same model with the same ``--max-num-seqs``; the client streams every request
(``aiohttp``), so its TTFT includes HTTP, JSON and SSE. Both paths run ``--repeats``
times, alternating; medians are reported.

    python benchmarks/serve_overhead.py [--model tiny-moe-lm] [--requests 32]
writes benchmarks/results/serve_overhead.json: throughput ratio (HTTP / in-process), the
added p50 TTFT, and the machine's load averages before and after (a shared machine's
contention is part of every figure).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from moefleet.compose.presets import build_engine
from moefleet.data.registry import load_prompts
from moefleet.engine import SamplingParams
from moefleet.io import write_json_atomic
from moefleet.models.registry import load_adapter
from moefleet.serve.bench import BenchConfig, run_bench, summarize
from moefleet.workloads import Arrival

OUT = Path(__file__).parent / "results" / "serve_overhead.json"


def in_process(adapter, prompts: list[str], max_tokens: int, seqs: int) -> dict[str, float]:
    engine = build_engine(adapter, max_num_seqs=seqs)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    ttft, tokens = [], 0
    while engine.has_unfinished:
        for o in engine.step():
            tokens += len(o.new_token_ids)
            if o.finished and o.times is not None and o.times.ttft_s is not None:
                ttft.append(o.times.ttft_s)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
            "ttft_p50_s": statistics.median(ttft)}


def over_http(url: str, prompts: list[str], max_tokens: int) -> dict[str, float]:
    arrivals = [Arrival(0.0, f"r{i}") for i in range(len(prompts))]
    cfg = BenchConfig(url, prompts, arrivals, max_tokens=max_tokens, drain_s=600)
    records, wall = asyncio.run(run_bench(cfg))
    m = summarize(records, wall, cfg)
    if m["failed"]:
        raise SystemExit(f"HTTP requests failed: {m['errors']}")
    return {"wall_s": wall, "output_tokens": m["output_tokens"],
            "tokens_per_s": m["output_token_throughput_tps"], "ttft_p50_s": m["ttft_s"]["p50"]}


def ttft_in_process(adapter, prompts: list[str]) -> list[float]:
    engine = build_engine(adapter, max_num_seqs=1)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    out = []
    for p in prompts:
        t0 = time.perf_counter()
        engine.add_request(p, params)
        first = None
        while engine.has_unfinished:
            for o in engine.step():
                if first is None and o.new_token_ids:
                    first = time.perf_counter() - t0
        assert first is not None
        out.append(first)
    return out


def ttft_http(url: str, model: str, prompts: list[str]) -> list[float]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    out = []
    try:
        for p in prompts:
            body = json.dumps({"model": model, "prompt": p, "max_tokens": 1,
                               "temperature": 0, "stream": True})
            t0 = time.perf_counter()
            conn.request("POST", "/v1/completions", body,
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise SystemExit(f"HTTP {resp.status}: {resp.read()[:300]!r}")
            first = None
            for raw in resp:  # SSE lines; the first data chunk carries the first token
                line = raw.decode().strip()
                if first is None and line.startswith("data:") and '"text"' in line:
                    first = time.perf_counter() - t0
                if line == "data: [DONE]":
                    break
            resp.read()
            assert first is not None
            out.append(first)
    finally:
        conn.close()
    return out


def start_server(model: str, seqs: int) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moefleet", "serve", "--model", model,
                             "--port", str(port), "--max-num-seqs", str(seqs),
                             "--max-waiting", "100000"])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                return proc, url
        except OSError:
            time.sleep(0.5)
    os.kill(proc.pid, signal.SIGTERM)
    raise SystemExit("server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-moe-lm")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--single", type=int, default=16,
                    help="prompts sent one at a time for the added-TTFT measurement")
    args = ap.parse_args()
    load_before = os.getloadavg()  # the machine is shared: say how busy it was
    prompts = [p.text[:400] for p in load_prompts("wikitext2", limit=args.requests)]
    adapter = load_adapter(args.model)
    proc, url = start_server(args.model, args.max_num_seqs)
    runs: dict[str, list[dict[str, float]]] = {"in_process": [], "http": []}
    try:
        over_http(url, prompts[:2], 2)  # warm both paths once
        in_process(adapter, prompts[:2], 2, args.max_num_seqs)
        for _ in range(args.repeats):
            runs["in_process"].append(in_process(adapter, prompts, args.max_tokens,
                                                 args.max_num_seqs))
            runs["http"].append(over_http(url, prompts, args.max_tokens))
        singles = prompts[: args.single]
        ttft_http(url, args.model, singles[:2])  # warm the kept-alive path
        single = {"in_process": ttft_in_process(adapter, singles),
                  "http": ttft_http(url, args.model, singles)}
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(60)

    def med(path: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[path])

    result = {
        "model": args.model, "requests": args.requests, "max_tokens": args.max_tokens,
        "max_num_seqs": args.max_num_seqs, "repeats": args.repeats,
        "cpu_threads": os.environ.get("OMP_NUM_THREADS", "default"),
        "cpu_count": os.cpu_count(),
        # 1/5/15-minute load averages before and after the run (>= cpu_count: contended)
        "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg()),
        "in_process_tokens_per_s": med("in_process", "tokens_per_s"),
        "http_tokens_per_s": med("http", "tokens_per_s"),
        "throughput_ratio": med("http", "tokens_per_s") / med("in_process", "tokens_per_s"),
        "in_process_ttft_p50_s": med("in_process", "ttft_p50_s"),
        "http_ttft_p50_s": med("http", "ttft_p50_s"),
        "burst_ttft_difference_p50_ms": (med("http", "ttft_p50_s")
                                         - med("in_process", "ttft_p50_s")) * 1e3,
        "single_requests": len(singles),
        "single_in_process_ttft_p50_ms": statistics.median(single["in_process"]) * 1e3,
        "single_http_ttft_p50_ms": statistics.median(single["http"]) * 1e3,
        # per-prompt pairs (same prompt, same prefill): the HTTP path's own cost
        "added_ttft_p50_ms": statistics.median(
            h - i for h, i in zip(single["http"], single["in_process"], strict=True)) * 1e3,
        "runs": runs, "single_ttft_s": single,
    }
    write_json_atomic(OUT, result)
    print({k: v for k, v in result.items() if k != "runs"})


if __name__ == "__main__":
    main()
