"""The ``engine`` and ``http`` targets of benchmarks/faults.py (imported from there).

engine: the tiny Mixtral (random weights, token ids, no tokenizer) in one engine
(``max_num_seqs`` 8); its experts go through ``FaultyExperts``; ``--requests`` prompts of
8 tokens submitted at once, 16 greedy tokens each; each (kind, rate) 3 times (seeds
seed..seed+2), each beside a fault-free run (counts summed, added latency and cost the
medians of the paired differences). Outputs compare with a fault-free run; cost = the
run's wall time priced as one aws-lambda function of 2048 MB.

http: a real ``moefleet serve -m tiny-mixtral-random --inject-faults KIND:RATE:SEED``
subprocess on 127.0.0.1 per run (the baseline too, on a fresh server with the same
warm-up); ``--requests`` completions, every other one streamed,
at most 8 in flight, each with a 60 s client timeout; cost = the server's
``billed_cost_usd_total`` over the run (failed requests included, in-process estimate).
The ``stall`` kind runs at 5 % with 3 s stalls under ``--step-timeout 1``.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from moefleet.compose.presets import build_engine, opened_engine
from moefleet.engine import SamplingParams
from moefleet.experiments.serve_faults import run_engine_under_faults, run_http_under_faults
from moefleet.experts.faults import FaultyExperts
from moefleet.experts.kernels import in_process_experts
from moefleet.runtime.faults import FaultPlan

ROOT = Path(__file__).resolve().parents[1]
ENGINE_KINDS = ("crash", "timeout", "throttle", "straggler", "error")
HTTP_KINDS = ENGINE_KINDS
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
FAST = {"timeout_s": 0.05, "straggle_s": 0.05, "retry_after_s": 0.02}


def _added(run: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    for key in ("latency_p50_s", "latency_p95_s", "cost_usd"):
        run[f"added_{key}"] = None if run[key] is None else run[key] - base[key]
    run["cost_ratio_vs_no_faults"] = run["cost_usd"] / base["cost_usd"] if base[
        "cost_usd"] else None
    return run


def _line(r: dict[str, Any]) -> None:
    ratio = r.get("cost_ratio_vs_no_faults")
    print(f"{r['backend']:6s} {r['kind']:10s} {r['rate']:5.2f}: completed {r['completed']}/"
          f"{r['accepted']} failed {r['failed']} lost {r['lost']} equal "
          f"{r['outputs_equal_fault_free']} p50 +{r.get('added_latency_p50_s')} s "
          f"p95 +{r.get('added_latency_p95_s')} s cost x"
          f"{ratio if ratio is None else round(ratio, 3)}", flush=True)


def _paired(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """One row from ``repeats`` (fault run, fault-free run) pairs measured back to back:
    counts summed, added latency and cost ratio the medians of the pairs' differences
    (pairing cancels most of a shared machine's drift)."""
    runs = [r for r, _ in pairs]
    out = dict(runs[0])
    for key in ("accepted", "completed", "failed", "lost", "outputs_equal_fault_free",
                "faults_injected", "retries"):
        out[key] = sum(r[key] for r in runs)
    out["errors"] = [e for r in runs for e in r["errors"]][:5]
    for key in ("latency_p50_s", "latency_p95_s", "cost_usd"):
        diffs = [r[key] - b[key] for r, b in pairs if r[key] is not None]
        out[key] = statistics.median(r[key] for r in runs if r[key] is not None) if diffs \
            else None
        out[f"added_{key}"] = statistics.median(diffs) if diffs else None
    out["cost_ratio_vs_no_faults"] = statistics.median(r["cost_usd"] / b["cost_usd"]
                                                       for r, b in pairs)
    out["repeats"] = len(pairs)
    return out


def engine_runs(adapter: Any, n: int, rates: list[float], seed: int,
                repeats: int = 3) -> list[dict[str, Any]]:
    """Each (kind, rate) runs ``repeats`` times, each time beside a fault-free run."""
    prompts = [[(97 * i + 13 * j) % adapter.vocab_size for j in range(8)] for i in range(n)]
    build_engine(adapter, max_num_seqs=8).generate(prompts[:2], GREEDY)  # warm up
    ref_run = run_engine_under_faults(opened_engine(adapter, max_num_seqs=8), prompts,
                                      GREEDY)
    reference = [ref_run.outputs[i] for i in range(n)]

    def clean() -> dict[str, Any]:
        return run_engine_under_faults(opened_engine(adapter, max_num_seqs=8), prompts,
                                       GREEDY, reference).to_dict()

    bases = [clean() for _ in range(repeats)]
    base = _paired([(b, b) for b in bases])
    base["kind"] = "none"
    runs = [base]
    _line(base)
    for kind in ENGINE_KINDS:
        for rate in rates:
            pairs = []
            for rep in range(repeats):
                faulty = FaultyExperts(in_process_experts(adapter),
                                       FaultPlan(kind, rate, seed + rep, **FAST))
                eng = opened_engine(adapter, max_num_seqs=8, experts=faulty)
                run = run_engine_under_faults(eng, prompts, GREEDY, reference)
                pairs.append((run.to_dict(), clean()))
            r = _paired(pairs)
            runs.append(r)
            _line(r)
    return runs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Server:
    """``moefleet serve`` in a subprocess, started with ``args``; stopped on exit."""

    def __init__(self, args: list[str]) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT / "src")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moefleet", "serve", "-m", "tiny-mixtral-random",
             "--port", str(self.port), "--max-num-seqs", "8", *args],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def __enter__(self) -> _Server:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise SystemExit(f"moefleet serve exited: {err[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return self
            except OSError:
                time.sleep(0.3)
        raise SystemExit("moefleet serve did not start in 180 s")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


def http_runs(n: int, rates: list[float], seed: int) -> list[dict[str, Any]]:
    prompts = [f"Request {i}: experts route tokens to" for i in range(n)]
    none = FaultPlan("none", 0.0)
    with _Server([]) as srv:
        run_http_under_faults(srv.url, none, prompts[:2])  # warm up
        ref_run, _ = run_http_under_faults(srv.url, none, prompts)
        reference = [str(ref_run.outputs.get(i, "")) for i in range(n)]
    with _Server([]) as srv:  # the baseline: a fresh server warmed as the fault runs' are
        run_http_under_faults(srv.url, none, prompts[:2])
        base_run, health = run_http_under_faults(srv.url, none, prompts, reference=reference)
    base = base_run.to_dict()
    base.update(kind="none", health_after=health)
    runs = [base]
    _line(base)
    plans = [(k, r, f"{k}:{r}:{seed}:0.05", []) for k in HTTP_KINDS for r in rates]
    plans.append(("stall", 0.05, f"stall:0.05:{seed}:3", ["--step-timeout", "1"]))
    for kind, rate, spec, extra in plans:
        with _Server(["--inject-faults", spec, *extra]) as srv:
            run_http_under_faults(srv.url, none, prompts[:2])  # warm up (may meet faults)
            run, health = run_http_under_faults(srv.url, FaultPlan(kind, rate), prompts,
                                                reference=reference)
        r = _added(run.to_dict(), base)
        r.update(health_after=health, faults_injected=None, server_spec=spec)
        runs.append(r)
        _line(r)
    return runs
