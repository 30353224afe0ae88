"""``moefleet demo``: the main job on the embedded default (what ``make demo`` runs).

Build the default model (cached) -> compute profile (cached) -> routing traces ->
Bayesian predictor -> BO + ODS -> plans for a held-out workload -> each plan deployed on
the local backend and the workload run through it -> a report (table, JSON, PNG)
comparing the BO plan, the oracle plan, unadjusted predictions, LambdaML and a CPU
cluster. See :mod:`moefleet.demo.pipeline` for what each stage measures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from moefleet import limits as L
from moefleet.cli.common import emit_json, out_console, progress, user_errors
from moefleet.errors import MoefleetError
from moefleet.io import check_output_dir


def _check_inputs_early(platform: str, traffic: str | None) -> None:
    """Fail on a bad --platform or --traffic before minutes of profiling and planning."""
    from moefleet.data import load_prompts, split_dataset
    from moefleet.platform import load_platform

    load_platform(platform)
    if traffic is not None:
        name, split = split_dataset(traffic)
        load_prompts(name, split=split, limit=1)


def demo_cmd(
    model: Annotated[str, typer.Option("--model", "-m", help="Zoo model.")] = "minilm-moe-e8",
    quick: Annotated[bool, typer.Option(help="Small batches and few BO iterations (~1 min "
                                        "once the model and profile are cached).")] = False,
    platform: Annotated[str, typer.Option(help="Serverless platform.")] = "aws-lambda-2020",
    slo: Annotated[float | None, typer.Option(
        help="End-to-end latency limit, s (default: LambdaML's latency / (1 - 0.1876)).")
    ] = None,
    sampler: Annotated[str, typer.Option(
        help="BO sampler: eps-gp | eps | single-eps | random | tpe.")] = "eps-gp",
    iterations: Annotated[int | None, typer.Option(
        min=1, max=L.MAX_ITERATIONS, help="BO iterations at most.")] = None,
    traffic: Annotated[str | None, typer.Option(
        help="Dataset for the BO batches and the workload (a domain shift from the "
        "predictor's wikitext2), e.g. c4. Default: wikitext2.")] = None,
    warm_instances: Annotated[bool, typer.Option(
        help="Plan for steady-state serving: warm instances keep their parameters "
        "(default: the paper's model, a parameter fetch per batch).")] = False,
    run: Annotated[bool, typer.Option(
        help="Deploy each plan on the local backend and run the workload.")] = True,
    workers: Annotated[int | None, typer.Option(
        min=1, max=L.MAX_WORKERS, help="Local worker processes.")] = None,
    out_dir: Annotated[Path, typer.Option("--out", "-o", help="Where results go.")] = Path(
        "out/demo"),
    compare: Annotated[bool, typer.Option(
        help="End with `moefleet compare --quick` of the model on the platform and a GPU "
        "platform (out/demo/compare, report.html).")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Plan, deploy and bill the default MoE model end to end; compare with baselines.

    Example: moefleet demo --quick
    """
    from moefleet.demo.pipeline import DemoConfig, run_demo
    from moefleet.io import write_json_atomic
    from moefleet.plan.bo_samplers import SAMPLERS
    from moefleet.report.demo import demo_png, demo_table

    con = out_console(as_json)
    with user_errors():
        check_output_dir(out_dir, "--out")
        if sampler not in SAMPLERS:
            raise MoefleetError(f"--sampler {sampler!r} is not known",
                                f"choose one of {', '.join(SAMPLERS)}")
        if slo is not None and not slo > 0:
            raise MoefleetError(f"--slo must be > 0 seconds, got {slo}", "e.g. --slo 30")
        if iterations is not None and iterations < 1:
            raise MoefleetError(f"--iterations must be >= 1, got {iterations}", "e.g. 20")
        _check_inputs_early(platform, traffic)
        opts = {"model": model, "platform": platform, "slo_s": slo, "sampler": sampler,
                "run": run, "workers": workers, "traffic": traffic,
                "warm_instances": warm_instances}
        if iterations is not None:
            opts["bo_iters"] = iterations
        cfg = DemoConfig.quick(**opts) if quick else DemoConfig(**opts)  # type: ignore[arg-type]
        con.print(f"[bold]moefleet demo[/]: {model} on {platform}, workload "
                  f"{cfg.workload_tokens:,} tokens of {traffic or 'wikitext2:test'}")
        from moefleet.cli.models import load_with_progress

        load_with_progress(model, as_json)  # builds the zoo model once, with a progress bar
        with progress() as bar:
            tasks: dict[str, Any] = {}

            def on_progress(label: str, done: int, total: int) -> None:
                if label not in tasks:
                    tasks[label] = bar.add_task(label, total=total)
                bar.update(tasks[label], completed=done, total=total)

            report = run_demo(cfg, out_dir, say=lambda msg: con.print(f"· {msg}"),
                              progress=on_progress)
        json_path = out_dir / "report.json"
        write_json_atomic(json_path, report)
        png = demo_png(report, out_dir / "report.png")
    if as_json:
        emit_json({**report, "report_json": str(json_path), "png": str(png)})
        return
    con.print(demo_table(report))
    bo = report["bo"]
    con.print(f"BO: {bo['iterations']} iterations ({'converged' if bo['converged'] else 'cap'}"
              f"), {bo['wall_s']:.1f} s, evaluator {bo['evaluator']}; report {json_path}, "
              f"chart {png}; total {report['wall_s']:.0f} s")
    if compare:
        _compare_step(model, platform, out_dir / "compare", con)


def _compare_step(model: str, platform: str, out: Path, con: Any) -> None:
    """The demo's last step: every policy on the demo's model (quick), the demo's
    platform and a GPU platform, Azure LLM conversation traffic; the table, the
    recommendation and a self-contained report."""
    from moefleet.cli.compare import table
    from moefleet.compare.html import write_report
    from moefleet.compare.output import write_outputs
    from moefleet.compare.run import run_compare

    con.print("[bold]compare[/]: every policy on the same traffic (quick)")
    with user_errors():
        res = run_compare(model=model, traffic="azure-llm:conv",
                          platforms=[platform, "alibaba-fc-gpu"], slo_ttft_s=10.0,
                          slo_tpot_s=0.2, duration_s=300, quick=True,
                          say=lambda m: con.print(f"· compare: {m}"),
                          command=f"moefleet compare --model {model} --traffic "
                          f"azure-llm:conv --platform {platform},alibaba-fc-gpu "
                          "--slo-ttft 10 --slo-tpot 0.2 --duration 300 --quick")
        data = res.to_dict()
        write_outputs(data, out)
        page = write_report(out)
    con.print(table(data))
    con.print(f"[bold]recommendation:[/] {data['recommendation']}")
    con.print(f"compare: {len(data['rows'])} rows in {data['wall_s']:.0f} s; report {page}")
