"""``moefleet plan bo``: ODS/BO Alg. 2 on your own predictor and routing traces.

    moefleet predict fit --model M --train wikitext2:train -o predictor.npz
    moefleet profile --model M --dataset c4 --max-tokens 20480 -o bo.parquet
    moefleet plan bo --predictor predictor.npz --bo-trace bo.parquet --model M \\
        --platform aws-lambda-2020 --slo 10 -o plan.yaml --save-predictor adjusted.npz

The BO batches are whole requests of ``--bo-trace`` packed into ``--batch-tokens``; the
plan written is the best trial's ODS plan for them (before the replication rules, which
repair a deployment at run time); ``--save-predictor`` keeps the table edits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from moefleet import limits as L
from moefleet.cli.common import (
    check_outputs,
    emit_json,
    is_stdout,
    out_console,
    progress,
    user_errors,
    write_data,
)
from moefleet.errors import DataError, MoefleetError


def bo_cmd(
    predictor: Annotated[Path, typer.Option(help="Bayesian predictor (.npz, predict fit).")],
    bo_trace: Annotated[Path, typer.Option(help="Routing trace (.parquet) of the BO batches.")],
    slo: Annotated[float, typer.Option(help="End-to-end latency limit, seconds.")],
    model: Annotated[str | None, typer.Option("--model", "-m", help="Model (for its cached "
                                              "compute profile).")] = None,
    profile: Annotated[Path | None, typer.Option(help="Compute profile JSON.")] = None,
    platform: Annotated[str, typer.Option(help="Platform name or YAML.")] = "aws-lambda-2020",
    batch_tokens: Annotated[int, typer.Option(
        min=1, max=L.MAX_BATCH_TOKENS, help="Tokens per BO batch.")] = 10_240,
    batches: Annotated[int | None, typer.Option(
        min=1, max=L.MAX_ITERATIONS, help="Use at most this many batches.")] = None,
    pairs: Annotated[int, typer.Option(
        min=1, max=L.MAX_PAIRS, help="Q: key-value pairs per trial.")] = 1000,
    iterations: Annotated[int, typer.Option(
        min=1, max=L.MAX_ITERATIONS, help="BO iterations at most.")] = 40,
    sampler: Annotated[str, typer.Option(
        help="eps-gp | eps | single-eps | random | tpe.")] = "eps-gp",
    seed: Annotated[int, typer.Option(min=0, max=L.MAX_SEED, help="Sampler seed.")] = 0,
    out: Annotated[Path, typer.Option(
        "--out", "-o", help="Plan YAML to write (- for stdout).")] = Path("plan.yaml"),
    save_predictor: Annotated[Path | None, typer.Option(
        help="Write the predictor with the best table edits (.npz).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable summary.")] = False,
) -> None:
    """Adjust a Bayesian predictor's table by Bayesian optimisation on billed cost
    (analytical evaluator, ODS planner) and write the best plan.

    Example: moefleet plan bo --predictor predictor.npz --bo-trace bo.parquet
    --model minilm-moe-e8 --slo 10 -o plan.yaml
    """
    with user_errors():
        check_outputs(("--out", out), ("--save-predictor", save_predictor), stdout=("--out",),
                      json_mode=as_json)
        summary, plan = _run(predictor, bo_trace, slo, model, profile, platform,
                             batch_tokens, batches, pairs, iterations, sampler, seed, out,
                             save_predictor, as_json)
    if as_json:
        emit_json(summary)
        return
    con = out_console(is_stdout(out))
    from moefleet.cli.plan import plan_table

    con.print(plan_table(plan))
    wrote = [str(p) for p in (None if is_stdout(out) else out, save_predictor) if p]
    con.print(f"BO ({summary['sampler']}, evaluator {summary['evaluator']}): "
              f"{summary['iterations']} iterations in {summary['wall_s']:.1f} s, objective "
              f"{summary['baseline_cost_usd']:.4g} -> {summary['best_cost_usd']:.4g} USD"
              + (f"; wrote {' and '.join(wrote)}" if wrote else ""))


def _run(predictor_path: Path, trace_path: Path, slo: float, model: str | None,
         profile: Path | None, platform: str, batch_tokens: int, batches: int | None,
         pairs: int, iterations: int, sampler: str, seed: int, out: Path,
         save_predictor: Path | None, json_mode: bool) -> tuple[dict[str, Any], Any]:
    import numpy as np

    from moefleet.cli.plan import load_profile
    from moefleet.plan import PlanningProblem
    from moefleet.plan.bo import BayesOpt, BOConfig
    from moefleet.plan.bo_eval import batches_from_trace
    from moefleet.platform import load_platform
    from moefleet.predict.base import load_predictor
    from moefleet.predict.bayes import BayesPredictor
    from moefleet.traces.schema import read_trace

    if not slo > 0:
        raise MoefleetError(f"--slo must be > 0 seconds, got {slo}", "e.g. --slo 10")
    cfg = BOConfig(pairs=pairs, max_iters=iterations, sampler=sampler, seed=seed)
    pred = load_predictor(predictor_path)
    if not isinstance(pred, BayesPredictor):
        raise DataError(f"{predictor_path} holds a '{pred.kind}' predictor; BO edits the "
                        "Bayesian predictor's count table",
                        "fit one with: moefleet predict fit --predictor bayes")
    trace = read_trace(trace_path)
    pred.check_trace(trace)
    assert pred.shape is not None
    bo_batches = batches_from_trace(trace, pred.shape, batch_tokens, batches)
    prof = load_profile(profile, model or pred.model or None)
    spec = load_platform(platform)
    tokens = int(np.mean([b.tokens for b in bo_batches]))
    template = PlanningProblem.from_profile(
        prof, spec, bo_batches[0].real_LE, slo, num_experts=pred.shape.num_experts,
        tokens=tokens, top_k=pred.shape.top_k, model=model or pred.model or prof.model)
    with progress() as bar:
        task = bar.add_task("BO iterations", total=cfg.max_iters)
        res = BayesOpt(pred, template, bo_batches, cfg).run(
            progress=lambda it, total, best: bar.update(
                task, completed=it, description=f"BO (best {best:.3g} USD)"))
    if res.best.plan is None:
        raise MoefleetError("no trial produced a feasible plan for the predicted counts",
                            "raise --slo (moefleet plan --policy ods shows the fastest plan)")
    write_data(out, res.best.plan.to_yaml())
    if save_predictor is not None:
        with res.applied() as adjusted:
            adjusted.save(save_predictor)
    return {**res.summary(), "plan": str(out), "batches": len(bo_batches),
            "batch_tokens": [b.tokens for b in bo_batches],
            "predictor": str(save_predictor) if save_predictor else None,
            "history": res.history}, res.best.plan
