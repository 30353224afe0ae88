"""``moefleet plan``: make a deployment plan; ``moefleet plan show``: print one."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from tokenize import TokenError  # np.load's header parser raises it on a mangled header
from typing import Annotated, Any

import typer
from rich.table import Table

from moefleet import limits as L
from moefleet.cli.common import (
    check_outputs,
    emit_json,
    is_stdout,
    out_console,
    user_errors,
    write_data,
)
from moefleet.errors import DataError, MoefleetError

app = typer.Typer(
    help="Plan a deployment (memory, replicas, scatter-gather method per MoE layer).\n\n"
    "Example: moefleet plan --model minilm-moe-e8 --policy ods --platform aws-lambda-2020 "
    "--slo 30 --counts trace.parquet --profile profile.json -o plan.yaml",
    invoke_without_command=True,
)

JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable result on stdout.")]


#: Tokens per expert in a counts array at most: bounds the planner's per-token work.
MAX_COUNT = 10**9


def load_counts(path: Path) -> tuple[Any, list[int] | None, int | None, str | None]:
    """counts_LE, experts per layer (traces only), tokens (traces only), the trace's model.

    Invariant of the returned counts: a 2-D int64 array of finite values in [0, MAX_COUNT]
    with at least one token."""
    import numpy as np

    from moefleet.io import check_input_file

    if path.suffix == ".parquet":
        from moefleet.traces.schema import read_trace

        trace = read_trace(path)
        experts = [int(e) for e in trace.meta["num_experts"]]
        return trace.popularity(), experts, trace.num_tokens, str(trace.meta.get("model"))
    if path.suffix == ".npy":
        check_input_file(path, "counts file", "pass a .npy or a trace")
        try:
            # mmap reads only the header: shape and dtype are checked before any allocation.
            mapped = np.load(path, mmap_mode="r", allow_pickle=False)
            shape, dtype = mapped.shape, mapped.dtype
        except (OSError, ValueError, EOFError, SyntaxError, TokenError) as err:
            raise DataError(f"{path} is not a readable .npy array: {err}",
                            "np.save a 2-D counts_LE array") from None
        if len(shape) != 2 or dtype.kind not in "iuf":
            raise DataError(
                f"{path} holds a {dtype} array of shape {shape}; counts need a 2-D numeric "
                "(layers, experts) array", "save counts_LE as a 2-D integer array")
        if shape[0] * shape[1] > 1 << 24 or 0 in shape:
            raise DataError(f"{path}: counts array of shape {shape} is empty or too large "
                            "(at most 16M cells)", "save counts_LE (layers, experts)")
        counts = np.array(mapped)
        if not np.all(np.isfinite(counts)):
            raise DataError(f"{path}: counts hold NaN or infinite values",
                            "counts are tokens per expert: finite, >= 0")
        if counts.min() < 0 or counts.max() > MAX_COUNT or np.any(counts != np.round(counts)):
            raise DataError(f"{path}: counts must be whole numbers in [0, {MAX_COUNT:.0e}], "
                            f"got [{counts.min():g}, {counts.max():g}]",
                            "counts are tokens per expert")
        if counts.sum() == 0:
            raise DataError(f"{path}: counts are all zero", "counts are tokens per expert")
        return counts.astype(np.int64), None, None, None
    raise DataError(
        f"--counts {path}: expected a trace (.parquet) or a counts array (.npy)",
        "record a trace with moefleet profile, or np.save counts_LE",
    )


def load_profile(profile: Path | None, model: str | None,
                 dtype: str | None = None) -> Any:  # -> ComputeProfile
    """``--profile``, else the cached (measured once) profile of ``--model`` in ``dtype``."""
    from moefleet.profiles.cache import profile_for
    from moefleet.profiles.model import ComputeProfile

    if profile is not None:
        if dtype is not None:
            raise MoefleetError(
                f"--dtype {dtype} applies to a profile measured from --model; --profile "
                f"{profile} was measured in its own dtype",
                "drop --dtype, or drop --profile and pass --model (measured in that dtype)")
        return ComputeProfile.load(profile)
    if model is None:
        raise MoefleetError("plan needs --profile or --model", "pass --profile profile.json")
    return profile_for(model, dtype=dtype)


def make_plan(
    *, model: str | None, policy: str, platform: str, slo: float, counts: Path,
    profile: Path | None, tokens: int | None, max_replicas: int, time_limit: float, seed: int,
    warm_instances: bool = False, dtype: str | None = None,
) -> Any:  # -> DeploymentPlan
    """The library call behind ``moefleet plan``. ``warm_instances``: price the plan under
    the warm-instances variant of the cost model (``PlanningProblem.warm_instances``; the
    plan's meta records it)."""
    from moefleet.plan import PlanningProblem, get_planner
    from moefleet.platform import load_platform

    spec = load_platform(platform)
    planner = get_planner(policy, time_limit_s=time_limit)
    counts_LE, experts, trace_tokens, trace_model = load_counts(counts)
    prof = load_profile(profile, model, dtype)
    check_same_model(prof, model, trace_model, counts_LE)
    problem = PlanningProblem.from_profile(
        prof, spec, counts_LE, slo, model=model, num_experts=experts,
        tokens=tokens if tokens is not None else trace_tokens, max_replicas=max_replicas,
        warm_instances=warm_instances,
    )
    return planner.plan(problem, seed=seed)


def check_same_model(prof: Any, model: str | None, trace_model: str | None,
                     counts_LE: Any) -> None:
    """The profile, ``--model`` and the counts describe one model (layers, experts)."""
    if trace_model is not None and trace_model != prof.model:
        raise MoefleetError(
            f"--counts trace was recorded on '{trace_model}' but the profile was measured on "
            f"'{prof.model}'", "use a trace and a profile of the same model")
    if model is not None and prof.model != model:
        raise MoefleetError(
            f"--model {model} but the profile was measured on '{prof.model}'",
            f"measure a profile of {model} (moefleet profile-compute -m {model}) or drop "
            "--model")
    if counts_LE.shape[0] != len(prof.moe_layers):
        raise MoefleetError(
            f"--counts has {counts_LE.shape[0]} MoE layers, the profile of '{prof.model}' "
            f"{len(prof.moe_layers)}", "use counts recorded on the profiled model")


@app.callback()
def plan_cmd(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="Model the plan is for (default: the profile's).")] = None,
    policy: Annotated[str, typer.Option(
        help="ods | ods-paper | miqcp | random | lambdaml; Remoe: remoe | remoe-sweep | "
        "cpu | gpu | mix | fetch.")] = "ods",
    platform: Annotated[str, typer.Option(help="Platform name or YAML.")] = "aws-lambda",
    slo: Annotated[float | None, typer.Option(help="End-to-end latency limit, seconds.")] = None,
    counts: Annotated[Path | None, typer.Option(
        help="Routing trace (.parquet) or counts_LE (.npy): tokens per expert.")] = None,
    profile: Annotated[Path | None, typer.Option(help="Compute profile JSON.")] = None,
    out: Annotated[Path, typer.Option(
        "--out", "-o", help="Plan YAML to write (- for stdout).")] = Path("plan.yaml"),
    tokens: Annotated[int | None, typer.Option(
        min=1, max=L.MAX_TOKENS,
        help="Tokens in the batch (default: the trace's; for .npy the largest layer sum).")
    ] = None,
    max_replicas: Annotated[int, typer.Option(
        min=1, max=L.MAX_REPLICAS, help="Replicas per expert at most.")] = 8,
    time_limit: Annotated[float, typer.Option(
        min=0.01, max=L.MAX_TIME_LIMIT_S, help="Solver time limit (miqcp), s.")] = 60.0,
    seed: Annotated[int, typer.Option(
        min=0, max=L.MAX_SEED, help="Seed (random policy, solver).")] = 0,
    warm_instances: Annotated[bool, typer.Option(
        "--warm-instances",
        help="Steady-state serving: instances already hold their parameters (no per-batch "
        "parameter download or GET, warm start not billed). Default: the paper's model.")
    ] = False,
    ttft: Annotated[float | None, typer.Option(
        min=1e-6, max=1e6, help="Remoe: TTFT SLO, seconds.")] = None,
    tpot: Annotated[float | None, typer.Option(
        min=1e-6, max=1e6, help="Remoe: TPOT SLO, seconds.")] = None,
    activation: Annotated[Path | None, typer.Option(
        help="Remoe: activation distribution (layers x experts) .npy or .json (SPS).")
    ] = None,
    n_in: Annotated[int, typer.Option(min=1, max=10**6, help="Remoe: input tokens.")] = 128,
    n_out: Annotated[int, typer.Option(min=1, max=10**6, help="Remoe: output tokens.")] = 200,
    remote_platform: Annotated[str | None, typer.Option(
        help="Remoe: platform of the remote CPU functions (default: --platform).")] = None,
    main_memory: Annotated[list[int] | None, typer.Option(
        help="Remoe: main-function memory options, MB (repeat; default: the platform's).")
    ] = None,
    remote_memory: Annotated[list[int] | None, typer.Option(
        help="Remoe: remote-function memory options, MB (repeat; default: up to 5120).")
    ] = None,
    timing: Annotated[Path | None, typer.Option(
        help="Remoe: timing JSON (default: measure this machine's CPU FLOP rate).")] = None,
    dtype: Annotated[str | None, typer.Option(
        help="The model's weights in auto (the faster measured one on this CPU), bfloat16, "
             "float16 or float32 for the profile measured from --model (ODS) or the "
             "model's sizes (Remoe). Default: the checkpoint's.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Plan memory, replicas and scatter-gather methods for the cheapest billed cost
    under the SLO (ODS/BO's model), and write the plan YAML.

    Example: moefleet plan --policy ods --platform aws-lambda-2020 --slo 30
    --counts trace.parquet --profile profile.json -o plan.yaml
    """
    if ctx.invoked_subcommand is not None:
        return
    from moefleet.cli.plan_remoe import REMOE_POLICIES, make_remoe_plan, remoe_table

    if policy in REMOE_POLICIES:
        with user_errors():
            check_outputs(("--out", out), stdout=("--out",), json_mode=as_json)
            if dtype is not None:
                from moefleet.models.dtypes import check_dtype_name

                check_dtype_name(dtype)
            plan = make_remoe_plan(
                policy=policy, model=model, platform=platform,
                remote_platform=remote_platform, activation=activation, ttft=ttft,
                tpot=tpot, n_in=n_in, n_out=n_out, main_memory=main_memory,
                remote_memory=remote_memory, timing=timing, max_replicas=max_replicas,
                dtype=dtype)
            write_data(out, plan.to_yaml())
        if as_json:
            emit_json({"out": str(out), "policy": plan.policy, "predicted": plan.predicted,
                       "meta": plan.meta})
            return
        out_console(is_stdout(out)).print(remoe_table(plan))
        if not is_stdout(out):
            out_console(False).print(f"wrote {out}")
        return
    with user_errors():
        check_outputs(("--out", out), stdout=("--out",), json_mode=as_json)
        if dtype is not None:
            from moefleet.models.dtypes import check_dtype_name

            check_dtype_name(dtype)
        if slo is None or counts is None:
            raise MoefleetError(
                "moefleet plan needs --slo and --counts",
                "e.g. moefleet plan --slo 30 --counts trace.parquet --profile profile.json",
            )
        plan = make_plan(
            model=model, policy=policy, platform=platform, slo=slo, counts=counts,
            profile=profile, tokens=tokens, max_replicas=max_replicas,
            time_limit=time_limit, seed=seed, warm_instances=warm_instances, dtype=dtype,
        )
        write_data(out, plan.to_yaml())
    if as_json:
        emit_json({"out": str(out), "policy": plan.policy, "predicted": plan.predicted,
                   "meta": plan.meta})
        return
    con = out_console(is_stdout(out))
    con.print(plan_table(plan))
    if not is_stdout(out):
        con.print(f"wrote {out}")


@app.command("show")
def show_cmd(
    path: Annotated[Path, typer.Argument(help="Plan YAML (from moefleet plan).")],
    as_json: JsonOpt = False,
) -> None:
    """Print a plan: per MoE layer the method, β, memory and replicas of its experts.

    Example: moefleet plan show plan.yaml
    """
    from moefleet.plan import DeploymentPlan

    with user_errors():
        plan = DeploymentPlan.load(path)
    if as_json:
        emit_json(plan.model_dump(mode="json"))
        return
    if plan.main is not None:
        from moefleet.cli.plan_remoe import remoe_table

        out_console(False).print(remoe_table(plan))
        return
    out_console(False).print(plan_table(plan))


def _histogram(values: list[int], unit: str = "") -> str:
    """'768 MB x3, 1536 MB x1': compact for layers with many experts."""
    if len(set(values)) == 1 and len(values) <= 4:
        return ", ".join(f"{v}{unit}" for v in values)
    return ", ".join(f"{v}{unit} x{n}" for v, n in sorted(Counter(values).items()))


def plan_table(plan: Any) -> Table:  # plan: DeploymentPlan
    """A rich table of a plan with its predicted cost and latency."""
    pred = plan.predicted
    caption = []
    if "cost_usd" in pred:
        caption.append(f"predicted cost ${pred['cost_usd']:.6g} per batch (MoE layers)")
    if "latency_s" in pred:
        slo = f" (SLO {pred['slo_s']:.4g} s)" if "slo_s" in pred else ""
        caption.append(f"latency {pred['latency_s']:.4g} s{slo}")
    status = str(plan.meta.get("status", "optimal")).lower()
    if status not in ("optimal", "2"):  # SCIP says "optimal", gurobi GRB.OPTIMAL == 2
        gap = plan.meta.get("gap")
        caption.append(f"[bold yellow]WARNING: solver stopped with status '{status}'"
                       + (f", gap {100 * gap:.1f}%" if isinstance(gap, float) else "")
                       + ": not proven optimal; raise --time-limit or compare --policy ods[/]")
    t = Table(
        title=f"{plan.model} on {plan.platform} ({plan.policy})",
        caption="; ".join(caption) or None,
    )
    for col in ("layer", "method", "β", "memory per expert", "replicas"):
        t.add_column(col, overflow="fold")
    for lp in plan.layers:
        t.add_row(
            str(lp.layer),
            lp.method,
            str(lp.beta) if lp.method == "pipelined" else "-",
            _histogram([e.memory_mb for e in lp.experts], " MB"),
            _histogram([e.replicas for e in lp.experts]),
        )
    return t
