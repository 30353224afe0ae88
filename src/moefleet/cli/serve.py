"""``moefleet serve``: an OpenAI-compatible HTTP server over one engine."""

from __future__ import annotations

import errno
import os
import socket
from typing import Annotated, Any

import typer

from moefleet.cli.common import err_console, user_errors
from moefleet.cli.deployment import (
    AttentionOpt,
    BackendOpt,
    BrownoutOpt,
    DtypeOpt,
    FaultsOpt,
    GpuUtilOpt,
    KernelOpt,
    KVMemoryOpt,
    PlanOpt,
    StoreOpt,
    WorkersOpt,
    load_model,
    open_cli_engine,
    parse,
)
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
    max_waiting: Annotated[int | None, typer.Option(
        help="requests waiting beyond the running ones before new ones wait for a slot "
             "and then get 503 + Retry-After (default: what the engine holds at once)")
    ] = None,
    admission: Annotated[bool, typer.Option(
        help="admission gate before the body is read (--no-admission: the old shedding "
             "after parsing, kept to compare)")] = True,
    max_per_client: Annotated[int | None, typer.Option(
        help="fairness: requests in flight per client address (more: 429)")] = None,
    admission_wait: Annotated[float, typer.Option(
        help="at most this many seconds a request over capacity waits for a slot before "
             "its 503 (it waits the predicted queue drain time, at least 0.5 s)")] = 10.0,
    body_timeout: Annotated[float, typer.Option(
        help="seconds a request body may take to arrive (then 408)")] = 30.0,
    header_timeout: Annotated[float, typer.Option(
        help="seconds a request head may take to arrive (then 408; slowloris)")] = 10.0,
    max_header_kb: Annotated[int, typer.Option(
        help="largest request head (request line + headers), KiB (then 431)")] = 32,
    keep_alive: Annotated[int, typer.Option(
        help="seconds an idle keep-alive connection stays open")] = 5,
    max_body_kb: Annotated[int, typer.Option(help="largest request body, KiB")] = 4096,
    platform: Annotated[str, typer.Option(help="platform whose prices bill requests")
                        ] = "aws-lambda",
    memory_mb: Annotated[int, typer.Option(help="function memory the bill assumes")] = 2048,
    slo_ttft: Annotated[float | None, typer.Option(help="TTFT SLO in seconds (metrics)")
                        ] = None,
    slo_tpot: Annotated[float | None, typer.Option(help="TPOT SLO in seconds (metrics)")
                        ] = None,
    plan: PlanOpt = None,
    backend: BackendOpt = "local",
    store: StoreOpt = None,
    workers: WorkersOpt = None,
    brownout: BrownoutOpt = None,
    kernel: KernelOpt = "auto",
    dtype: DtypeOpt = "auto",
    kv_cache_memory: KVMemoryOpt = None,
    gpu_memory_utilization: GpuUtilOpt = 0.9,
    attention: AttentionOpt = "gather",
    step_timeout: Annotated[float, typer.Option(
        help="watchdog: a model step running longer than this makes /health and the "
             "requests waiting on it answer 503 (seconds)")] = 120.0,
    inject_faults: FaultsOpt = None,
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
        if not 0 <= port <= 65535:
            raise MoefleetError(f"--port must be in [0, 65535], got {port}", "e.g. --port 8000")
        if max_waiting is not None and not 1 <= max_waiting <= MAX_WAITING_LIMIT:
            raise MoefleetError(f"--max-waiting must be in [1, {MAX_WAITING_LIMIT}], got "
                                f"{max_waiting}", "e.g. --max-waiting 64")
        if max_per_client is not None and not 1 <= max_per_client <= MAX_WAITING_LIMIT:
            raise MoefleetError(f"--max-per-client must be in [1, {MAX_WAITING_LIMIT}], got "
                                f"{max_per_client}", "e.g. --max-per-client 16")
        if not 0 <= admission_wait <= 600:  # also refuses nan
            raise MoefleetError(f"--admission-wait must be in [0, 600] seconds, got "
                                f"{admission_wait}", "e.g. --admission-wait 1")
        from moefleet.serve.connections import ConnectionLimits

        try:
            limits = ConnectionLimits(head_timeout_s=header_timeout,
                                      max_head_bytes=max_header_kb * 1024,
                                      body_timeout_s=body_timeout, keep_alive_s=keep_alive)
        except ValueError as err:
            raise MoefleetError(f"connection limits: {err}",
                                "e.g. --header-timeout 10 --body-timeout 30 "
                                "--max-header-kb 32 --keep-alive 5") from None
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
        args = parse(plan=plan, backend=backend, store=store, workers=workers,
                     brownout=brownout, inject_faults=inject_faults, device=device,
                     kernel=kernel, max_num_seqs=max_num_seqs, dtype=dtype,
                     kv_cache_memory=kv_cache_memory,
                     gpu_memory_utilization=gpu_memory_utilization,
                     attention=attention)  # before the model loads
        if args.brownout is not None and args.brownout.controlled:
            slo_ttft = slo_ttft if slo_ttft is not None else args.brownout.slo_ttft_s
            slo_tpot = slo_tpot if slo_tpot is not None else args.brownout.slo_tpot_s
        key = api_key or os.environ.get("MOEFLEET_API_KEY") or None
        from moefleet.compose import Billing
        from moefleet.platform import load_platform

        load_platform(platform)  # a bad --platform fails before the model loads, too
        sock = bind(host, port)  # a port in use fails before the model loads, too
        with sock:  # closed on every way out, errors included
            adapter = load_model(model, args)
            name = served_name or (adapter.name if os.path.isdir(os.path.expanduser(model))
                                   else model)
            app_kw = {"model_name": name, "api_key": key, "max_waiting": max_waiting,
                      "max_body_bytes": max_body_kb * 1024, "slo_ttft_s": slo_ttft,
                      "slo_tpot_s": slo_tpot, "step_timeout_s": step_timeout,
                      "admission": admission, "max_per_client": max_per_client,
                      "admission_wait_s": admission_wait, "body_timeout_s": body_timeout}
            bound = sock.getsockname()[1]
            from moefleet.serve.connections import uvicorn_config
            served = False
            try:
                with open_cli_engine(adapter, args, model_ref=model,
                                     billing=Billing(platform, memory_mb)) as opened:
                    app = create_app(opened, **app_kw)  # type: ignore[arg-type]
                    served = True
                    for note in opened.notes:
                        err_console.print(f"note: {note}", highlight=False)
                    kv = getattr(opened.runner, "kv_capacity", None)
                    if kv is not None:
                        err_console.print(kv.describe(), highlight=False)
                    sock.listen(2048)  # from here on clients queue, not refused
                    err_console.print(_banner(args, opened, name, host, bound, key),
                                      highlight=False)
                    uvicorn.Server(uvicorn_config(app, host=host, port=bound, limits=limits)
                                   ).run(sockets=[sock])
            finally:  # uvicorn re-raises SIGTERM/SIGINT after shutdown; the with-block ran
                if served and args.plan is not None:
                    err_console.print("stopped; deployment torn down", highlight=False)


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (0: any free port), or one error line saying why
    not. Binding before the model loads makes a taken port fail in a second."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror:
        raise MoefleetError(f"--host {host} is not an address this machine can bind",
                            "e.g. --host 127.0.0.1 (or 0.0.0.0 for every interface)"
                            ) from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise MoefleetError(f"port {port} is in use",
                                "use --port 0 for any free port, or stop what holds it"
                                ) from None
        if err.errno == errno.EACCES:
            raise MoefleetError(f"port {port} needs privileges this process lacks",
                                "use a port above 1023, or --port 0") from None
        raise MoefleetError(f"cannot bind {host}:{port}: {err.strerror}",
                            "check --host and --port, or use --port 0") from None
    sock.set_inheritable(True)
    return sock


def _banner(args: Any, opened: Any, name: str, host: str, port: int, key: str | None) -> str:
    """One line saying what runs where."""
    auth = f"API key {'required' if key else 'off'}"
    if args.plan is None:
        return f"serving {name!r} on http://{host}:{port} ({auth}); Ctrl-C stops"
    plan = args.plan
    functions = sum(1 for f in opened.deployment.functions
                    if opened.backend is not None and f.name in opened.backend.functions())
    role = ""
    if plan.main is not None:
        gpu = opened.biller.main.gpu if opened.biller.main is not None else "none"
        role = (f"; this process is the main function (non-experts on {opened.device}, "
                f"GPU {gpu})")
    return (f"deployed {plan.model} as {functions} functions on {args.backend} "
            f"({plan.platform}){role}; serving {name!r} on http://{host}:{port} ({auth}); "
            "Ctrl-C stops and tears down")
