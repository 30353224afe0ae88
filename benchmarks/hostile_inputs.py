"""Hostile inputs through the real CLI: how many are refused cleanly, by kind.

    python benchmarks/hostile_inputs.py [--subprocess-sample 12] [--bound-s 20]

Runs every case of the hostile-input corpus (``tests/reliability/hostile_corpus.py``:
plans, sMoE checkpoints, activation and counts arrays, timing files, datasets, output
paths, CLI numbers) and every malformed model directory (``tests/reliability/
model_dirs.py``, through ``moefleet models info``) in process with typer's runner, and
a sample of them again as real ``python -m moefleet`` subprocesses (stderr inspected).
Each case is classified:

- ``clean``: non-zero exit, one ``error:`` line (or a usage error), no traceback, no
  output file left, done within ``--bound-s``;
- ``traceback``: a traceback reached the output;
- ``hang``: it ran past ``--bound-s`` (in process: a SIGALRM ends it);
- ``accepted``: exit 0 (a hostile input taken as valid);
- ``unclean``: anything else (no error line, several, or an output file left).

Writes benchmarks/results/hostile_inputs.json: counts per kind and per class, the
seconds each case took (median and max per kind), the sample's subprocess results, and
every case that was not clean (name, class, last output line).
"""

from __future__ import annotations

import argparse
import os
import platform as pyplatform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from typer.testing import CliRunner  # noqa: E402

from moefleet.cli import app  # noqa: E402
from moefleet.io import write_json_atomic  # noqa: E402
from tests.reliability.hostile_corpus import all_cases, make_seeds  # noqa: E402
from tests.reliability.model_dirs import CASES as MODEL_DIRS  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "hostile_inputs.json"
USAGE = ("Invalid value",)  # a range or type error; a missing option would prove nothing


class Hang(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise Hang()


def classify(code: int | str, output: str, took: float, bound: float, left: bool) -> str:
    if code == "hang" or took > bound:
        return "hang"
    if "Traceback" in output:
        return "traceback"
    if code == 0:
        return "accepted"
    errors = [ln for ln in output.splitlines() if ln.startswith("error:")]
    if left or not (len(errors) == 1 or any(u in output for u in USAGE)):
        return "unclean"
    return "clean"


def files(folder: Path) -> set[str]:
    return {str(p) for p in folder.rglob("*") if p.is_file() and not p.is_symlink()}


def run_in_process(args: list[str], work: Path, bound: float) -> tuple[Any, str, float]:
    runner = CliRunner()
    old = Path.cwd()
    os.chdir(work)
    signal.alarm(int(bound) + 5)
    t0 = time.monotonic()
    try:
        res = runner.invoke(app, args)
        code: Any = res.exit_code
        out = res.output
        if res.exception is not None and not isinstance(res.exception, SystemExit):
            if isinstance(res.exception, Hang):
                code = "hang"
            else:
                out += f"\nTraceback (uncaught {type(res.exception).__name__})"
    except Hang:
        code, out = "hang", ""
    finally:
        signal.alarm(0)
        os.chdir(old)
    return code, out, time.monotonic() - t0


def run_subprocess(args: list[str], work: Path, bound: float) -> tuple[Any, str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
               OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "moefleet", *args], capture_output=True,
                              text=True, timeout=bound + 30, env=env, cwd=work)
    except subprocess.TimeoutExpired:
        return "hang", "", time.monotonic() - t0
    return proc.returncode, proc.stderr + proc.stdout, time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bound-s", type=float, default=20.0)
    ap.add_argument("--subprocess-sample", type=int, default=12,
                    help="cases (every n-th) rerun as real processes")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    signal.signal(signal.SIGALRM, _alarm)
    tmp = Path(tempfile.mkdtemp(prefix="hostile-"))
    try:
        seeds = make_seeds(tmp / "seeds")
        cases: list[tuple[str, str, Any]] = list(all_cases())
        for name, mutate in MODEL_DIRS.items():
            def build(s: Any, w: Path, mutate: Any = mutate) -> list[str]:
                d = w / "model"
                shutil.copytree(s["model"], d)
                mutate(d)
                return ["models", "info", str(d)]
            cases.append(("model-dir", name, build))
        rows: list[dict[str, Any]] = []
        for i, (kind, name, build) in enumerate(cases):
            work = tmp / f"case{i}"
            work.mkdir()
            args = build(seeds, work)
            before = files(work)
            code, out, took = run_in_process(args, work, a.bound_s)
            left = bool(files(work) - before)
            rows.append({"kind": kind, "case": name, "class": classify(
                code, out, took, a.bound_s, left), "seconds": round(took, 3),
                "last_line": (out.strip().splitlines() or [""])[-1][:200]})
        step = max(1, len(cases) // max(1, a.subprocess_sample))
        sample = []
        for i in range(0, len(cases), step)[: a.subprocess_sample]:
            kind, name, build = cases[i]
            work = tmp / f"sub{i}"
            work.mkdir()
            code, out, took = run_subprocess(build(seeds, work), work, a.bound_s)
            sample.append({"kind": kind, "case": name, "class": classify(
                code, out, took, a.bound_s, False), "seconds": round(took, 2)})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    by_kind: dict[str, dict[str, Any]] = defaultdict(dict)
    for kind in sorted({r["kind"] for r in rows}):
        mine = [r for r in rows if r["kind"] == kind]
        secs = [r["seconds"] for r in mine]
        by_kind[kind] = {"cases": len(mine), **Counter(r["class"] for r in mine),
                         "seconds_median": round(statistics.median(secs), 3),
                         "seconds_max": round(max(secs), 3)}
    counts = Counter(r["class"] for r in rows)
    result = {
        "what": "hostile inputs through the real CLI (typer runner in process; a sample "
                "as subprocesses)",
        "command": "python benchmarks/hostile_inputs.py",
        "machine": {"python": pyplatform.python_version(), "cpus": os.cpu_count()},
        "bound_s": a.bound_s,
        "cases": len(rows),
        "clean": counts.get("clean", 0),
        "tracebacks": counts.get("traceback", 0),
        "hangs": counts.get("hang", 0),
        "accepted": counts.get("accepted", 0),
        "unclean": counts.get("unclean", 0),
        "by_kind": by_kind,
        "subprocess_sample": sample,
        "not_clean": [r for r in rows if r["class"] != "clean"],
        "total_seconds": round(sum(r["seconds"] for r in rows), 1),
    }
    write_json_atomic(a.out, result)
    print(f"{len(rows)} cases: {counts.get('clean', 0)} clean, {result['tracebacks']} "
          f"tracebacks, {result['hangs']} hangs, {result['accepted']} accepted, "
          f"{result['unclean']} unclean; subprocess sample "
          f"{sum(s['class'] == 'clean' for s in sample)}/{len(sample)} clean -> {a.out}")


if __name__ == "__main__":
    main()
