"""Claim: tiny-moe-lm's trainer trains faster than a plain HF MixtralForCausalLM loop.

Shape legend: B batch, T sequence length, V vocabulary.

Side by side in one process, on the same batches and from the same initial weights, at
the thread count the zoo build uses (recipe ``train.threads``, 1 by default), one
optimizer step of each contender per round, rounds interleaved so that load from other
processes hits every contender alike; medians over the timed rounds:

- ``ours``: the zoo build's trainer (``train_step``, recipe precision: bf16 autocast);
- ``ours-fp32``: the same trainer without autocast (separates dispatch from precision);
- ``hf``: ``MixtralForCausalLM`` as transformers configures it (experts implementation
  ``grouped_mm`` where available), fp32, ``labels=`` loss + router aux loss;
- ``hf-eager-experts``: the same with ``experts_implementation="eager"`` (a Python loop
  over the experts hit);
- ``hf-bf16``: ``hf`` under the same bf16 autocast as ``ours``.

All use AdamW (fused, same hyper-parameters) and gradient clipping. Batches are random
token ids (throughput does not depend on the text). Writes
``benchmarks/results/zoo_build.json``; wall time is the headline, CPU time of this process
is reported beside it because the machine may be shared.

    .venv/bin/python benchmarks/zoo_build.py [--rounds 7] [--threads 1] [--budget-s 150]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from moefleet.io import write_json_atomic  # noqa: E402
from moefleet.models.tinylm.convert import to_hf  # noqa: E402
from moefleet.models.tinylm.model import TinyMoELM  # noqa: E402
from moefleet.models.tinylm.recipe import Recipe, parse_recipe, recipe_dict  # noqa: E402
from moefleet.models.tinylm.train import make_optimizer, train_step  # noqa: E402

VOCAB = 8192  # the default recipe's BPE size
Step = Callable[[torch.Tensor], float]


def ours_step(recipe: Recipe, model: TinyMoELM, precision: str) -> Step:
    spec = dataclasses.replace(recipe.train, precision=precision)
    opt = make_optimizer(model, spec)
    model.train()

    def step(ids_BT1: torch.Tensor) -> float:
        return train_step(model, opt, ids_BT1, spec, spec.lr)[0]

    return step


def hf_step(recipe: Recipe, model: TinyMoELM, experts: str | None, bf16: bool) -> Step:
    spec = recipe.train
    hf = to_hf(model, bos_id=0, eos_id=0, aux_coef=spec.aux_coef)
    if experts is not None:
        hf.set_experts_implementation(experts)
    hf.train()
    decay = [p for p in hf.parameters() if p.dim() >= 2]
    keep = [p for p in hf.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.weight_decay}, {"params": keep}],
        lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True,
    )

    def step(ids_BT1: torch.Tensor) -> float:
        inputs_BT = ids_BT1[:, :-1]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = hf(input_ids=inputs_BT, labels=inputs_BT, output_router_logits=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), spec.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(out.loss.detach())

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (max)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="stop adding timed rounds after this long (at least 3 rounds)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/zoo_build.json")
    args = parser.parse_args()

    recipe = parse_recipe({})
    threads = args.threads or recipe.train.threads
    torch.set_num_threads(threads)
    cfg = recipe.model.model_config(VOCAB)
    b, t = recipe.train.batch, recipe.train.seq_len

    def fresh() -> TinyMoELM:
        model = TinyMoELM(cfg)
        model.init_weights(torch.Generator().manual_seed(recipe.seed))
        return model

    contenders: dict[str, Step] = {
        "ours": ours_step(recipe, fresh(), recipe.train.precision),
        "ours-fp32": ours_step(recipe, fresh(), "fp32"),
        "hf": hf_step(recipe, fresh(), None, bf16=False),
        "hf-eager-experts": hf_step(recipe, fresh(), "eager", bf16=False),
        "hf-bf16": hf_step(recipe, fresh(), None, bf16=True),
    }
    gen = torch.Generator().manual_seed(0)
    wall: dict[str, list[float]] = {name: [] for name in contenders}
    cpu: dict[str, list[float]] = {name: [] for name in contenders}
    first_loss: dict[str, float] = {}
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    rounds = 0
    for r in range(args.warmup + args.rounds):
        timed = r >= args.warmup
        if timed and rounds >= 3 and time.perf_counter() - t_start > args.budget_s:
            break
        ids_BT1 = torch.randint(0, VOCAB, (b, t + 1), generator=gen)
        for name, step in contenders.items():
            w0, c0 = time.perf_counter(), time.process_time()
            loss = step(ids_BT1)
            if timed:
                wall[name].append(time.perf_counter() - w0)
                cpu[name].append(time.process_time() - c0)
            first_loss.setdefault(name, loss)
        rounds += int(timed)

    tokens = b * t
    results = {}
    for name in contenders:
        med_wall, med_cpu = statistics.median(wall[name]), statistics.median(cpu[name])
        results[name] = {
            "median_step_wall_s": round(med_wall, 4),
            "median_step_cpu_s": round(med_cpu, 4),
            "tokens_per_s_wall": round(tokens / med_wall, 1),
            "tokens_per_s_cpu": round(tokens / med_cpu, 1),
            "step_wall_s": [round(x, 4) for x in wall[name]],
            "first_step_loss": round(first_loss[name], 4),
        }
    # speedup = median step time of the other / median step time of ours
    speedup = {
        f"ours_vs_{name}": {
            kind: round(results[name][key] / results["ours"][key], 2)
            for kind, key in (("wall", "median_step_wall_s"), ("cpu", "median_step_cpu_s"))
        }
        for name in contenders
        if name != "ours"
    }
    import transformers

    report = {
        "claim": "tiny-moe-lm trainer vs plain HF MixtralForCausalLM training, same config",
        "command": "python benchmarks/zoo_build.py",
        "config": {"model": recipe_dict(recipe)["model"], "vocab_size": VOCAB, "batch": b,
                   "seq_len": t, "tokens_per_step": tokens},
        "threads": threads,
        "timed_rounds": rounds,
        "warmup_rounds": args.warmup,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "runtime_s": round(time.perf_counter() - t_start, 1),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "cpu": platform.processor() or platform.machine(),
        "results": results,
        "speedup_median": speedup,
    }
    write_json_atomic(args.out, report)
    for name, res in results.items():
        print(f"{name:18s} {res['tokens_per_s_wall']:9.0f} tok/s wall  "
              f"{res['tokens_per_s_cpu']:9.0f} tok/s cpu")
    print(json.dumps(speedup, indent=1))


if __name__ == "__main__":
    main()
