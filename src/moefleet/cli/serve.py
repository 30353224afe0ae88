"""``moefleet serve``: an OpenAI-compatible HTTP server over one engine."""

from __future__ import annotations

import os
from typing import Annotated

import typer

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
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N")] = "cpu",
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
    plan: Annotated[str | None, typer.Option(help="deployment plan (not yet supported)")
                    ] = None,
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
        if plan is not None:
            raise MoefleetError("--plan is not supported by `moefleet serve` yet",
                                "serve in process (drop --plan); `moefleet run` executes plans")
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
            if brownout is not None:
                raise MoefleetError("--inject-faults and --brownout cannot be combined",
                                    "drop one of them")
        key = api_key or os.environ.get("MOEFLEET_API_KEY") or None
        from moefleet.engine.build import build_engine, check_engine_args

        check_engine_args(device, max_num_seqs)  # before the model loads
        from moefleet.models.registry import load_adapter

        spec = None
        if brownout is not None:
            from moefleet.brownout.control import parse_brownout_spec

            spec = parse_brownout_spec(brownout)  # before loading: bad specs fail fast
            slo_ttft = slo_ttft if slo_ttft is not None else spec.slo_ttft_s
            slo_tpot = slo_tpot if slo_tpot is not None else spec.slo_tpot_s
        adapter = load_adapter(model)
        experts = None
        if spec is not None:
            from moefleet.brownout.serving import brownout_engine

            engine, experts, _ = brownout_engine(adapter, ways=spec.ways, mode=spec.mode,
                                                 salc=spec.salc(), device=device,
                                                 max_num_seqs=max_num_seqs)
        elif faults is not None:
            from moefleet.models.local_experts import local_experts
            from moefleet.runtime.faults import FaultyExperts

            engine = build_engine(adapter, device=device, max_num_seqs=max_num_seqs,
                                  experts=FaultyExperts(local_experts(adapter), faults))
            err_console.print(f"injecting {faults.kind} faults into {faults.rate:.0%} of "
                              "expert calls (emulated)", highlight=False)
        else:
            engine = build_engine(adapter, device=device, max_num_seqs=max_num_seqs)
        name = served_name or (adapter.name if os.path.isdir(os.path.expanduser(model))
                               else model)
        app = create_app(engine, model_name=name, api_key=key, max_waiting=max_waiting,
                         max_body_bytes=max_body_kb * 1024, platform=platform,
                         memory_mb=memory_mb, slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot,
                         step_timeout_s=step_timeout)
        if experts is not None:
            from moefleet.brownout.hook import ThresholdReport

            gauge = app.state.serve.metrics.controller
            engine.hooks.append(ThresholdReport(experts, lambda kind, th: gauge.labels(
                name, f"brownout_threshold_{kind}").set(th)))
        err_console.print(f"serving {name!r} on http://{host}:{port} (API key "
                          f"{'required' if key else 'off'}); Ctrl-C stops", highlight=False)
    uvicorn.run(app, host=host, port=port, log_level="warning")
