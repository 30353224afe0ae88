"""Hostile-input corpus, part two: output paths no command can write to, and CLI numbers
out of range (NaN, negative, zero, huge). See :mod:`tests.reliability.hostile_corpus`."""

from __future__ import annotations

import os
from pathlib import Path

from tests.reliability.corpus_types import SYN, Build, Case, Seeds


# ---- output paths --------------------------------------------------------------------------
def _target(kind: str, w: Path, name: str) -> str:
    if kind == "dir":
        (w / name).mkdir()
        return str(w / name)
    if kind == "fifo":
        os.mkfifo(w / name)
        return str(w / name)
    if kind == "under-a-file":
        (w / "afile").write_text("x")
        return str(w / "afile" / name)
    if kind == "name-too-long":
        return str(w / ("x" * 300 + name))
    if kind == "link-to-dev-full":
        (w / name).symlink_to("/dev/full")
        return str(w / name)
    return {"dev-full": "/dev/full", "dev-zero": "/dev/zero", "proc": "/proc/self/x" + name,
            "sys": "/sys/x" + name}[kind]


OUTPUT_KINDS = ["dir", "fifo", "under-a-file", "name-too-long", "link-to-dev-full",
                "dev-full", "dev-zero", "proc"]


def output_cases() -> list[Case]:
    def commands(s: Seeds, t: str) -> dict[str, list[str]]:
        return {
            "plan": ["plan", "--profile", str(s["profile"]), "--counts", str(s["trace"]),
                     "--slo", "30", "-o", t],
            "simulate": ["simulate", "--model", SYN, "--memory", "1024", "--duration", "2",
                         "-o", t],
            "export": ["export", str(s["plan"]), "--format", "knative", "-o", t],
            "predict-fit": ["predict", "fit", "--train", str(s["trace"]), "-o", t],
            "profile": ["profile", "--model", str(s["model"]), "--dataset", str(s["prompts"]),
                        "--max-tokens", "8", "--out", t],
            "bench-serve": ["bench", "serve", "--url", "http://127.0.0.1:9", "--dataset",
                            str(s["prompts"]), "--workload", "poisson:rate=1", "--duration",
                            "1", "-o", t],
        }
    out: list[Case] = []
    for kind in OUTPUT_KINDS:
        for cmd in ("plan", "simulate", "export", "predict-fit", "profile", "bench-serve"):
            suffix = {"predict-fit": ".npz", "plan": ".yaml", "export": ".yaml",
                      "profile": ".parquet"}.get(cmd, ".json")

            def build(s: Seeds, w: Path, kind: str = kind, cmd: str = cmd,
                      suffix: str = suffix) -> list[str]:
                return commands(s, _target(kind, w, "o" + suffix))[cmd]
            out.append(("output", f"{kind}/{cmd}", build))
    return out


# ---- CLI numbers ---------------------------------------------------------------------------
def number_cases() -> list[Case]:
    def gen(*extra: str) -> Build:
        return lambda s, w: ["generate", "--model", str(s["model"]), "--prompt", "hi", *extra]

    def sim(*extra: str) -> Build:
        return lambda s, w: ["simulate", "--model", SYN, "--memory", "1024", *extra]

    def train(*extra: str) -> Build:
        return lambda s, w: ["autoscale", "train", "--out", str(w / "n.pt"), "--model", SYN,
                             "--slo", "0.2", "--episodes", "1", *extra]

    def bo(*extra: str) -> Build:
        return lambda s, w: ["plan", "bo", "--profile", str(s["profile"]), "-o",
                             str(w / "bo.yaml"), *extra]

    def plan(*extra: str) -> Build:
        return lambda s, w: ["plan", "--profile", str(s["profile"]), "--counts",
                             str(s["trace"]), "-o", str(w / "p.yaml"), *extra]

    def bench(*extra: str) -> Build:
        return lambda s, w: ["bench", "serve", "--url", "http://127.0.0.1:9", "--dataset",
                             str(s["prompts"]), "-o", str(w / "b.json"), *extra]

    def run(*extra: str) -> Build:
        return lambda s, w: ["run", "--plan", str(s["remoe"]), "--dataset",
                             str(s["prompts"]), *extra]

    def serve(*extra: str) -> Build:
        return lambda s, w: ["serve", "--model", str(s["model"]), *extra]

    table: dict[str, Build] = {
        "generate-seed-2**64": gen("--seed", str(2**64)),
        "generate-seed-negative": gen("--seed", "-1"),
        "generate-max-tokens-0": gen("--max-tokens", "0"),
        "generate-max-tokens-huge": gen("--max-tokens", str(10**12)),
        "generate-temperature-nan": gen("--temperature", "nan"),
        "generate-temperature-negative": gen("--temperature", "-1"),
        "generate-top-p-0": gen("--top-p", "0"),
        "generate-top-p-nan": gen("--top-p", "nan"),
        "generate-top-k-negative": gen("--top-k", "-1"),
        "generate-num-prompts-0": gen("--num-prompts", "0"),
        "generate-max-num-seqs-0": gen("--max-num-seqs", "0"),
        "generate-workers-huge": gen("--plan", "x.yaml", "--workers", "100000"),
        "simulate-duration-nan": sim("--duration", "nan"),
        "simulate-duration-negative": sim("--duration", "-1"),
        "simulate-duration-huge": sim("--duration", "1e15"),
        "simulate-memory-0": sim("--memory", "0"),
        "simulate-replicas-0": sim("--replicas", "0"),
        "simulate-rate-huge": sim("--workload", "poisson:rate=1e12", "--duration", "100"),
        "simulate-rate-nan": sim("--workload", "poisson:rate=nan"),
        "simulate-huge-model": lambda s, w: ["simulate", "--model",
                                             "synthetic:blocks=100000,experts=100000,top_k=2",
                                             "--memory", "1024"],
        "simulate-interval-0": sim("--interval", "0"),
        "train-time-budget-nan": train("--time-budget", "nan"),
        "train-time-budget-inf": train("--time-budget", "inf"),
        "train-time-budget-negative": train("--time-budget", "-1"),
        "train-episodes-0": train("--episodes", "0"),
        "train-mean-rps-nan": train("--mean-rps", "nan"),
        "train-threads-0": train("--threads", "0"),
        "bo-iterations-0": bo("--iterations", "0"),
        "bo-iterations-huge": bo("--iterations", "10001"),
        "bo-pairs-huge": bo("--pairs", "20001"),
        "bo-batch-tokens-0": bo("--batch-tokens", "0"),
        "plan-slo-nan": plan("--slo", "nan"),
        "plan-slo-negative": plan("--slo", "-1"),
        "plan-tokens-0": plan("--slo", "30", "--tokens", "0"),
        "plan-max-replicas-0": plan("--slo", "30", "--max-replicas", "0"),
        "plan-time-limit-nan": plan("--slo", "30", "--time-limit", "nan"),
        "bench-duration-nan": bench("--workload", "poisson:rate=1", "--duration", "nan"),
        "bench-max-requests-0": bench("--workload", "poisson:rate=1", "--max-requests", "0"),
        "bench-rate-huge": bench("--workload", "poisson:rate=1e12", "--duration", "1e6"),
        "bench-workload-dev-zero": bench("--workload", "/dev/zero"),
        "run-tokens-huge": run("--tokens", str(10**8)),
        "run-tokens-0": run("--tokens", "0"),
        "run-workers-huge": run("--workers", "65"),
        "serve-port-negative": serve("--port", "-1"),
        "serve-port-huge": serve("--port", "70000"),
        "serve-max-num-seqs-0": serve("--max-num-seqs", "0"),
        "serve-step-timeout-nan": serve("--step-timeout", "nan"),
        "serve-max-body-0": serve("--max-body-kb", "0"),
    }
    return [("cli-number", name, build) for name, build in table.items()]
