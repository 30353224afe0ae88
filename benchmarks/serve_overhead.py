"""What HTTP serving costs on top of the engine: the same workload straight into the
engine in process, and through ``moefleet serve`` (a subprocess) on loopback.

Workload: ``--requests`` wikitext2 prompts, all arriving at once (a closed burst, so
throughput is the engine's, not the arrival rate's), greedy, ``--max-tokens`` each with
end-of-sequence ignored so both paths generate exactly the same tokens. The server runs
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
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from moefleet.data.registry import load_prompts
from moefleet.engine import SamplingParams
from moefleet.engine.build import build_engine
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
        "added_ttft_p50_ms": (med("http", "ttft_p50_s") - med("in_process", "ttft_p50_s"))
        * 1e3,
        "runs": runs,
    }
    write_json_atomic(OUT, result)
    print({k: v for k, v in result.items() if k != "runs"})


if __name__ == "__main__":
    main()
