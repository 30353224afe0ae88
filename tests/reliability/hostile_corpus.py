"""The hostile-input corpus: every command that reads a file or a sizing number, fed
inputs that must be refused with one ``error:`` line (or a usage error), a non-zero exit,
no traceback and no output file, quickly.

A case is ``(kind, name, build)``; ``build(seeds, work)`` writes whatever hostile file
the case needs under ``work`` and returns the command's arguments. Kinds: ``plan``,
``checkpoint``, ``activation``, ``counts``, ``dataset``, ``output``, ``cli-number``
(malformed model directories are :mod:`tests.reliability.model_dirs`). Seeds (a valid
plan, Remoe plan, profile, trace, sMoE checkpoint, tiny checkpoint directory) are built
once by :func:`make_seeds`; nothing here needs a zoo model or the network.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from tests.reliability.corpus_types import SYN, Build, Case, Seeds
from tests.reliability.hostile_cli import number_cases, output_cases

__all__ = ["Build", "Case", "Seeds", "all_cases", "make_seeds"]


def make_seeds(folder: Path) -> Seeds:
    """Valid inputs every hostile variant starts from (a few seconds, no zoo model)."""
    from moefleet.autoscale.smoe import ActorSpec, ConfigSpace, DDPGConfig
    from moefleet.autoscale.smoe.train import TrainSetup, new_agent, save_checkpoint
    from moefleet.models.shape import ModelShape
    from moefleet.remoe.plans import manual_plan
    from tests.reliability.hostile import seed_files
    from tests.reliability.model_dirs import seed_model

    s = dict(seed_files(folder))
    s["model"] = seed_model(folder / "tiny-mixtral")
    shape = ModelShape(name=str(s["model"]), num_layers=2, moe_layers=[0, 1],
                       num_experts=[4, 4], top_k=2)
    remoe = manual_plan(shape, "alibaba-fc-gpu", {0: [2, 3], 1: [2, 3]}, main_memory_mb=2048,
                        remote_memory_mb=1024, replicas=2, gpu_gb=2.0)
    s["remoe"] = remoe.save(folder / "remoe.yaml")
    from moefleet.plan import DeploymentPlan

    s["plan"] = DeploymentPlan.uniform(str(s["model"]), "aws-lambda", [0, 1], [4, 4], 2, 1024,
                                       method="direct").save(folder / "plan.yaml")
    setup = TrainSetup(model=SYN, slo_s=0.2)
    space = ConfigSpace(memory_mb=(512, 2048), replicas=(1, 2), concurrency=(1, 2))
    _, agent = new_agent(setup, space, ActorSpec(hidden=8), DDPGConfig(), seed=0)
    s["ckpt"] = save_checkpoint(folder / "smoe.pt", agent, setup, 0, [])
    np.save(folder / "act.npy", np.full((26, 64), 1 / 64))
    s["act"] = folder / "act.npy"
    (folder / "timing.json").write_text(json.dumps({"cpu_flops_1": 1.6e9,
                                                    "cpu_flops_batch": 1.8e10}))
    s["timing"] = folder / "timing.json"
    (folder / "prompts.txt").write_text("the cat sat on the mat\n\nhello world\n")
    s["prompts"] = folder / "prompts.txt"
    return s


# ---- hostile file contents ---------------------------------------------------------------
def _text(name: str, text: str | bytes) -> Callable[[Path], Path]:
    def make(work: Path) -> Path:
        p = work / name
        p.write_bytes(text.encode() if isinstance(text, str) else text)
        return p
    return make


def _special(kind: str, name: str) -> Callable[[Path], Path]:
    def make(work: Path) -> Path:
        p = work / name
        if kind == "fifo":
            os.mkfifo(p)
        elif kind == "dir":
            p.mkdir()
        elif kind == "missing":
            pass
        elif kind == "sparse":  # 1 GiB that costs no disk: a size check must refuse it
            with open(p, "wb") as f:
                f.truncate(1 << 30)
        else:  # a symlink to a device
            p.symlink_to(kind)
        return p
    return make


def _specials(suffix: str) -> dict[str, Callable[[Path], Path]]:
    return {"fifo": _special("fifo", "in" + suffix), "dir": _special("dir", "in" + suffix),
            "missing": _special("missing", "in" + suffix),
            "dev-zero": _special("/dev/zero", "in" + suffix),
            "dev-urandom": _special("/dev/urandom", "in" + suffix)}


def _plan_variant(change: Callable[[dict[str, Any]], None], seed: str = "plan",
                  ) -> Callable[[Seeds, Path], Path]:
    def make(s: Seeds, work: Path) -> Path:
        d = yaml.safe_load(s[seed].read_text())
        change(d)
        p = work / "bad.yaml"
        p.write_text(yaml.safe_dump(d))
        return p
    return make


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(d: dict[str, Any]) -> None:
        node: Any = d
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
    return change


def _dup_group(d: dict[str, Any]) -> None:
    d["groups"].append(dict(d["groups"][0]))


def _overlap_group(d: dict[str, Any]) -> None:
    g = dict(d["groups"][0])
    g["experts"], g["replica_experts"] = [3], None
    d["groups"].append(g)


def _ignore_seeds(make: Callable[[Path], Path]) -> Callable[[Seeds, Path], Path]:
    return lambda s, w: make(w)


LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
    for p, c in zip("abcdefgh", "bcdefghi", strict=True))

PLAN_FILES: dict[str, Callable[[Seeds, Path], Path]] = {
    **{k: _ignore_seeds(f) for k, f in _specials(".yaml").items()},
    "empty": lambda s, w: _text("bad.yaml", "")(w),
    "not-yaml": lambda s, w: _text("bad.yaml", "{[: :")(w),
    "yaml-list": lambda s, w: _text("bad.yaml", "- 1\n- 2\n")(w),
    "yaml-scalar": lambda s, w: _text("bad.yaml", "42\n")(w),
    "binary": lambda s, w: _text("bad.yaml", bytes(range(256)) * 4)(w),
    "billion-laughs": lambda s, w: _text("bad.yaml", LAUGHS)(w),
    "deep-nesting": lambda s, w: _text("bad.yaml", "[" * 5000 + "]" * 5000)(w),
    "python-tag": lambda s, w: _text("bad.yaml", "!!python/object/apply:os.system [ls]\n")(w),
    "no-layers": _plan_variant(lambda d: d.pop("layers")),
    "memory-negative": _plan_variant(_set(["layers", 0, "experts", 0, "memory_mb"], -1)),
    "memory-string": _plan_variant(_set(["layers", 0, "experts", 0, "memory_mb"], "1024")),
    "memory-huge": _plan_variant(_set(["layers", 0, "experts", 0, "memory_mb"], 10**15)),
    "replicas-zero": _plan_variant(_set(["layers", 0, "experts", 0, "replicas"], 0)),
    "replicas-huge": _plan_variant(_set(["layers", 0, "experts", 0, "replicas"], 10**9)),
    "method-unknown": _plan_variant(_set(["layers", 0, "method"], "teleport")),
    "predicted-nan": _plan_variant(_set(["predicted"], {"cost_usd": float("nan")})),
    "layers-repeated": _plan_variant(lambda d: d["layers"].append(d["layers"][0])),
    "groups-repeated": _plan_variant(_dup_group, "remoe"),
    "groups-overlap": _plan_variant(_overlap_group, "remoe"),
    "group-expert-range": _plan_variant(_set(["groups", 0, "experts"], [2, 99]), "remoe"),
    "main-gpu-huge": _plan_variant(_set(["main", "gpu_gb"], 99999), "remoe"),
    "main-memory-zero": _plan_variant(_set(["main", "memory_mb"], 0), "remoe"),
    "platform-unknown": _plan_variant(_set(["platform"], "no-such-cloud")),
}


#: Plans that parse but that their platform cannot run: ``plan show`` only prints a plan
#: (and says what it holds); every command that would run or export it refuses them.
VIEWABLE = {"main-gpu-huge", "platform-unknown"}


def _plan_commands(s: Seeds, w: Path, p: Path) -> dict[str, list[str]]:
    return {
        "simulate": ["simulate", "--plan", str(p), "--duration", "5", "--memory", "1024"],
        "export": ["export", str(p), "--format", "openfaas", "-o", str(w / "out.yaml")],
        "show": ["plan", "show", str(p)],
        "run": ["run", "--plan", str(p), "--dataset", str(s["prompts"]), "--tokens", "8"],
        "generate": ["generate", "--model", str(s["model"]), "--prompt", "hi", "--plan", str(p),
                     "--max-tokens", "2"],
    }


def plan_cases() -> list[Case]:
    out: list[Case] = []
    for content, make in PLAN_FILES.items():
        for cmd in ("simulate", "export", "show", "run", "generate"):
            if cmd == "show" and content in VIEWABLE:
                continue
            def build(s: Seeds, w: Path, make: Any = make, cmd: str = cmd) -> list[str]:
                return _plan_commands(s, w, make(s, w))[cmd]
            out.append(("plan", f"{content}/{cmd}", build))
    return out


# ---- sMoE checkpoints ----------------------------------------------------------------------
def _safetensors(tensors: dict[str, Any], meta: dict[str, str] | None) -> bytes:
    from safetensors.torch import save

    return save(tensors, metadata=meta)


def _ckpt_variant(kind: str) -> Callable[[Seeds, Path], Path]:
    def make(s: Seeds, w: Path) -> Path:
        import torch
        from safetensors.torch import load_file

        p = w / "bad.pt"
        raw = s["ckpt"].read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        meta = json.loads(raw[8:8 + n]).get("__metadata__", {})
        tensors = load_file(str(s["ckpt"]))
        if kind == "truncated":
            p.write_bytes(raw[: len(raw) // 2])
        elif kind == "no-metadata":
            p.write_bytes(_safetensors(tensors, None))
        elif kind == "metadata-garbage":
            p.write_bytes(_safetensors(tensors, {k: "{not json" for k in meta}))
        elif kind == "metadata-missing-keys":
            blob = json.loads(next(iter(meta.values())))
            blob.pop(next(iter(blob)))
            p.write_bytes(_safetensors(tensors, {k: json.dumps(blob) for k in meta}))
        elif kind == "metadata-extra-key":
            blob = json.loads(next(iter(meta.values())))
            blob["surprise"] = 1
            p.write_bytes(_safetensors(tensors, {k: json.dumps(blob) for k in meta}))
        elif kind == "tensor-missing":
            tensors.pop(next(k for k in tensors if k.startswith("actor.")))
            p.write_bytes(_safetensors(tensors, meta))
        elif kind == "tensor-extra":
            tensors["actor.surprise"] = torch.zeros(3)
            p.write_bytes(_safetensors(tensors, meta))
        elif kind == "tensor-nan":
            k = next(k for k in tensors
                     if k.startswith("actor.") and tensors[k].is_floating_point())
            tensors[k] = torch.full_like(tensors[k], float("nan"))
            p.write_bytes(_safetensors(tensors, meta))
        elif kind == "tensor-shape":
            k = next(k for k in tensors if k.startswith("actor.") and tensors[k].ndim == 2)
            tensors[k] = torch.zeros(tensors[k].shape[0] + 1, tensors[k].shape[1])
            p.write_bytes(_safetensors(tensors, meta))
        elif kind == "torch-pickle":
            torch.save({"actor": {}}, p)
        elif kind == "random-bytes":
            p.write_bytes(np.random.default_rng(0).bytes(4096))
        elif kind == "empty":
            p.write_bytes(b"")
        elif kind == "text":
            p.write_text("this is not a checkpoint\n")
        else:
            return _specials(".pt")[kind](w)
        return p
    return make


CKPT_KINDS = ["truncated", "no-metadata", "metadata-garbage", "metadata-missing-keys",
              "metadata-extra-key", "tensor-missing", "tensor-extra", "tensor-nan",
              "tensor-shape", "torch-pickle", "random-bytes", "empty", "text", "fifo", "dir",
              "missing", "dev-zero"]


def checkpoint_cases() -> list[Case]:
    out: list[Case] = []
    for kind in CKPT_KINDS:
        make = _ckpt_variant(kind)

        def ev(s: Seeds, w: Path, make: Any = make) -> list[str]:
            return ["autoscale", "eval", "-c", str(make(s, w)), "--pattern", "bursty",
                    "--windows", "1", "--baselines", "static", "-o", str(w / "out.json")]

        def tr(s: Seeds, w: Path, make: Any = make) -> list[str]:
            return ["autoscale", "train", "--out", str(make(s, w)), "--resume", "--model", SYN,
                    "--slo", "0.2", "--episodes", "1", "--no-teacher"]
        out.append(("checkpoint", f"{kind}/eval", ev))
        if kind != "missing":  # --resume without a checkpoint starts one (documented)
            out.append(("checkpoint", f"{kind}/train-resume", tr))
    return out


# ---- activation arrays, counts, timing --------------------------------------------------
def _npy(arr: Any) -> Callable[[Path], Path]:
    def make(w: Path) -> Path:
        p = w / "a.npy"
        np.save(p, arr)
        return p
    return make


def _npy_header_lie(w: Path) -> Path:
    p = w / "a.npy"
    np.save(p, np.zeros((2, 2)))
    raw = p.read_bytes().replace(b"(2, 2)", b"(99999999, 99999999)"[:6])
    p.write_bytes(raw[:-8])
    return p


ARRAYS: dict[str, Callable[[Path], Path]] = {
    "strings": _npy(np.array([["a"] * 64] * 26)),
    "zeros": _npy(np.zeros((26, 64))),
    "nan": _npy(np.full((26, 64), np.nan)),
    "inf": _npy(np.full((26, 64), np.inf)),
    "negative": _npy(-np.ones((26, 64))),
    "one-d": _npy(np.ones(64)),
    "three-d": _npy(np.ones((2, 26, 64))),
    "empty": _npy(np.zeros((0, 0))),
    "bool": _npy(np.ones((26, 64), dtype=bool)),
    "complex": _npy(np.ones((26, 64), dtype=complex)),
    "wrong-shape": _npy(np.full((3, 5), 0.2)),
    "truncated": _npy_header_lie,
    "random-bytes": _text("a.npy", np.random.default_rng(1).bytes(2048)),
    "pickled-object": lambda w: (np.save(w / "a.npy", np.array([{"x": 1}], dtype=object),
                                         allow_pickle=True), w / "a.npy")[1],
    **_specials(".npy"),
}
JSON_ACTIVATIONS: dict[str, str] = {
    "json-list": "[1, 2, 3]",
    "json-strings": json.dumps({"model": "deepseek-v2-lite", "s_LE": [["a"] * 64] * 26}),
    "json-other-model": json.dumps({"model": "gpt2-moe", "s_LE": [[1 / 64] * 64] * 26}),
    "json-nan": '{"s_LE": [[NaN]]}',
    "json-ragged": json.dumps({"s_LE": [[0.5, 0.5], [1.0]]}),
}


def array_cases() -> list[Case]:
    out: list[Case] = []
    remoe = ["plan", "--policy", "remoe", "--platform", "alibaba-fc-gpu", "--ttft", "60",
             "--tpot", "2"]
    for name, make in ARRAYS.items():
        def act(s: Seeds, w: Path, make: Any = make) -> list[str]:
            return [*remoe, "--timing", str(s["timing"]), "--activation", str(make(w)),
                    "-o", str(w / "p.yaml")]

        def counts(s: Seeds, w: Path, make: Any = make) -> list[str]:
            return ["plan", "--profile", str(s["profile"]), "--counts", str(make(w)),
                    "--slo", "30", "-o", str(w / "p.yaml")]
        out += [("activation", name, act), ("counts", name, counts)]
    for name, text in JSON_ACTIVATIONS.items():
        def jact(s: Seeds, w: Path, text: str = text) -> list[str]:
            return [*remoe, "--timing", str(s["timing"]), "--activation",
                    str(_text("a.json", text)(w)), "-o", str(w / "p.yaml")]
        out.append(("activation", name, jact))
    for name, text in {"timing-empty": "", "timing-list": "[1]", "timing-extra":
                       '{"cpu_flops_1": 1, "cpu_flops_batch": 1, "x": 1}',
                       "timing-negative": '{"cpu_flops_1": -1, "cpu_flops_batch": 1e9}',
                       "timing-nan": '{"cpu_flops_1": NaN, "cpu_flops_batch": 1e9}'}.items():
        def timing(s: Seeds, w: Path, text: str = text) -> list[str]:
            return [*remoe, "--activation", str(s["act"]), "--timing",
                    str(_text("t.json", text)(w)), "-o", str(w / "p.yaml")]
        out.append(("activation", name, timing))
    return out


# ---- datasets ----------------------------------------------------------------------------
DATASETS: dict[str, Callable[[Path], Path]] = {
    **_specials(".txt"),
    "sparse-1gib": _special("sparse", "in.txt"),
    "empty": _text("in.txt", ""),
    "blank-lines": _text("in.txt", "\n\n   \n\n"),
    "binary": _text("in.txt", bytes(range(256)) * 4),
    "latin1": _text("in.txt", "caf\xe9 au lait\n".encode("latin-1")),
    "jsonl-broken": _text("in.jsonl", '{"text": "a"}\n{"text": \n'),
    "jsonl-no-field": _text("in.jsonl", '{"nothing": "here"}\n'),
    "json-numbers": _text("in.json", "[1, 2, 3]"),
    "json-object": _text("in.json", '{"text": 5}'),
    "csv": _text("in.csv", "a,b\n1,2\n"),
    "parquet-name": _text("in.parquet", "not parquet"),
    "unknown-name": lambda w: w / "no-such-dataset",
}


def dataset_cases() -> list[Case]:
    out: list[Case] = []
    for name, make in DATASETS.items():
        def gen(s: Seeds, w: Path, make: Any = make) -> list[str]:
            return ["generate", "--model", str(s["model"]), "--dataset", str(make(w)),
                    "--max-tokens", "2"]

        def prof(s: Seeds, w: Path, make: Any = make) -> list[str]:
            return ["profile", "--model", str(s["model"]), "--dataset", str(make(w)),
                    "--max-tokens", "8", "--out", str(w / "t.parquet")]

        def bench(s: Seeds, w: Path, make: Any = make) -> list[str]:
            return ["bench", "serve", "--url", "http://127.0.0.1:9", "--dataset", str(make(w)),
                    "--workload", "poisson:rate=1", "--duration", "1", "--max-requests", "1",
                    "-o", str(w / "b.json")]
        out += [("dataset", f"{name}/generate", gen), ("dataset", f"{name}/profile", prof),
                ("dataset", f"{name}/bench-serve", bench)]
    return out


def all_cases() -> list[Case]:
    return (plan_cases() + checkpoint_cases() + array_cases() + dataset_cases()
            + output_cases() + number_cases())
