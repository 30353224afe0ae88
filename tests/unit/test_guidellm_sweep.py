"""benchmarks/guidellm_sweep.py: its summary of guidellm's JSON report (checked against the
committed report of a real guidellm 0.8.1 run) and its refusal when guidellm is missing.
guidellm itself is not installed here (it pins its own torch); the sweep is a benchmark."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.bench_helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "guidellm_sweep.py"
RESULT = ROOT / "benchmarks" / "results" / "guidellm_sweep.json"


def _module() -> Any:
    return load_benchmark("guidellm_sweep")


def test_summary_matches_the_committed_guidellm_report() -> None:
    saved = json.loads(RESULT.read_text())
    rows = _module().summarize(saved["guidellm_report"])
    assert rows == saved["strategies"]
    kinds = [r["strategy"] for r in rows]
    assert kinds[:2] == ["synchronous", "throughput"] and set(kinds[2:]) == {"constant"}
    thr = rows[1]
    assert thr["concurrency_max"] == 512  # guidellm's default sweep: 512 in flight
    assert thr["requests_successful"] > 0 and thr["output_tokens_per_s"] > 0


def test_prune_keeps_summaries_and_drops_per_request_records() -> None:
    mod = _module()
    report = {"benchmarks": [{"requests": [1, 2], "metrics": {"ttft": {"successful": {
        "mean": 1.0, "pdf": [0.1], "percentiles": {"p50": 1.0}}}, "text": {}}}]}
    assert mod.prune(report) == {"benchmarks": [{"metrics": {"ttft": {"successful": {
        "mean": 1.0, "percentiles": {"p50": 1.0}}}}}]}


def test_missing_guidellm_is_one_error_line() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--guidellm", "/nonexistent/guidellm"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode != 0
    assert "error: guidellm not found" in done.stderr and "Traceback" not in done.stderr
