"""CLI fuzz driver: hostile argument sets across every command, run in-process with
typer's CliRunner. Run as a script (``python -m tests.reliability.cli_fuzz N SEED``) it
prints one JSON report, including this process's peak RSS — the process ran every set,
so that peak bounds the memory of every fuzzed command.

Each set starts from a valid invocation and replaces 1-3 option values with hostile ones
(at least one), so every set must fail: the report lists any that exit 0, raise (a
traceback), print other than exactly one ``error:`` line (or a usage error), leave files
behind, or reach model loading (work that a bad argument should have stopped first)."""

from __future__ import annotations

import json
import os
import random
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

INT_BAD = ["-1", "0", "-99999999999", "1e12", "abc", "", "99999999999999999999", "1.5"]
FLOAT_BAD = ["-1", "nan", "inf", "-inf", "1e300", "abc", "", "-0.0"]
STR_BAD = ["", "bogus", "../../etc/passwd", "ü🚀", "-", "a" * 300, "poisson:rate=1e9",
           "synthetic:blocks=-1"]
IN_BAD = ["missing.yaml", "adir", "binary.bin", "empty.txt", "list.json", "trace.parquet",
          "plan.yaml", "counts.npy", "/proc/nope", ""]
OUT_BAD = ["adir", "/proc/nope/x.json", "binary.bin/x.json", "", "fifo", "link-to-fifo"]
STORE_BAD = ["", "/proc/nope/store", "binary.bin", "   "]
PORT_BAD = ["-1", "65536", "abc", "", "1e12", "99999999999999999999", "1.5"]
POS_FLOAT_BAD = ["-1", "nan", "inf", "-inf", "1e300", "abc", "", "-0.0", "0"]
FAULT_BAD = ["", "bogus", "crash", "crash:2", "crash:nan", "crash:0.1:x", "store-503:0.1",
             "stall:0.1:1:1e9", "a" * 300]
KINDS = {"int": INT_BAD, "float": FLOAT_BAD, "str": STR_BAD, "in": IN_BAD, "out": OUT_BAD,
         "store": STORE_BAD, "port": PORT_BAD, "posfloat": POS_FLOAT_BAD, "fault": FAULT_BAD}
SYN = "synthetic:blocks=4,experts=8,top_k=2"

# command -> (positional args, {option: (valid value, kind)}); valid values reference seeds.
COMMANDS: dict[str, tuple[list[str], dict[str, tuple[str, str]]]] = {
    "simulate": ([], {
        "--model": (SYN, "str"), "--memory": ("2048", "int"), "--duration": ("5", "float"),
        "--replicas": ("1", "int"), "--beta": ("1", "int"), "--top-k": ("2", "int"),
        "--workload": ("poisson:rate=1", "str"), "--policy": ("static", "str"),
        "--platform": ("aws-lambda", "str"), "--seed": ("0", "int"), "--slo": ("5", "float"),
        "--keep-alive": ("60", "float"), "--concurrency": ("1", "int"),
        "--interval": ("5", "float"), "--prompt-tokens": ("16", "int"),
        "--output-tokens": ("0", "int"), "--method": ("direct", "str"),
        "--decode": ("batched", "str"), "--profile": ("profile.json", "in"),
        "-o": ("r.json", "out"), "--png": ("t.png", "out")}),
    "plan": ([], {
        "--profile": ("profile.json", "in"), "--counts": ("trace.parquet", "in"),
        "--slo": ("30", "float"), "--platform": ("aws-lambda", "str"),
        "--policy": ("ods", "str"), "--tokens": ("256", "int"),
        "--max-replicas": ("4", "int"), "--time-limit": ("5", "float"),
        "--seed": ("0", "int"), "-o": ("p.yaml", "out")}),
    "plan show": (["plan.yaml"], {}),
    "platforms show": (["aws-lambda"], {}),
    "traces show": (["trace.parquet"], {"--png": ("h.png", "out")}),
    "plan bo": ([], {
        "--profile": ("profile.json", "in"), "--predictor": ("pred.npz", "in"),
        "--bo-trace": ("trace.parquet", "in"), "--slo": ("30", "float"),
        "--platform": ("aws-lambda-2020", "str"), "--batch-tokens": ("64", "int"),
        "--pairs": ("10", "int"), "--iterations": ("2", "int"), "--sampler": ("random", "str"),
        "--seed": ("0", "int"), "-o": ("bo.yaml", "out"), "--save-predictor": ("a.npz", "out")}),
    "predict fit": ([], {
        "--train": ("trace.parquet", "in"), "--predictor": ("bayes", "str"),
        "--max-tokens": ("256", "int"), "--seed": ("0", "int"), "-o": ("f.npz", "out")}),
    "predict eval": ([], {
        "--train": ("trace.parquet", "in"), "--test": ("trace.parquet", "in"),
        "--predictors": ("bayes", "str"), "--batch-tokens": ("64", "int"),
        "--seed": ("0", "int"), "-o": ("e.json", "out"), "--png": ("e.png", "out")}),
    "profile": ([], {
        "--model": ("tiny-mixtral-random", "str"), "--dataset": ("wikitext2", "str"),
        "--max-tokens": ("64", "int"), "--max-length": ("32", "int"),
        "--batch-size": ("2", "int"), "-o": ("t.parquet", "out")}),
    "profile-compute": ([], {
        "--model": ("tiny-mixtral-random", "str"), "--threads": ("1", "str"),
        "--batch-sizes": ("1,16", "str"), "--repeats": ("1", "int"), "--seed": ("0", "int"),
        "-o": ("pc.json", "out"), "--png": ("pc.png", "out")}),
    "run": ([], {
        "--plan": ("plan.yaml", "in"), "--tokens": ("64", "int"), "--batch-size": ("2", "int"),
        "--max-length": ("32", "int"), "--workers": ("1", "int"),
        "--backend": ("local", "str"), "--dataset": ("wikitext2", "str"),
        "-o": ("run.json", "out")}),
    "deploy": (["plan.yaml"], {"--backend": ("local", "str"), "--store": ("store", "store"),
                               "-o": ("dep.json", "out")}),
    "demo": (["--quick"], {"--platform": ("aws-lambda-2020", "str"),
                           "--traffic": ("wikitext2", "str"), "--iterations": ("2", "int"),
                           "--workers": ("1", "int"), "--slo": ("30", "float")}),
    # (demo's -o is a folder: an existing one such as "adir" is valid, so it is not fuzzed)
    "models info": (["tiny-mixtral-random"], {}),
    # commands that serve, generate, scale, export and distill (model loads are blocked:
    # a hostile value must be refused before any model is built or loaded)
    "generate": ([], {
        "--model": ("tiny-mixtral-random", "str"), "--prompt": ("hi", "str"),
        "--num-prompts": ("2", "int"), "--max-tokens": ("4", "int"),
        "--top-p": ("1", "posfloat"), "--max-num-seqs": ("8", "int"),
        "--device": ("cpu", "str"), "--kernel": ("auto", "str")}),
    "serve": ([], {
        "--model": ("tiny-mixtral-random", "str"), "--port": ("8000", "port"),
        "--max-num-seqs": ("8", "int"), "--max-waiting": ("256", "int"),
        "--max-body-kb": ("4096", "int"), "--memory-mb": ("2048", "int"),
        "--platform": ("aws-lambda", "str"), "--slo-ttft": ("1", "posfloat"),
        "--slo-tpot": ("0.1", "posfloat"), "--step-timeout": ("120", "posfloat"),
        "--inject-faults": ("crash:0.1", "fault"), "--device": ("cpu", "str")}),
    "bench serve": ([], {
        "--url": ("http://127.0.0.1:9", "str"), "--dataset": ("wikitext2", "str"),
        "--workload": ("poisson:rate=1", "str"), "--duration": ("2", "posfloat"),
        "--max-requests": ("4", "int"), "--max-tokens": ("4", "int"),
        "--drain": ("5", "posfloat"), "--slo-ttft": ("1", "posfloat"),
        "-o": ("b.json", "out")}),
    "autoscale train": ([], {
        "--out": ("ck.pt", "out"), "--episodes": ("1", "int"), "--variant": ("full", "str"),
        "--slo": ("0.3", "posfloat"), "--interval": ("10", "posfloat"),
        "--model": (SYN, "str"), "--window-minutes": ("1", "int"),
        "--mean-rps": ("1", "posfloat"), "--threads": ("1", "int")}),
    "autoscale eval": ([], {
        "--checkpoint": ("ck.pt", "in"), "--baselines": ("static", "str"),
        "--pattern": ("bursty", "str"), "--windows": ("1", "int"), "-o": ("ev.json", "out")}),
    "autoscale convert-checkpoint": (["ck.pt", "new.safetensors"], {}),
    # -o is a folder for compare, so "adir" would be a valid hostile value: left out
    "compare": ([], {
        "--model": ("tiny-moe-lm", "str"), "--traffic": ("poisson:rate=1", "str"),
        "--platform": ("aws-lambda", "str"), "--slo-ttft": ("1", "posfloat"),
        "--slo-tpot": ("0.2", "posfloat"), "--duration": ("60", "posfloat"),
        "--rate-scale": ("1", "posfloat"), "--measure": ("0", "int"), "--seed": ("0", "int")}),
    "report": (["results-dir"], {}),
    "export": (["plan.yaml"], {"--format": ("knative", "str"), "-o": ("svc.yaml", "out")}),
    "brownout distill": ([], {
        "--model": ("tiny-moe-lm-e32", "str"), "--ways": ("2", "str"),
        "--grouping": ("index", "str"), "--calib-tokens": ("64", "int"),
        "--max-epochs": ("1", "int")}),
    **{f"plan --policy {policy}": ([], {
        "--platform": ("gcp-cloud-run-l4", "str"),
        "--remote-platform": ("gcp-cloud-run-functions", "str"),
        "--ttft": ("30", "posfloat"), "--tpot": ("1", "posfloat"),
        "--activation": ("act.npy", "in"), "--n-in": ("16", "int"), "--n-out": ("8", "int"),
        "-o": ("r.yaml", "out")}) for policy in ("remoe", "cpu", "gpu", "mix", "fetch")},
}
POSITIONAL_KIND = {"autoscale convert-checkpoint": "in", "plan show": "in", "report": "in",
                   "traces show": "in", "platforms show": "str",
                   "deploy": "in", "models info": "str", "export": "in"}
MODEL_LOAD = "FUZZ-MODEL-LOAD-REACHED"


def argument_sets(n: int, seed: int) -> list[list[str]]:
    """``n`` hostile argument sets, each with 1-3 hostile values (deterministic)."""
    rng = random.Random(seed)
    names = sorted(COMMANDS)
    out: list[list[str]] = []
    while len(out) < n:
        cmd = names[len(out) % len(names)]
        pos, opts = COMMANDS[cmd]
        pos = list(pos)
        values = {k: v for k, (v, _) in opts.items()}
        targets = list(opts) + (["<pos>"] if cmd in POSITIONAL_KIND else [])
        for target in rng.sample(targets, min(len(targets), rng.randint(1, 3))):
            if target == "<pos>":
                pos[0] = rng.choice([v for v in KINDS[POSITIONAL_KIND[cmd]] if v != pos[0]])
            else:
                valid, kind = opts[target]
                values[target] = rng.choice([v for v in KINDS[kind] if v != valid])
        args = cmd.split() + pos
        for k, v in values.items():
            args += [k, v]
        out.append(args)
    return out


def make_seeds(folder: Path) -> None:
    from typer.testing import CliRunner

    from moefleet.cli import app
    from tests.reliability.hostile import seed_files

    paths = seed_files(folder)
    (folder / "adir").mkdir()
    (folder / "binary.bin").write_bytes(bytes(range(256)) * 4)
    (folder / "empty.txt").write_text("")
    (folder / "list.json").write_text("[1, 2]")
    os.mkfifo(folder / "fifo")  # an output must never open (or replace) one
    (folder / "link-to-fifo").symlink_to(folder / "fifo")
    import numpy as np  # a Remoe activation distribution (layers x experts, rows sum to 1)

    act = np.random.default_rng(0).random((26, 64))
    np.save(folder / "act.npy", act / act.sum(axis=1, keepdims=True))
    runner = CliRunner()
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        for args in (["plan", "--profile", str(paths["profile"]), "--counts",
                      str(paths["trace"]), "--slo", "30", "-o", "plan.yaml"],
                     ["predict", "fit", "--train", str(paths["trace"]), "-o", "pred.npz"]):
            res = runner.invoke(app, args)
            assert res.exit_code == 0, res.output
    finally:
        os.chdir(cwd)


def peak_kb() -> int:
    """This process's peak RSS in KiB: ``VmHWM``, which counts this process's own memory
    only. (``ru_maxrss`` does not: Linux carries the parent's peak across ``exec``, so a
    child of a 2.2 GB pytest process reported 2.2 GB before it had done anything.)"""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _block_model_loads() -> None:
    """A hostile argument must be refused before a zoo model is built or loaded (names
    that are not zoo entries still go through the real resolver, which must fail cleanly)."""
    from moefleet.errors import MoefleetError
    from moefleet.models import zoo

    def refuse(*a: Any, **k: Any) -> Any:
        raise MoefleetError(MODEL_LOAD)

    zoo.build = refuse  # type: ignore[assignment]
    zoo.load = refuse  # type: ignore[assignment]


def classify(code: int, output: str, exc: BaseException | None, new_files: set[str]) -> str:
    """'' when the run failed cleanly; otherwise what went wrong."""
    if exc is not None and not isinstance(exc, SystemExit):
        return f"exception {type(exc).__name__}: {exc}"
    if MODEL_LOAD in output:
        return "reached model loading"
    if code == 0:
        return "exit 0 on hostile input"
    if "Traceback" in output:
        return "traceback"
    errors = [ln for ln in output.splitlines() if ln.startswith("error:")]
    usage = "Usage:" in output and ("Invalid value" in output or "No such" in output
                                    or "Missing" in output or "requires an argument" in output
                                    or "Got unexpected" in output)
    if len(errors) != 1 and not usage:
        return f"{len(errors)} error lines: {output[-300:]!r}"
    if new_files:
        return f"left files behind: {sorted(new_files)}"
    return ""


def run(n: int, seed: int) -> dict[str, Any]:
    from typer.testing import CliRunner

    from moefleet.cli import app
    from tests.reliability.hostile import files_under

    folder = Path(tempfile.mkdtemp(prefix="moefleet-cli-fuzz-"))
    os.environ["MOEFLEET_CACHE_DIR"] = str(folder / "cache")
    make_seeds(folder)
    _block_model_loads()
    runner = CliRunner()
    failures: list[dict[str, Any]] = []
    os.chdir(folder)
    grew: list[tuple[float, list[str]]] = []  # (MB the peak rose by, the set that did it)
    for args in argument_sets(n, seed):
        before = files_under(folder)
        peak0 = peak_kb()
        res = runner.invoke(app, args)
        rise = (peak_kb() - peak0) / 1024
        if rise > 0:
            grew.append((rise, args))
        new = {f for f in files_under(folder) - before if not f.startswith("cache/")}
        verdict = classify(res.exit_code, res.output, res.exception, new)
        if verdict:
            failures.append({"args": args, "why": verdict})
        for f in new:  # keep the next set's "before" honest
            (folder / f).unlink()
    peak = peak_kb()
    top = sorted(grew, key=lambda g: -g[0])[:5]  # where a too-high peak came from
    return {"runs": n, "failures": failures, "peak_rss_mb": peak / 1024,
            "peak_rises_mb": [{"mb": round(mb, 1), "args": a} for mb, a in top]}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    report = run(int(sys.argv[1]), int(sys.argv[2]))
    print("REPORT " + json.dumps(report))
