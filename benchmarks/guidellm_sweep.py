"""guidellm's sweep against ``moefleet serve``: the third-party load generator the overload
issue was reported with, run as an integration check of the admission gate.

guidellm is not a dependency of moefleet (it pins its own torch and transformers): install
it in a virtual environment of its own and pass its executable::

    python3.11 -m venv ../gl-venv && ../gl-venv/bin/pip install torch==2.13.0 guidellm==0.8.1
    python benchmarks/guidellm_sweep.py --guidellm ../gl-venv/bin/guidellm

The server is ``moefleet serve -m tiny-moe-lm --max-num-seqs 64`` with its defaults
(admission on) on loopback; guidellm runs its default sweep (synchronous, throughput at up
to 512 concurrent requests, then 8 constant rates between them), ``--max-seconds`` per
strategy, synthetic prompts of ``--prompt-tokens`` tokens and ``--output-tokens`` output
tokens counted with the model's own tokenizer, over ``/v1/completions``. guidellm does not
retry a 503 and ignores ``Retry-After``. Bounded: each strategy stops at its duration, the
whole run at ``--limit-s``. Results: guidellm's JSON report and a summary per strategy in
``benchmarks/results/guidellm_sweep.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_overload import start_server, stop

OUT = Path(__file__).resolve().parent / "results" / "guidellm_sweep.json"


def _pct(dist: dict[str, Any], key: str) -> float | None:
    """A percentile (``p50``, ``p99``) of one of guidellm's distribution summaries."""
    pcts = (dist or {}).get("percentiles") or {}
    v = pcts.get(key)
    return None if v is None else float(v)


def summarize(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per strategy of guidellm's JSON report: rate, requests by outcome, output
    tokens/s and requests/s (successful), TTFT p50/p99 (ms), concurrency reached."""
    rows = []
    for b in report.get("benchmarks") or []:
        if not b:
            continue
        m = b.get("metrics") or {}
        totals = (m.get("request_totals") or {})
        strategy = (b.get("config") or {}).get("strategy") or {}

        def succ(name: str, m: dict[str, Any] = m) -> dict[str, Any]:
            return ((m.get(name) or {}).get("successful")) or {}

        rows.append({
            "strategy": strategy.get("type_") or strategy.get("kind") or strategy.get("type"),
            "rate": strategy.get("rate"),
            "requests_successful": totals.get("successful"),
            "requests_errored": totals.get("errored"),
            "requests_incomplete": totals.get("incomplete"),
            "output_tokens_per_s": succ("output_tokens_per_second").get("mean"),
            "requests_per_s": succ("requests_per_second").get("mean"),
            "ttft_ms_p50": _pct(succ("time_to_first_token_ms"), "p50"),
            "ttft_ms_p99": _pct(succ("time_to_first_token_ms"), "p99"),
            "concurrency_mean": succ("request_concurrency").get("mean"),
            "concurrency_max": succ("request_concurrency").get("max"),
        })
    return rows


# per request, per confidence bin, per modality (repeats the totals): megabytes
BULKY = {"requests", "percentile_cis", "pdf", "mean_ci", "text", "image", "video", "audio",
         "tool_call"}


def prune(obj: Any) -> Any:
    """guidellm's report without its per-request records and confidence bins (the
    summaries, percentiles and configs stay)."""
    if isinstance(obj, dict):
        return {k: prune(v) for k, v in obj.items() if k not in BULKY}
    if isinstance(obj, list):
        return [prune(v) for v in obj]
    return obj


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--guidellm", default=shutil.which("guidellm") or "guidellm",
                    help="guidellm executable (in its own virtual environment)")
    ap.add_argument("--model", default="tiny-moe-lm")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-seconds", type=float, default=15.0)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=8)
    ap.add_argument("--limit-s", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if not Path(args.guidellm).is_file() and shutil.which(args.guidellm) is None:
        sys.exit(f"error: guidellm not found at {args.guidellm!r}\n"
                 "hint: install it in its own venv (see this script's docstring) and pass "
                 "--guidellm PATH")
    from moefleet.io import write_json_atomic
    from moefleet.models import zoo

    if not zoo.is_built(args.model):
        sys.exit(f"error: {args.model} is not built\nhint: moefleet models build {args.model}")
    tokenizer = zoo.model_dir(args.model)
    proc, url = start_server(args.model, True, args.max_num_seqs)
    t0 = time.time()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            report_path = Path(tmp) / "guidellm.json"
            cmd = [args.guidellm, "run",
                   "--backend", f"kind=openai_http,target={url},model={args.model},"
                                "request_format=/v1/completions",
                   "--profile", "kind=sweep",
                   "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
                             f"output_tokens={args.output_tokens}",
                   "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
                   "--constraint", f"kind=max_duration,seconds={args.max_seconds:g}",
                   "--output", f"kind=json,path={report_path}",
                   "--disable-console-interactive"]
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
            env["HF_HUB_OFFLINE"] = "1"
            done = subprocess.run(cmd, env=env, timeout=args.limit_s, capture_output=True,
                                  text=True)
            if done.returncode != 0 or not report_path.is_file():
                sys.exit(f"error: guidellm exited {done.returncode}\n"
                         f"{(done.stderr or done.stdout)[-3000:]}")
            report = json.loads(report_path.read_text())
    finally:
        stop(proc)
    rows = summarize(report)
    # this machine's cache path (the tokenizer) is not a result
    text = json.dumps(prune(report), default=str).replace(str(tokenizer), "<model dir>")
    report = json.loads(text.replace(str(report_path.parent), "<temporary>"))
    best = max((r["output_tokens_per_s"] or 0.0) for r in rows) if rows else 0.0
    result = {"what": "guidellm sweep against moefleet serve (admission on, defaults)",
              "command": " ".join(["python", "benchmarks/guidellm_sweep.py",
                                   "--guidellm", "GUIDELLM", "--max-seconds",
                                   f"{args.max_seconds:g}"]),
              "guidellm_version": subprocess.run([args.guidellm, "--version"],
                                                 capture_output=True, text=True
                                                 ).stdout.strip(),
              "model": args.model, "max_num_seqs": args.max_num_seqs,
              "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
              "seconds_per_strategy": args.max_seconds, "wall_s": round(time.time() - t0, 1),
              "machine": {"cpus": os.cpu_count(), "loadavg_after": os.getloadavg()},
              "best_output_tokens_per_s": best, "strategies": rows,
              "guidellm_report": report}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out, result)
    for r in rows:
        share = (r["output_tokens_per_s"] or 0.0) / best if best else 0.0
        print(f"{r['strategy']!s:12} rate={r['rate']!s:>8}  ok={r['requests_successful']}"
              f" err={r['requests_errored']}  out tok/s={r['output_tokens_per_s'] or 0:7.1f}"
              f" ({share:4.0%} of best)  TTFT p50/p99 ms={r['ttft_ms_p50']}/{r['ttft_ms_p99']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
