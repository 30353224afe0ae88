"""``moefleet simulate``: discrete-event simulation of a plan under a workload.

    moefleet simulate --plan plan.yaml --workload "bursty:rate=5,cv=3" --duration 600
    moefleet simulate --model synthetic:blocks=12,experts=8,top_k=2 --memory 3008 \\
        --workload azure-llm:trace=conv --duration 3600 --policy static --json -o r.json
    moefleet simulate --model minilm-moe-e8 --memory 2048 --workload arrivals.csv \\
        --policy hpa --png timeline.png

Where the inputs come from: the compute profile is ``--profile``, else the synthetic
model's estimate, else the model's cached measured profile (measured once if missing);
routing is ``--trace`` (per-token rows or its distribution), else uniform over the
plan's experts with ``--top-k``; a ``--workload`` ending in ``.csv`` is read as an
arrivals file (columns t_s, request_id[, prompt_tokens, output_tokens]).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from moefleet import limits as L
from moefleet import metric_names as N
from moefleet.cli.common import (
    check_outputs,
    emit_json,
    is_stdout,
    out_console,
    progress,
    user_errors,
)
from moefleet.errors import MoefleetError

DEFAULT_PLATFORM = "aws-lambda"


def _profile_and_shape(model: str, profile_path: Path | None,
                       json_mode: bool) -> tuple[Any, dict[str, Any]]:
    """(ComputeProfile, facts) where facts may hold experts, top_k, decoder."""
    from moefleet.profiles import ComputeProfile

    facts: dict[str, Any] = {}
    if model.startswith("synthetic:"):
        from moefleet.sim.synthetic import parse_synthetic

        syn = parse_synthetic(model)
        facts = {"experts": syn.experts, "top_k": syn.top_k, "decoder": syn.decoder}
        if profile_path is None:
            return syn.profile(), facts
    if profile_path is not None:
        return ComputeProfile.load(profile_path), facts
    from moefleet.profiles.cache import profile_for

    out_console(json_mode).print(f"[dim]compute profile of {model}: cached, or measured "
                                 "now (~10 s)[/]")
    return profile_for(model), facts


def _model_facts(model: str, json_mode: bool) -> dict[str, Any]:
    """Experts per layer, top-k and causality of a real model (loads it)."""
    from moefleet.cli.models import load_with_progress

    summary = load_with_progress(model, json_mode).summary()
    return {"num_experts": summary.num_experts, "top_k": summary.top_k,
            "decoder": summary.causal}


def _arrivals(workload: str, duration: float, seed: int) -> tuple[Any, dict[str, Any]]:
    if workload.endswith(".csv"):
        from moefleet.workloads import read_arrivals_csv

        rows = read_arrivals_csv(workload)
        return [a for a in rows if a.t_s < duration], {"kind": "csv", "path": workload}
    from moefleet.workloads import load_workload

    wl = load_workload(workload)
    wl.check_budget(duration)
    return wl.arrivals(duration, seed), wl.describe()


def check_sim_budget(arrivals: list[Any], kw: dict[str, Any], decoder: bool) -> None:
    """Refuse a simulation whose request x token steps exceed MAX_SIM_TOKEN_STEPS."""
    from moefleet.errors import check_limit

    check_limit("simulated requests", len(arrivals), L.MAX_ARRIVALS)
    steps = 0
    for a in arrivals:
        prompt = a.prompt_tokens if a.prompt_tokens is not None else kw["prompt_tokens"]
        out = a.output_tokens if a.output_tokens is not None else kw["output_tokens"]
        steps += 1 + (out if decoder else 0)
        if prompt > L.MAX_PROMPT_TOKENS:
            check_limit("prompt tokens of one request", prompt, L.MAX_PROMPT_TOKENS)
    check_limit("simulated requests x decode steps", steps, L.MAX_SIM_TOKEN_STEPS)


def _check_consistent(plan: Any, profile: Any, router: Any, profile_path: Path | None,
                      trace_path: Path | None) -> None:
    """Plan, profile and routing trace describe one model (same MoE layers and experts)."""
    if (profile_path is not None and profile.model != plan.model
            and not plan.model.startswith("synthetic:")
            and not profile.model.startswith("synthetic:")):
        raise MoefleetError(
            f"--profile was measured on '{profile.model}', the plan is for '{plan.model}'",
            "use a profile of the planned model (moefleet profile-compute)")
    if router is not None:
        plan_e = [len(lp.experts) for lp in plan.layers]
        if list(router.num_experts) != plan_e:
            raise MoefleetError(
                f"--trace {trace_path} routes to {list(router.num_experts)} experts per MoE "
                f"layer, the plan has {plan_e}", "use a trace recorded on the planned model")


def run_simulation(*, plan_path: Path | None, model: str | None, memory: int | None,
                   method: str, replicas: int, beta: int, profile_path: Path | None,
                   trace_path: Path | None, routing: str, top_k: int | None, workload: str,
                   duration: float, policy: str, platform: str | None, seed: int,
                   sim_kw: dict[str, Any], decoder: bool | None,
                   json_mode: bool) -> tuple[Any, dict[str, Any]]:
    slo = sim_kw.get("slo_s")
    from moefleet.autoscale import make_policy
    from moefleet.plan import DeploymentPlan
    from moefleet.platform import load_platform
    from moefleet.sim import DistributionRouter, SimConfig, Simulator, router_from_trace

    if duration < 0:
        raise MoefleetError(f"--duration must be >= 0 seconds, got {duration:g}",
                            "pass e.g. --duration 600")
    if method not in ("direct", "storage", "pipelined"):
        raise MoefleetError(f"--method {method!r} is not known",
                            "choose one of direct, storage, pipelined")
    if slo is not None and not slo > 0:
        raise MoefleetError(f"--slo must be > 0 seconds, got {slo:g}", "e.g. --slo 2")
    if (plan_path is None) == (model is None):
        raise MoefleetError("give either --plan or --model (with --memory)",
                            "e.g. --model synthetic:blocks=12,experts=8 --memory 2048")
    plan = DeploymentPlan.load(plan_path) if plan_path is not None else None
    if plan is not None and plan.main is not None:  # before any profile is measured
        from moefleet.sim.simulator import check_not_remoe

        check_not_remoe(plan)
    model_name = plan.model if plan is not None else str(model)
    spec = load_platform(platform if platform is not None  # '' is a bad name, not a default
                         else (plan.platform if plan is not None else DEFAULT_PLATFORM))
    profile, facts = _profile_and_shape(model_name, profile_path, json_mode)
    router = None
    if trace_path is not None:
        from moefleet.traces.schema import read_trace

        router = router_from_trace(read_trace(trace_path), routing)  # type: ignore[arg-type]
    if plan is None:
        if memory is None:
            raise MoefleetError("--model needs --memory (MB per function)",
                                f"e.g. --memory {spec.baseline_memory()}")
        if router is not None:
            experts = list(router.num_experts)
        elif "experts" in facts:
            experts = [facts["experts"]] * len(profile.moe_layers)
        else:
            facts.update(_model_facts(model_name, json_mode))
            experts = list(facts["num_experts"])
        plan = DeploymentPlan.uniform(model_name, spec.name, list(profile.moe_layers), experts,
                                      len(profile.segments), memory, method,  # type: ignore[arg-type]
                                      replicas=replicas, beta=beta)
    _check_consistent(plan, profile, router, profile_path, trace_path)
    if router is None:
        k = top_k or facts.get("top_k") or 2
        router = DistributionRouter.uniform([len(lp.experts) for lp in plan.layers], int(k))
    if decoder is None:
        decoder = bool(facts.get("decoder", True))
    kw = dict(sim_kw)
    if kw.get("scaling") is None:
        kw["scaling"] = "on-demand" if policy == "static" else "replicas"
    cfg = SimConfig(**kw)  # SimConfig validates the strings
    sim = Simulator(plan, profile, spec, router=router, config=cfg,
                    controller=make_policy(policy), seed=seed, decoder=decoder)
    arrivals, described = _arrivals(workload, duration, seed)
    check_sim_budget(arrivals, kw, decoder)
    with progress() as bar:
        task = bar.add_task(f"simulating {len(arrivals)} requests", total=max(duration, 1e-9))

        def on_progress(done: float, total: float) -> None:
            bar.update(task, completed=done)

        result = sim.run(arrivals, duration, progress=on_progress)
    return result, described


def _table(out: dict[str, Any]) -> Table:
    """Serving figures are labelled with the server's metric names (the JSON's
    ``named_metrics`` keys), so they read against ``/metrics`` and ``bench serve``."""
    t = Table(title=f"simulated {out['model']} on {out['platform']} ({out['policy']})")
    t.add_column("metric")
    t.add_column("value", justify="right")
    m, cost = out["named_metrics"], out["cost"]

    def pcts(name: str) -> tuple[str, str]:
        s = m[name] or {}
        vals = " / ".join(f"{s[k]:.3g}" if s.get(k) is not None else "-"
                          for k in ("mean", "p50", "p95", "p99"))
        return f"{name} mean / p50 / p95 / p99", vals + " s"

    billed = m[N.BILLED_COST]
    rows = [
        (f"{N.REQUEST_SUCCESS} / arrived",
         f"{m[N.REQUEST_SUCCESS]} / {out['requests']['arrived']}"),
        ("throughput", f"{out['throughput_rps']:.3g} req/s"),
        pcts(N.E2E), pcts(N.TTFT), pcts(N.TPOT), pcts(N.QUEUE),
        (f"{N.PROMPT_TOKENS} / {N.GENERATION_TOKENS}",
         f"{m[N.PROMPT_TOKENS]} / {m[N.GENERATION_TOKENS]}"),
        ("SLO violations", f"{100 * out['slo_violation_rate']:.1f} %"),
        (f"{N.BILLED_COST} compute / requests / storage",
         " / ".join(f"${billed[p]:.4g}" for p in N.COST_PARTS)),
        ("billed cost", f"${cost['total']:.6g} (${cost['per_request']:.3g}/request)"),
        ("invocations / cold starts", f"{out['invocations']} / {out['cold_starts']}"),
        ("events/s (wall)", f"{out['performance']['events_per_s']:.3g}"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    return t


def simulate_cmd(
    plan: Annotated[Path | None, typer.Option("--plan", help="Plan YAML.")] = None,
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="Model for a uniform plan: zoo name, dir, or "
        "synthetic:blocks=12,experts=8,top_k=2,hidden=768.")] = None,
    memory: Annotated[int | None, typer.Option(
        min=1, max=10**7, help="MB per function (uniform plan).")] = None,
    method: Annotated[str, typer.Option(help="Uniform plan: direct|storage|pipelined.")] = (
        "direct"),
    replicas: Annotated[int, typer.Option(
        min=1, max=L.MAX_REPLICAS, help="Uniform plan: replicas per expert.")] = 1,
    beta: Annotated[int, typer.Option(
        min=1, max=L.MAX_BATCH_TOKENS, help="Uniform plan: pipelined minibatch.")] = 1,
    profile: Annotated[Path | None, typer.Option(help="Compute profile JSON.")] = None,
    trace: Annotated[Path | None, typer.Option(help="Routing trace .parquet.")] = None,
    routing: Annotated[str, typer.Option(help="With --trace: rows|distribution.")] = "rows",
    top_k: Annotated[int | None, typer.Option(
        min=1, max=1024, help="Uniform routing: experts per token.")] = None,
    workload: Annotated[str, typer.Option(
        "--workload", "-w", help="Spec (poisson:rate=5, bursty:rate=5,cv=3, step:..., "
        "azure-fn:..., azure-llm:trace=conv) or an arrivals .csv.")] = "poisson:rate=1",
    duration: Annotated[float, typer.Option(
        min=0.0, max=L.MAX_DURATION_S, help="Seconds of arrivals.")] = 60.0,
    policy: Annotated[str, typer.Option(help="static|hpa|elasticmoe.")] = "static",
    platform: Annotated[str | None, typer.Option(help="Platform (default: the plan's).")] = None,
    seed: Annotated[int, typer.Option(min=0, max=L.MAX_SEED, help="Seed (arrivals, routing).")] = 0,
    scaling: Annotated[str | None, typer.Option(
        help="on-demand|replicas (default: on-demand for static, replicas otherwise).")] = None,
    slo: Annotated[float | None, typer.Option(help="End-to-end latency SLO (s).")] = None,
    keep_alive: Annotated[float, typer.Option(
        min=0.0, max=L.MAX_DURATION_S, help="Idle instance lifetime (s).")] = 600.0,
    concurrency: Annotated[int, typer.Option(min=1, max=10_000, help="Calls per instance.")] = 1,
    interval: Annotated[float, typer.Option(
        min=0.001, max=L.MAX_DURATION_S, help="Metrics/policy interval (s).")] = 10.0,
    decode: Annotated[str, typer.Option(help="batched|per-request.")] = "batched",
    prompt_tokens: Annotated[int, typer.Option(
        min=1, max=L.MAX_PROMPT_TOKENS, help="When the workload has none.")] = 128,
    output_tokens: Annotated[int, typer.Option(
        min=0, max=L.MAX_PROMPT_TOKENS, help="When the workload has none.")] = 0,
    decoder: Annotated[bool | None, typer.Option(
        "--decoder/--encoder", help="Generate output tokens (default: from the model).")] = None,
    prewarm: Annotated[bool, typer.Option(help="Start with warm instances.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="JSON result on stdout.")] = False,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Write JSON here (- for stdout).")] = None,
    png: Annotated[Path | None, typer.Option(help="Write a timeline PNG here.")] = None,
) -> None:
    """Simulate serving cost, latency and SLO of a plan under a workload (no real calls).

    Example: moefleet simulate --model synthetic:blocks=12,experts=8 --memory 2048
    --workload "bursty:rate=5,cv=3" --duration 600 --policy hpa --png timeline.png
    """
    with user_errors():
        check_outputs(("--out", out), ("--png", png), stdout=("--out",), json_mode=as_json)
        sim_kw: dict[str, Any] = {
            "scaling": scaling, "slo_s": slo, "keep_alive_s": keep_alive,
            "concurrency": concurrency, "interval_s": interval, "decode": decode,
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "prewarm": prewarm}
        result, described = run_simulation(
            plan_path=plan, model=model, memory=memory, method=method, replicas=replicas,
            beta=beta, profile_path=profile, trace_path=trace, routing=routing, top_k=top_k,
            workload=workload, duration=duration, policy=policy, platform=platform, seed=seed,
            sim_kw=sim_kw, decoder=decoder, json_mode=as_json or is_stdout(out))
        data = result.to_dict()
        data["workload"] = described
        if is_stdout(out):
            emit_json(data)
        elif out is not None:
            from moefleet.io import write_json_atomic

            write_json_atomic(out, data)
        if png is not None:
            from moefleet.sim.plots import plot_timeline

            plot_timeline(result, png)
    if as_json:
        emit_json(data)
        return
    con = out_console(is_stdout(out))
    con.print(_table(data))
    for label, path in (("results", out), ("timeline", png)):
        if path is not None and not is_stdout(path):
            con.print(f"wrote {label} to {path}")
