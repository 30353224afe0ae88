"""``moefleet bench serve``: replay a workload against a running server."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from moefleet.cli.common import check_outputs, emit_json, err_console, out_console, user_errors
from moefleet.errors import MoefleetError

app = typer.Typer(help="Benchmarks against running systems.", no_args_is_help=True)
MAX_DURATION_S = 3600.0


@app.command("serve")
def bench_serve_cmd(
    url: Annotated[str, typer.Option(help="server base URL, e.g. http://127.0.0.1:8000")],
    dataset: Annotated[str, typer.Option(help="prompts: a dataset name or prompt file")],
    workload: Annotated[str, typer.Option(
        help="arrivals: poisson:rate=R | bursty:rate=R,cv=C | azure-llm:trace=code|conv")],
    duration: Annotated[float, typer.Option(help="seconds of arrivals to replay")] = 30.0,
    max_requests: Annotated[int, typer.Option(help="stop after this many requests")] = 1000,
    max_tokens: Annotated[int, typer.Option(help="output tokens per request (cap)")] = 64,
    slo_ttft: Annotated[float | None, typer.Option(help="TTFT SLO, seconds")] = None,
    slo_tpot: Annotated[float | None, typer.Option(help="TPOT SLO, seconds")] = None,
    drain: Annotated[float, typer.Option(help="seconds to wait for stragglers")] = 60.0,
    seed: Annotated[int, typer.Option(help="arrival seed")] = 0,
    api_key: Annotated[str | None, typer.Option(help="bearer key for /v1/*")] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="JSON result (PNG beside it)")
                   ] = Path("bench_serve.json"),
    json_out: Annotated[bool, typer.Option("--json", help="print JSON on stdout")] = False,
) -> None:
    """Stream requests at the workload's arrival times; report TTFT/TPOT/ITL/e2e
    percentiles, throughput, goodput under the SLOs and billed cost.

    Example: moefleet bench serve --url http://127.0.0.1:8000 --dataset sharegpt
    --workload poisson:rate=4 --duration 30 --slo-ttft 0.5 --slo-tpot 0.05
    """
    with user_errors():
        check_outputs(("--out", out))  # before with_suffix, which refuses a bare "."
        check_outputs(("--out's PNG", out.with_suffix(".png")))
        from moefleet.data.registry import load_prompts
        from moefleet.io import atomic_path, write_json_atomic
        from moefleet.serve.bench import BenchConfig, plot, run_bench, summarize
        from moefleet.workloads import load_workload

        if not url.startswith(("http://", "https://")):
            raise MoefleetError(f"--url must start with http:// or https://, got {url!r}",
                                "e.g. --url http://127.0.0.1:8000")
        if not 0 < duration <= MAX_DURATION_S:
            raise MoefleetError(f"--duration must be in (0, {MAX_DURATION_S:g}] s, got "
                                f"{duration}", "e.g. --duration 30")
        if not 1 <= max_requests <= 100_000:
            raise MoefleetError(f"--max-requests must be in [1, 100000], got {max_requests}",
                                "e.g. --max-requests 1000")
        if not 0 < drain <= 3600:
            raise MoefleetError(f"--drain must be in (0, 3600] s, got {drain}", "e.g. 60")
        for name, v in (("--slo-ttft", slo_ttft), ("--slo-tpot", slo_tpot)):
            if v is not None and not 0 < v < 3600:
                raise MoefleetError(f"{name} must be in (0, 3600) s, got {v}", "e.g. 0.5")
        wl = load_workload(workload)
        arrivals = wl.arrivals(duration, seed)[:max_requests]
        prompts = [p.text for p in load_prompts(dataset, limit=max(1, min(len(arrivals),
                                                                          1000)))]
        cfg = BenchConfig(url, prompts, arrivals, max_tokens=max_tokens, slo_ttft_s=slo_ttft,
                          slo_tpot_s=slo_tpot, api_key=api_key, drain_s=drain)
        err_console.print(f"sending {len(arrivals)} requests over {duration:g} s "
                          f"({workload}) to {url}", highlight=False)
        records, wall = asyncio.run(run_bench(cfg))
        result: dict[str, Any] = {"url": url, "dataset": dataset, "workload": wl.describe(),
                  "duration_s": duration, "seed": seed, "max_tokens": max_tokens,
                  "metrics": summarize(records, wall, cfg)}
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out, result)
        png = out.with_suffix(".png")
        with atomic_path(png) as tmp:
            plot(records, str(tmp), f"{workload} on {url}")
        if json_out:
            emit_json(result)
            return
        _table(result["metrics"], out_console(False))
        err_console.print(f"wrote {out} and {png}", highlight=False)


def _table(m: dict[str, Any], console: Console) -> None:
    from moefleet.report.tables import Col, fit_table, sig3

    rows = []
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"),
                       ("e2e_s", "e2e")):
        row = m[key]
        rows.append([label, *(sig3(None if row[q] is None else row[q] * 1e3)
                              for q in ("mean", "p50", "p90", "p99"))])
    cols = [Col("metric (ms)", numeric=False), Col("mean"), Col("p50"), Col("p90"),
            Col("p99")]
    console.print(fit_table(None, cols, rows, width=console.width))
    rate = m["slo_violation_rate"]
    console.print(
        f"{m['completed']}/{m['requests']} completed in {m['wall_s']:.1f} s: "
        f"{m['request_throughput_rps']:.2f} req/s, {m['output_token_throughput_tps']:.1f} "
        f"tok/s, goodput {m['goodput_rps']:.2f} req/s, SLO violations "
        f"{'-' if rate is None else f'{rate:.1%}'}, billed ${m['billed_cost_usd']:.6f}",
        highlight=False)
