"""``moefleet autoscale train|eval``: the sMoE autoscaler, trained and compared in the
simulator.

    moefleet autoscale train --out smoe.safetensors --episodes 60 --time-budget 1500
    moefleet autoscale eval --checkpoint smoe.safetensors --pattern bursty --windows 2
    moefleet autoscale convert-checkpoint old.pt smoe.safetensors

Checkpoints are safetensors files with JSON metadata (the extension is free); nothing in
one is executed when it is read (README, trust model).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

import typer

from moefleet.cli.common import (
    check_outputs,
    emit_json,
    err_console,
    is_stdout,
    out_console,
    progress,
    user_errors,
)
from moefleet.errors import MoefleetError

app = typer.Typer(help="Train and evaluate the sMoE autoscaler in the simulator.",
                  no_args_is_help=True)

VARIANTS = ("full", "no-cc", "no-dagnn", "no-pointer", "ddpg-only")


class _Progress:
    """A rich bar on a terminal, else one plain line per step on stderr."""

    def __init__(self, title: str, total: int) -> None:
        self.tty = err_console.is_terminal
        self.title, self.total = title, total
        if self.tty:
            self.bar = progress(transient=False)
            self.bar.start()
            self.task = self.bar.add_task(title, total=total)

    def step(self, done: int, text: str) -> None:
        if self.tty:
            self.bar.update(self.task, completed=done, description=f"{self.title} {text}")
        else:
            err_console.print(f"{self.title} {done}/{self.total} {text}", highlight=False,
                              soft_wrap=True)

    def close(self) -> None:
        if self.tty:
            self.bar.stop()


def parse_gpu_shares(text: str) -> tuple[float, ...]:
    """``--gpu-shares 0,0.25,0.5,1`` -> the space's GPU-share options ("" = CPU only)."""
    if not text.strip():
        return (0.0,)
    try:
        shares = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise MoefleetError(f"--gpu-shares {text!r} is not a comma list of numbers",
                            "e.g. --gpu-shares 0,0.25,0.5,1") from None
    if list(shares) != sorted(set(shares)) or not all(0.0 <= x <= 1.0 for x in shares):
        raise MoefleetError(f"--gpu-shares {text!r} must be increasing fractions of one GPU "
                            "in [0, 1]", "e.g. --gpu-shares 0,0.25,0.5,1")
    return shares


def variant_parts(variant: str, gpu_shares: tuple[float, ...] = (0.0,)) -> tuple[Any, Any]:
    """(ActorSpec, ConfigSpace) of an ablation variant (with these GPU-share options)."""
    from moefleet.autoscale.smoe import ActorSpec, ConfigSpace

    space = ConfigSpace(gpu_share=gpu_shares)
    specs = {"full": ActorSpec(), "no-cc": ActorSpec(), "no-dagnn": ActorSpec(dagnn=False),
             "no-pointer": ActorSpec(pointer=False), "ddpg-only": ActorSpec(flat=True)}
    if variant not in specs:
        raise MoefleetError(f"unknown sMoE variant {variant!r}",
                            f"use one of: {', '.join(VARIANTS)}")
    return specs[variant], space.without_concurrency() if variant == "no-cc" else space


@app.command("train")
def train_cmd(
    out: Annotated[Path, typer.Option("--out", "-o", help="Checkpoint to write.")],
    episodes: Annotated[int, typer.Option(help="Episodes in total (one window each).")] = 60,
    variant: Annotated[str, typer.Option(help="full|no-cc|no-dagnn|no-pointer|ddpg-only.")] = (
        "full"),
    time_budget: Annotated[float | None, typer.Option(
        help="Stop after this many seconds (the checkpoint is saved every episode).")] = None,
    resume: Annotated[bool, typer.Option(help="Continue the checkpoint at --out.")] = False,
    slo: Annotated[float | None, typer.Option(
        help="End-to-end P95 SLO (s); default: uniform 0.3, skewed 1.5 x unloaded.")] = None,
    interval: Annotated[float, typer.Option(help="Control interval (s).")] = 10.0,
    scenario: Annotated[str, typer.Option(
        help="uniform (uniform routing) or skewed (a zoo model's routing trace).")] = "uniform",
    routing_trace: Annotated[str, typer.Option(
        help="Parquet routing trace of the skewed scenario.")] = (
        "out/smoe/tiny-moe-lm-sharegpt.parquet"),
    model: Annotated[str, typer.Option(help="synthetic: model of the scenario.")] = (
        "synthetic:blocks=4,experts=8,top_k=2,hidden=512,decoder=0"),
    gpu_shares: Annotated[str, typer.Option(
        help="GPU-share options of the config space, e.g. 0,0.25,0.5,1 (emulated GPU; "
             "default: CPU only).")] = "",
    platform: Annotated[str | None, typer.Option(
        help="Platform (default openfaas-k8s; openfaas-k8s-gpu with --gpu-shares).")] = None,
    window_minutes: Annotated[int, typer.Option(help="Minutes per training window.")] = 10,
    mean_rps: Annotated[float, typer.Option(help="Windows rescaled to this mean rate.")] = 3.0,
    seed: Annotated[int, typer.Option(help="Seed (windows, networks, exploration).")] = 0,
    threads: Annotated[int, typer.Option(help="torch CPU threads.")] = 1,
    stay_prior: Annotated[float | None, typer.Option(
        help="Initial score bonus of each function's current config (0 = none); "
             "default 3 without --teacher, 0 with it (the clone is the safe start).")] = None,
    teacher: Annotated[bool, typer.Option(
        help="Warm start: clone the popularity-aware rule before DDPG (see README).")] = True,
    imitation_floor: Annotated[float | None, typer.Option(
        help="Lowest weight of the imitation term once it has faded (0 = fades out "
             "entirely); default 1 with --teacher (measured, see README), 0 without; "
             "recorded in the checkpoint.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON result on stdout.")] = False,
) -> None:
    """Train sMoE offline in the simulator on Azure Functions 2019 windows (slow,
    normal, bursty by inter-arrival CV), saving a checkpoint after every episode.

    Example: moefleet autoscale train --out smoe.safetensors --episodes 60 --time-budget 1500
    """
    with user_errors():
        check_outputs(("--out", out))
        import torch

        from moefleet.autoscale.smoe import DDPGConfig
        from moefleet.autoscale.smoe.train import TEACHER_IMITATION_FLOOR, scenario_setup, train

        if threads < 1:
            raise MoefleetError(f"--threads must be >= 1, got {threads}")
        if time_budget is not None and not 0 < time_budget < float("inf"):
            # "not 0 < x" also refuses NaN, which every comparison would let through.
            raise MoefleetError(f"--time-budget must be a finite number of seconds > 0, "
                                f"got {time_budget:g}", "e.g. --time-budget 1500")
        if not 1 <= window_minutes <= 60 or not 0 < mean_rps <= 1000:
            raise MoefleetError(f"--window-minutes {window_minutes} must be in 1..60 and "
                                f"--mean-rps {mean_rps:g} in (0, 1000]")
        torch.set_num_threads(threads)
        if stay_prior is None:
            stay_prior = 0.0 if teacher else 3.0
        if not (0 <= stay_prior <= 100):
            raise MoefleetError(f"--stay-prior must be in [0, 100], got {stay_prior:g}")
        if imitation_floor is None:
            imitation_floor = TEACHER_IMITATION_FLOOR if teacher else 0.0
        if not 0 <= imitation_floor <= 10:
            raise MoefleetError(f"--imitation-floor must be in [0, 10], got {imitation_floor:g}",
                                "e.g. --imitation-floor 1")
        ddpg = DDPGConfig(bc_floor=imitation_floor)
        spec, space = variant_parts(variant, parse_gpu_shares(gpu_shares))
        spec = dataclasses.replace(spec, stay_prior=stay_prior)
        if slo is not None and not slo > 0:
            raise MoefleetError(f"--slo must be > 0 s, got {slo:g}")
        plat = platform or ("openfaas-k8s-gpu" if space.has_gpu else "openfaas-k8s")
        setup = scenario_setup(scenario, routing_trace=routing_trace, slo_s=slo, model=model,
                               interval_s=interval, window_minutes=window_minutes,
                               mean_rps=mean_rps, platform=plat)
        bar = _Progress(f"training sMoE ({variant})", episodes)
        try:
            res = train(out, episodes=episodes, setup=setup, space=space, spec=spec,
                        ddpg=ddpg, seed=seed, resume=resume, time_budget_s=time_budget,
                        teacher=teacher,
                        progress=lambda d, n, row: bar.step(
                            d, f"{row['pattern']} cost ${row['cost_usd']:.4f} "
                               f"P95 {row['p95_s']:.3g}s reward {row['reward']:.1f}"))
        finally:
            bar.close()
        summary = {"checkpoint": str(out), "episodes": res["episodes"],
                   "wall_s": res["wall_s"], "variant": variant}
        if as_json:
            emit_json(summary)
        else:
            out_console(False).print(f"saved {out} after {res['episodes']} episodes "
                                     f"({res['wall_s']:.0f} s)", highlight=False)


def _gpu_share_text(by_share: dict[str, float]) -> str:
    """Share of pod-seconds on each GPU share > 0, e.g. ``0.25: 93%`` (``-`` = none)."""
    total = sum(by_share.values())
    on = {k: v for k, v in by_share.items() if float(k) > 0 and v > 0}
    if not total or not on:
        return "-"
    return ", ".join(f"{k}: {100 * v / total:.0f}%" for k, v in sorted(on.items()))


@app.command("eval")
def eval_cmd(
    checkpoint: Annotated[list[Path], typer.Option(
        "--checkpoint", "-c", help="sMoE checkpoint(s) to compare (repeatable).")],
    baselines: Annotated[str, typer.Option(
        help="Comma list of static,static-pop,hpa,elasticmoe,faasconf.")] = (
        "static,static-pop,hpa,elasticmoe,faasconf"),
    pattern: Annotated[list[str] | None, typer.Option(
        help="slow|normal|bursty (repeatable; default all three).")] = None,
    windows: Annotated[int, typer.Option(help="Held-out windows per pattern.")] = 2,
    seed: Annotated[int, typer.Option(help="Seed (arrivals).")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="JSON result on stdout.")] = False,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Write JSON here (- for stdout).")] = None,
) -> None:
    """Compare sMoE checkpoints with the baselines on held-out windows.

    Example: moefleet autoscale eval -c smoe.safetensors --pattern bursty --windows 2
    """
    with user_errors():
        check_outputs(("--out", out), stdout=("--out",), json_mode=as_json)
        import torch

        from moefleet.autoscale.smoe.evaluate import BASELINES, baseline, evaluate, smoe_factory
        from moefleet.io import write_json_atomic

        torch.set_num_threads(1)
        pats = pattern or ["slow", "normal", "bursty"]
        for p in pats:
            if p not in ("slow", "normal", "bursty"):
                raise MoefleetError(f"unknown pattern {p!r}", "use slow, normal or bursty")
        if not 1 <= windows <= 20:
            raise MoefleetError(f"--windows must be in 1..20, got {windows}")
        ctls: dict[str, Any] = {}
        sc = setup = space = None
        for ck in checkpoint:
            sc_i, setup_i, make, space_i = smoe_factory(ck)
            space = space or space_i
            if setup is not None and setup_i != setup:
                raise MoefleetError(f"checkpoint {ck} was trained for another scenario than "
                                    f"{checkpoint[0]}", "compare checkpoints of one setup")
            sc, setup = sc_i, setup_i
            ctls[ck.stem] = make
        assert sc is not None and setup is not None and space is not None
        for b in filter(None, (s.strip() for s in baselines.split(","))):
            if b not in BASELINES:
                raise MoefleetError(f"unknown baseline {b!r}", f"use {', '.join(BASELINES)}")
            ctls[b] = (lambda b=b: baseline(b, sc, space, setup))
        total = len(pats) * len(ctls) * windows
        bar = _Progress("evaluating", total)
        done = [0]

        def step(text: str) -> None:
            done[0] += 1
            bar.step(done[0], text)

        try:
            res = evaluate(ctls, sc, setup, pats, windows, seed, progress=step)
        finally:
            bar.close()
        res = {"slo_s": sc.slo_s, "interval_s": sc.interval_s, "model": sc.model,
               "platform": sc.spec.name, "results": res}
        if space.has_gpu:  # every figure then depends on the GPU time model
            res["gpu"] = ("emulated: simulator GPU slices on a datasheet roofline "
                          "(moefleet.profiles.gpu), priced at the platform's GPU rate x share")
        if is_stdout(out):
            emit_json(res)
        elif out is not None:
            write_json_atomic(out, res)
        if as_json:
            emit_json(res)
            return
        from moefleet.report.tables import Col, fit_table, sig3

        for p, rows in res["results"].items():
            gpu = " (GPU emulated)" if space.has_gpu else ""
            cols = [Col("controller", numeric=False), Col("cost (USD)"), Col("P95 / SLO"),
                    Col("intervals in SLO (%)", drop=2), Col("decision (ms)", drop=1)]
            if space.has_gpu:
                cols.append(Col("pod-s on GPU (seg / exp)", numeric=False, drop=3))
            table_rows = []
            for name, r in rows.items():
                cells = [name, sig3(r["cost_usd"]), sig3(r["p95_over_slo"]),
                         sig3(100 * r["intervals_within_slo"]),
                         sig3(1e3 * r["decision_latency_s"])]
                if space.has_gpu:
                    cells.append(" / ".join(_gpu_share_text(r["pod_s_by_gpu_share"].get(k, {}))
                                            for k in ("segment", "expert")))
                table_rows.append(cells)
            out_console(is_stdout(out)).print(
                fit_table(f"{p}: cost and P95 (SLO {sc.slo_s:g} s){gpu}", cols, table_rows))


@app.command("convert-checkpoint")
def convert_cmd(
    old: Annotated[Path, typer.Argument(help="Format-1 checkpoint (a torch pickle, .pt).")],
    new: Annotated[Path, typer.Argument(help="Format-2 checkpoint to write (.safetensors).")],
    json_out: Annotated[bool, typer.Option("--json", help="print JSON on stdout")] = False,
) -> None:
    """Convert an sMoE checkpoint of format 1 (a torch pickle) to format 2 (safetensors
    + JSON). The old file is read with torch's weights_only loader: a file holding
    anything but tensors and plain data is refused, nothing in it runs.

    Example: moefleet autoscale convert-checkpoint smoe.pt smoe.safetensors
    """
    with user_errors():
        check_outputs(("NEW", new))
        from moefleet.autoscale.smoe.convert import convert_checkpoint

        path = convert_checkpoint(old, new)
    if json_out:
        emit_json({"input": str(old), "output": str(path), "format": 2})
        return
    out_console(False).print(f"wrote {path} (sMoE checkpoint format 2)", highlight=False)
