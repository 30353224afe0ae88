"""``moefleet deploy`` and ``moefleet run``: real execution of a plan on a backend.

    moefleet deploy plan.yaml --backend local --store DIR|s3://bucket/prefix -o deployment.json
    moefleet run --deployment deployment.json --dataset wikitext2 --tokens 512 --json
    moefleet run --plan plan.yaml --tokens 512          # deploy, run, tear down in one go

On the ``local`` backend (and ``ray`` without ``RAY_ADDRESS``: a Ray node of this
command), function instances live in processes of the command that runs them, so
``deploy`` uploads the weights and writes the deployment file (function definitions
validated against the platform) and ``run`` starts the instances (cold). On ``aws``, and
on ``ray`` with ``RAY_ADDRESS`` set (a cluster), ``deploy`` also creates the functions,
which stay until removed; ``run`` (re)deploys them, runs and removes them at the end.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from moefleet import limits as L
from moefleet.cli.common import check_outputs, emit_json, out_console, progress, user_errors
from moefleet.errors import MoefleetError
from moefleet.io import write_json_atomic

log = logging.getLogger(__name__)


def _default_store() -> str:
    from moefleet import paths

    return str(paths.cache_dir() / "store")


def _check_store(store: str | None) -> None:
    if store is not None and not store.strip():
        raise MoefleetError("--store is empty", "name a directory or s3://bucket/prefix, or "
                            "leave --store out for the default")


def _check_dataset(dataset: str) -> None:
    from moefleet.data import load_prompts, split_dataset

    name, split = split_dataset(dataset)
    load_prompts(name, split=split, limit=1)


def _check_backend(name: str) -> None:
    from moefleet.runtime.base import backend_names

    if name not in backend_names():
        raise MoefleetError(f"unknown backend {name!r}",
                            f"available backends: {', '.join(backend_names())}")


def _deploy(plan_path: Path, backend: str, store_url: str, json_mode: bool):
    from moefleet.cli.models import load_with_progress
    from moefleet.plan import DeploymentPlan
    from moefleet.platform import load_platform, open_store
    from moefleet.runtime.lifecycle import deploy

    _check_backend(backend)
    plan = DeploymentPlan.load(plan_path)
    platform = load_platform(plan.platform)
    adapter = load_with_progress(plan.model, json_mode)
    store = open_store(store_url)
    dep = deploy(plan, adapter, platform, store, backend_name=backend)
    return dep, adapter, platform, store


def _stdout_to_stderr() -> contextlib.AbstractContextManager[Any]:
    """While a backend works, what its libraries print on stdout goes to stderr, so stdout
    carries only this command's output (the JSON of --json). Ray's driver prints errors
    its cluster reports (e.g. "(raylet) Task ServeController.graceful_shutdown failed" as
    Serve shuts down) on stdout, whatever ``log_to_driver`` says."""
    return contextlib.redirect_stdout(sys.stderr)


def _persistent(backend: str) -> bool:
    """Backends whose functions outlive this command: aws always, ray on a cluster."""
    import os

    return backend == "aws" or (backend == "ray" and bool(os.environ.get("RAY_ADDRESS")))


def _install_persistent(dep: Any, backend_name: str, platform: Any, store: Any) -> int:
    """Create the deployment's functions on a backend that keeps them (no teardown). If
    that fails, what this command made goes: the functions created so far and the weights
    it uploaded (a half-made deployment only costs money)."""
    from moefleet.runtime.base import create_backend
    from moefleet.runtime.deploy import install, remove_objects

    backend = None
    try:
        backend = create_backend(backend_name, platform, store=dep.store)
        return len(install(dep, backend))
    except BaseException:
        try:
            if backend is not None:
                backend.teardown()
            remove_objects(dep, store)
        except Exception as err:  # the first error is the one to report
            log.warning("could not clean up the failed deployment %s: %s", dep.prefix, err)
        raise


def deploy_cmd(
    plan: Annotated[Path, typer.Argument(help="Plan YAML (moefleet plan -o, or hand-written).")],
    backend: Annotated[str, typer.Option(help="Function backend.")] = "local",
    store: Annotated[str | None, typer.Option(
        help="Object store: a directory or s3://bucket/prefix (default: the user cache).")] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Deployment file to write.")] = Path(
        "deployment.json"),
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable summary.")] = False,
) -> None:
    """Upload a plan's weights to the object store and define its functions.

    Example: moefleet deploy plan.yaml --store /tmp/moefleet-store -o deployment.json
    """
    installed = 0
    with user_errors(), _stdout_to_stderr():
        check_outputs(("--out", out))
        _check_store(store)
        dep, _, platform, object_store = _deploy(plan, backend, store or _default_store(),
                                                 as_json)
        if _persistent(backend):
            installed = _install_persistent(dep, backend, platform, object_store)
        dep.save(out)
    summary = {"deployment": str(out), "store": dep.store, "prefix": dep.prefix,
               "functions": len(dep.functions), "bytes_uploaded": dep.layout.bytes_uploaded,
               "backend": dep.backend, "model": dep.model, "platform": dep.platform,
               "functions_created": installed}
    if as_json:
        emit_json(summary)
        return
    out_console(False).print(
        f"deployed {dep.model} as {len(dep.functions)} functions on {dep.platform} "
        f"({dep.layout.bytes_uploaded / 1e6:.1f} MB of weights in {dep.store}/{dep.prefix})\n"
        f"wrote {out}; run it with: moefleet run --deployment {out}")


def run_cmd(
    deployment: Annotated[Path | None, typer.Option(help="Deployment file (moefleet deploy).")
                          ] = None,
    plan: Annotated[Path | None, typer.Option(help="Plan YAML: deploy, run, tear down.")] = None,
    dataset: Annotated[str, typer.Option("--dataset", "-d", help="Dataset name[:split] or file."
                                         )] = "wikitext2",
    tokens: Annotated[int, typer.Option(min=1, max=L.MAX_TOKENS, help="Tokens to run.")] = 512,
    batch_size: Annotated[int, typer.Option(min=1, max=4096, help="Prompts per batch.")] = 8,
    max_length: Annotated[int, typer.Option(
        min=1, max=L.MAX_PROMPT_TOKENS, help="Truncate each prompt to this.")] = 128,
    backend: Annotated[str, typer.Option(help="Function backend (with --plan).")] = "local",
    store: Annotated[str | None, typer.Option(help="Object store (with --plan; default: a "
                                              "temporary directory).")] = None,
    workers: Annotated[int | None, typer.Option(
        min=1, max=L.MAX_WORKERS, help="Local worker processes.")] = None,
    check: Annotated[bool, typer.Option(help="Compare outputs with the monolithic model.")
                     ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable results.")] = False,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Results JSON to write.")
                   ] = None,
) -> None:
    """Run a dataset through a deployed model; print billed cost, latency, cold starts.

    Example: moefleet run --plan plan.yaml --dataset wikitext2 --tokens 512 -o results.json
    """
    with user_errors(), _stdout_to_stderr():
        if (deployment is None) == (plan is None):
            raise MoefleetError("pass exactly one of --deployment and --plan",
                                "e.g. moefleet run --plan plan.yaml")
        check_outputs(("--out", out))
        _check_store(store)
        _check_dataset(dataset)  # before a deployment uploads anything
        with tempfile.TemporaryDirectory(prefix="moefleet-store-") as tmp:
            summary = _run(deployment, plan, dataset, tokens, batch_size, max_length, backend,
                           store or tmp, workers, check, as_json)
        if out is not None:
            write_json_atomic(out, summary)
    if as_json:
        emit_json(summary)
    else:
        _print_summary(summary)


def _run(deployment: Path | None, plan: Path | None, dataset: str, tokens: int,
         batch_size: int, max_length: int, backend_name: str, store_url: str,
         workers: int | None, check: bool, json_mode: bool) -> dict[str, Any]:
    from moefleet.cli.models import load_with_progress
    from moefleet.compose import StackOptions, open_engine
    from moefleet.compose.score import score, score_options
    from moefleet.data import load_prompts, split_dataset
    from moefleet.plan import DeploymentPlan
    from moefleet.platform import load_platform, open_store
    from moefleet.runtime.deploy import Deployment
    from moefleet.traces.profile import tokenize_prompts

    source: Deployment | DeploymentPlan
    if deployment is not None:
        source = Deployment.load(deployment)
        model, platform_name, store_url = source.model, source.platform, source.store
        backend_name = source.backend
    else:
        assert plan is not None
        _check_backend(backend_name)
        source = DeploymentPlan.load(plan)
        model, platform_name = source.model, source.platform
    platform = load_platform(platform_name)
    main_plan = source.plan if isinstance(source, Deployment) else source
    if main_plan.main is not None:
        from moefleet.remoe.messages import MAX_TOKENS

        if tokens > MAX_TOKENS:  # a Remoe run generates --tokens per request
            raise MoefleetError(f"--tokens {tokens}: a Remoe plan generates that many tokens "
                                f"per request, at most {MAX_TOKENS}",
                                f"use --tokens {MAX_TOKENS} or fewer")
    adapter = load_with_progress(model, json_mode)
    store = open_store(store_url)
    # the dataset is read before anything is deployed: a bad one leaves nothing behind
    name, split = split_dataset(dataset)
    prompts = load_prompts(name, split=split)
    if main_plan.main is not None:  # Remoe: the engine runs inside the main function
        return _run_remoe(source, adapter, platform, store, prompts, tokens, batch_size,
                          max_length, backend_name, workers, check, dataset)
    kept = tokenize_prompts(adapter, [p.text for p in prompts], max_tokens=tokens,
                            max_length=max_length)
    scored = [(prompts[i].request_id, ids) for i, ids in kept]
    options: dict[str, Any] = {} if workers is None else {"workers": workers}
    with open_engine(adapter, plan=source, stack=StackOptions(), backend=backend_name,
                     store=store, platform=platform, backend_options=options,
                     options=score_options(batch_size, max_length), model_ref=model) as opened:
        summary = score(opened, scored, reference=adapter if check else None,
                        progress=progress)
    summary["dataset"] = dataset
    return summary


def _run_remoe(source: Any, adapter: Any, platform: Any, store: Any, prompts: Any,
               tokens: int, batch_size: int, max_length: int, backend_name: str,
               workers: int | None, check: bool, dataset: str) -> dict[str, Any]:
    """A plan with a main function: ``--tokens`` output tokens per request for the first
    ``--batch-size`` prompts, one main invocation (see moefleet.remoe.run)."""
    from moefleet.remoe.run import run_remoe_plan
    from moefleet.traces.profile import tokenize_prompts

    kept = tokenize_prompts(adapter, [p.text for p in prompts[:batch_size]],
                            max_tokens=max_length * batch_size, max_length=max_length)
    ids = [list(seq) for _, seq in kept]
    options: dict[str, Any] = {} if workers is None else {"workers": workers}
    summary = run_remoe_plan(source, ids, platform=platform, store=store, adapter=adapter,
                             backend=backend_name, backend_options=options,
                             max_tokens=tokens, batch_size=batch_size, check=check)
    summary["dataset"] = dataset
    return summary


def _print_remoe(s: dict[str, Any]) -> None:
    cold, cost = s["cold_start"], s["cost_usd"]
    gen = cost["generation"]
    match = s.get("tokens_match_monolithic")
    out_console(False).print(
        f"{s['model']} on {s['platform']} ({s['policy']}, {s['backend']} backend): "
        f"{s['requests']} requests x {s['max_tokens']} tokens\n"
        f"cold start {cold['wall_s']:.2f} s overlapped (main {cold['main_init_s']:.2f} s, "
        f"remote {cold['remote_init_s']:.2f} s, {cold['remote_instances']} remote "
        f"instances)\nTTFT median {s['ttft_s']['median'] * 1e3:.0f} ms, TPOT median "
        f"{s['tpot_s']['median'] * 1e3:.1f} ms; {s['remote_invocations']} remote calls\n"
        f"billed ${cost['total']:.4g}: generation main ${gen['main']['cost_usd']:.3g} + "
        f"remote ${gen['remote']['cost_usd']:.3g}; {s['gpu']}"
        + ("" if match is None else f"\ngreedy tokens equal the monolithic model's: {match}"))


def _print_summary(s: dict[str, Any]) -> None:
    if s.get("kind") == "remoe-main":
        _print_remoe(s)
        return
    con = out_console(False)
    from moefleet.report.tables import Col, fit_table, sig3

    cols = [Col("layer"), Col("method", numeric=False), Col("β", drop=1),
            Col("MoE latency (ms)"), Col("invocations", drop=2), Col("cold starts", drop=3),
            Col("cost (USD)")]
    rows = [[str(row["layer"]), row["method"], str(row["beta"]),
             sig3(row.get("moe_latency_s", 0.0) * 1e3), str(row["invocations"]),
             str(row["cold_starts"]), sig3(row["cost_usd"])] for row in s["layers"]]
    con.print(fit_table(f"{s['model']} on {s['platform']} ({s['backend']} backend)", cols,
                        rows, width=con.width))
    cost = s["cost_usd"]
    diff = s.get("max_abs_diff")
    con.print(
        f"tokens {s['tokens']} in {s['batches']} batches; billed ${cost['total']:.4g} "
        f"(${cost['per_1k_tokens']:.4g} per 1k tokens; compute {cost['compute']:.3g}, "
        f"requests {cost['request']:.3g}, storage {cost['storage']:.3g})\n"
        f"throughput {s['throughput_tokens_per_s']:.1f} tokens/s; median batch latency "
        f"{s['latency_s']['median'] * 1e3:.0f} ms; cold starts {s['cold_starts']} of "
        f"{s['invocations']} invocations"
        + (f"; max |Δ| vs monolithic {diff:.2g}" if diff is not None else ""))
