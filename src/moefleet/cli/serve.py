"""``moefleet serve``: an OpenAI-compatible HTTP server over one engine."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer

from moefleet import limits as L
from moefleet.cli.common import err_console, user_errors
from moefleet.errors import MissingExtraError, MoefleetError

MAX_WAITING_LIMIT = 1_000_000


def serve_cmd(
    model: Annotated[str, typer.Option("--model", "-m", help="zoo name, directory or hub id")],
    host: Annotated[str, typer.Option(help="address to bind (loopback unless told)")
                    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0 = any free port)")] = 8000,
    api_key: Annotated[str | None, typer.Option(
        help="require 'Authorization: Bearer KEY' on /v1/* (or set MOEFLEET_API_KEY)")] = None,
    served_name: Annotated[str | None, typer.Option(
        help="model name clients send (default: the model's name)")] = None,
    device: Annotated[str, typer.Option(
        help="auto, cpu, cuda or cuda:N (auto: CUDA where torch sees a GPU; with a Remoe "
             "plan, only if its main function has a GPU)")] = "auto",
    max_num_seqs: Annotated[int, typer.Option(help="sequences per engine step")] = 64,
    max_waiting: Annotated[int, typer.Option(
        help="waiting requests before new ones get 503 + Retry-After")] = 256,
    max_body_kb: Annotated[int, typer.Option(help="largest request body, KiB")] = 4096,
    platform: Annotated[str, typer.Option(help="platform whose prices bill requests")
                        ] = "aws-lambda",
    memory_mb: Annotated[int, typer.Option(help="function memory the bill assumes")] = 2048,
    slo_ttft: Annotated[float | None, typer.Option(help="TTFT SLO in seconds (metrics)")
                        ] = None,
    slo_tpot: Annotated[float | None, typer.Option(help="TPOT SLO in seconds (metrics)")
                        ] = None,
    plan: Annotated[str | None, typer.Option(
        help="deployment plan YAML: the experts run in its functions on --backend, each "
             "request is billed from its invocations")] = None,
    backend: Annotated[str, typer.Option(help="function backend with --plan: local|ray|aws")
                       ] = "local",
    store: Annotated[str | None, typer.Option(
        help="object store with --plan: a directory or s3://bucket/prefix (default: a "
             "temporary directory, removed at exit)")] = None,
    workers: Annotated[int | None, typer.Option(
        help="local backend: worker processes (default: the machine's cores)")] = None,
    brownout: Annotated[str | None, typer.Option(
        help="BrownoutServe: ways=8,slo-ttft=S,slo-tpot=S[,mode=partial|full,warning=,"
             "increment=,shrink=,window=,interval=] (SALC sets the threshold each step)")
                        ] = None,
    step_timeout: Annotated[float, typer.Option(
        help="watchdog: a model step running longer than this makes /health and the "
             "requests waiting on it answer 503 (seconds)")] = 120.0,
    inject_faults: Annotated[str | None, typer.Option(
        help="resilience testing (emulated faults): KIND:RATE[:SEED[:SECONDS]], KIND one "
             "of crash, timeout, throttle, straggler, stall, error; RATE = fraction of "
             "expert calls; SECONDS = how long a timeout/straggler/stall waits")
                             ] = None,
) -> None:
    """Serve a model over HTTP: /v1/completions, /v1/chat/completions, /metrics, ...

    Example: moefleet serve -m tiny-moe-lm --port 8000
    """
    with user_errors():
        try:
            import uvicorn

            from moefleet.serve import create_app
        except ImportError as err:
            raise MissingExtraError(err.name or "fastapi", "serve") from None
        if plan is None and (store is not None or workers is not None):
            raise MoefleetError("--store and --workers only apply with --plan",
                                "add --plan plan.yaml, or drop them")
        if plan is not None and brownout is not None:
            raise MoefleetError("--brownout and --plan cannot be combined yet",
                                "drop one of them")
        if workers is not None and not 1 <= workers <= L.MAX_WORKERS:
            raise MoefleetError(f"--workers must be in [1, {L.MAX_WORKERS}], got {workers}",
                                "e.g. --workers 2")
        if store is not None and not store.strip():
            raise MoefleetError("--store is empty", "name a directory or s3://bucket/prefix")
        if not 0 <= port <= 65535:
            raise MoefleetError(f"--port must be in [0, 65535], got {port}", "e.g. --port 8000")
        if not 1 <= max_waiting <= MAX_WAITING_LIMIT:
            raise MoefleetError(f"--max-waiting must be in [1, {MAX_WAITING_LIMIT}], got "
                                f"{max_waiting}", "e.g. --max-waiting 256")
        if not 1 <= max_body_kb <= 1 << 20:
            raise MoefleetError(f"--max-body-kb must be in [1, {1 << 20}], got {max_body_kb}",
                                "e.g. --max-body-kb 4096")
        for name, v in (("--slo-ttft", slo_ttft), ("--slo-tpot", slo_tpot)):
            if v is not None and not 0 < v < 3600:
                raise MoefleetError(f"{name} must be in (0, 3600) seconds, got {v}",
                                    "e.g. 0.5")
        if not 0 < step_timeout <= 86_400:  # also refuses nan
            raise MoefleetError(f"--step-timeout must be in (0, 86400] seconds, got "
                                f"{step_timeout}", "e.g. --step-timeout 120")
        faults = None
        if inject_faults is not None:
            from moefleet.runtime.faults import parse_fault

            faults = parse_fault(inject_faults)
            if brownout is not None or plan is not None:
                raise MoefleetError("--inject-faults cannot be combined with --brownout or "
                                    "--plan", "drop one of them")
        key = api_key or os.environ.get("MOEFLEET_API_KEY") or None
        from moefleet.engine.build import build_engine, check_engine_args

        check_engine_args(device, max_num_seqs)  # before the model loads
        from moefleet.platform import load_platform

        load_platform(platform)  # a bad --platform fails before the model loads, too
        from moefleet.models.registry import load_adapter

        spec = None
        if brownout is not None:
            from moefleet.brownout.control import parse_brownout_spec

            spec = parse_brownout_spec(brownout)  # before loading: bad specs fail fast
            slo_ttft = slo_ttft if slo_ttft is not None else spec.slo_ttft_s
            slo_tpot = slo_tpot if slo_tpot is not None else spec.slo_tpot_s
        the_plan = None
        if plan is not None:
            from moefleet.plan import DeploymentPlan
            from moefleet.runtime.base import backend_names

            if backend not in backend_names():
                raise MoefleetError(f"unknown backend {backend!r}",
                                    f"available backends: {', '.join(backend_names())}")
            the_plan = DeploymentPlan.load(plan)  # before loading: a bad plan fails fast
            if the_plan.main is not None:
                from moefleet.remoe.main_model import main_device

                main_device(the_plan.main.gpu_gb, device)
        adapter = load_adapter(model)
        experts = None
        if the_plan is not None:
            from moefleet.serve.deployed import check_plan_model

            check_plan_model(the_plan, adapter, model)
        if spec is not None:
            from moefleet.brownout.serving import brownout_engine

            engine, experts, _ = brownout_engine(adapter, ways=spec.ways, mode=spec.mode,
                                                 salc=spec.salc(), device=device,
                                                 max_num_seqs=max_num_seqs)
        elif the_plan is None and faults is not None:
            from moefleet.models.local_experts import local_experts
            from moefleet.runtime.faults import FaultyExperts

            engine = build_engine(adapter, device=device, max_num_seqs=max_num_seqs,
                                  experts=FaultyExperts(local_experts(adapter), faults))
            err_console.print(f"injecting {faults.kind} faults into {faults.rate:.0%} of "
                              "expert calls (emulated)", highlight=False)
        elif the_plan is None:
            engine = build_engine(adapter, device=device, max_num_seqs=max_num_seqs)
        name = served_name or (adapter.name if os.path.isdir(os.path.expanduser(model))
                               else model)
        app_kw = {"model_name": name, "api_key": key, "max_waiting": max_waiting,
                  "max_body_bytes": max_body_kb * 1024, "platform": platform,
                  "memory_mb": memory_mb, "slo_ttft_s": slo_ttft, "slo_tpot_s": slo_tpot,
                  "step_timeout_s": step_timeout}
        if the_plan is not None:
            _serve_plan(the_plan, adapter, model, backend, store, workers, device,
                        max_num_seqs, host, port, app_kw)
            return
        app = create_app(engine, **app_kw)  # type: ignore[arg-type]
        if experts is not None:
            from moefleet.brownout.hook import ThresholdReport

            gauge = app.state.serve.metrics.controller
            engine.hooks.append(ThresholdReport(experts, lambda kind, th: gauge.labels(
                name, f"brownout_threshold_{kind}").set(th)))
        err_console.print(f"serving {name!r} on http://{host}:{port} (API key "
                          f"{'required' if key else 'off'}); Ctrl-C stops", highlight=False)
    uvicorn.run(app, host=host, port=port, log_level="warning")


def _serve_plan(plan: Any, adapter: Any, model: str, backend: str, store: str | None,
                workers: int | None, device: str, max_num_seqs: int, host: str, port: int,
                app_kw: dict[str, Any]) -> None:
    """Deploy, serve until stopped (Ctrl-C / SIGTERM), tear down what was deployed."""
    import tempfile

    import uvicorn

    from moefleet.platform import open_store
    from moefleet.serve import create_app
    from moefleet.serve.deployed import deployed_engine

    options: dict[str, Any] = {} if workers is None else {"workers": workers}
    served = False
    try:
        with tempfile.TemporaryDirectory(prefix="moefleet-serve-store-") as tmp, \
                deployed_engine(plan, adapter, store=open_store(store or tmp),
                                backend=backend, model_ref=model, backend_options=options,
                                device=device, max_num_seqs=max_num_seqs) as d:
            app = create_app(d.engine, biller=d.biller, **app_kw)
            served = True
            n = d.functions
            role = ""
            if plan.main is not None:
                gpu = d.biller.main.gpu if d.biller.main is not None else "none"
                role = (f"; this process is the main function (non-experts on {d.device}, "
                        f"GPU {gpu})")
            err_console.print(
                f"deployed {plan.model} as {n} functions on {backend} ({plan.platform}){role}; "
                f"serving {app_kw['model_name']!r} on http://{host}:{port} (API key "
                f"{'required' if app_kw['api_key'] else 'off'}); Ctrl-C stops and tears "
                "down", highlight=False)
            uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:  # uvicorn re-raises SIGTERM/SIGINT after its shutdown; the with-block ran
        if served:
            err_console.print("stopped; deployment torn down", highlight=False)
