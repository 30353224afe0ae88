"""``moefleet compare``: every serving policy on one model, traffic and platform(s).

    moefleet compare --model deepseek-v2-lite --traffic azure-llm:conv \\
        --platform alibaba-fc-gpu --slo-ttft 20 --slo-tpot 0.2 --duration 600 -o out/
"""

from __future__ import annotations

import functools
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from moefleet import limits as L
from moefleet.cli.common import emit_json, out_console, user_errors
from moefleet.errors import MoefleetError


def table(data: dict[str, Any]) -> Any:
    from moefleet.report.tables import Col, fit_table, sig3

    cols = [Col("policy", numeric=False), Col("platform", numeric=False),
            Col("$/1M out", drop=0), Col("TTFT p50 s", drop=5), Col("TTFT p95 s"),
            Col("TPOT p50 s", drop=4), Col("TPOT p95 s"), Col("SLO %"),
            Col("cold", drop=3), Col("GPU-s", drop=2), Col("acc. cost", numeric=False,
                                                           drop=7),
            Col("fid.", numeric=False, drop=1)]
    rows = []
    for r in data["rows"]:
        if r["absent"]:
            rows.append([r["policy"], r["platform"], "absent", "-", "-", "-", "-", "-", "-",
                         "-", "-", "-"])
            continue
        slo = r["slo_attainment"]
        rows.append([r["policy"], r["platform"], sig3(r["cost_per_1m_usd"]),
                     sig3(r["ttft_p50_s"]), sig3(r["ttft_p95_s"]), sig3(r["tpot_p50_s"]),
                     sig3(r["tpot_p95_s"]), sig3(None if slo is None else 100 * slo),
                     sig3(r["cold_starts"]), sig3(r["gpu_s"]), r["accuracy_cost"],
                     r["fidelity"][:4]])
    i = data["inputs"]
    return fit_table(f"{i['model']} / {i['traffic']} / SLO TTFT {i['slo_ttft_s']:g} s, "
                     f"TPOT {i['slo_tpot_s']:g} s", cols, rows)


def _measured_model(model: str) -> Any:
    """The model ``--measure`` runs (a zoo model, built), else a one-line error."""
    from moefleet.models import zoo

    if not zoo.has_entry(model):
        raise MoefleetError(f"--measure runs the model for real; '{model}' is an analytical "
                            "shape this machine cannot run",
                            "use --model tiny-moe-lm (or tiny-mixtral-random) with --measure")
    from moefleet.cli.models import load_with_progress

    return load_with_progress(model, False)


def measured_table(data: dict[str, Any]) -> Any:
    from moefleet.report.tables import Col, fit_table, sig3

    cols = [Col("policy", numeric=False), Col("run"), Col("meas. $/1M"), Col("sim. $/1M"),
            Col("cost ratio"), Col("meas. TTFT p95 s"), Col("sim. TTFT p95 s"),
            Col("TTFT ratio"), Col("meas. TPOT p95 s"), Col("sim. TPOT p95 s"),
            Col("TPOT ratio"), Col("TPOT p50 ratio")]
    rows = []
    for m in data["measured"]:
        sim = m.get("simulated", {})
        for i, r in enumerate(m["runs"]):
            if "error" in r:
                rows.append([m["policy"], str(i + 1), "error", *["-"] * 9])
                continue
            rows.append([m["policy"], str(i + 1), sig3(r["cost_per_1m_usd"]),
                         sig3(sim["cost_per_1m_usd"]), sig3(r["cost_ratio"]),
                         sig3(r["ttft_p95_s"]), sig3(sim["ttft_p95_s"]),
                         sig3(r["ttft_p95_ratio"]), sig3(r["tpot_p95_s"]),
                         sig3(sim["tpot_p95_s"]), sig3(r["tpot_p95_ratio"]),
                         sig3(r.get("tpot_p50_ratio"))])
    return fit_table("measured (local backend) vs simulated, same requests", cols, rows)


def compare_cmd(
    model: Annotated[str, typer.Option("--model", "-m", help="Model shape (e.g. "
                                       "deepseek-v2-lite, gpt2-moe, tiny-moe-lm).")] = "gpt2-moe",
    traffic: Annotated[str, typer.Option(help="azure-llm:conv|code, azure-fn-2019:PATTERN, "
                                         "azure-fn-2021:PATTERN, poisson:rate=R.")] = (
        "azure-llm:conv"),
    platform: Annotated[str, typer.Option(help="Platform(s), comma-separated.")] = (
        "alibaba-fc-gpu"),
    slo_ttft: Annotated[float, typer.Option("--slo-ttft", help="TTFT SLO (s).")] = 10.0,
    slo_tpot: Annotated[float, typer.Option("--slo-tpot", help="TPOT SLO (s).")] = 0.2,
    duration: Annotated[float, typer.Option(min=1.0, max=L.MAX_DURATION_S,
                                            help="Seconds of traffic.")] = 600.0,
    rate_scale: Annotated[float, typer.Option("--rate-scale", help="Arrival rate factor.")] = 1.0,
    measure: Annotated[int, typer.Option(min=0, max=20, help="Run the K cheapest feasible "
                                         "policies for real (tiny-moe-lm only).")] = 0,
    seed: Annotated[int, typer.Option(min=0, max=L.MAX_SEED)] = 0,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Output folder.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Results JSON on stdout.")] = False,
    quick: Annotated[bool, typer.Option(help="Fewer simulated requests (a fast check).")] = (
        False),
) -> None:
    """Which deployment is cheapest at my SLO? Every policy, same arrivals, one table.

    Example: moefleet compare --model gpt2-moe --traffic azure-llm:conv --platform
    alibaba-fc-gpu --slo-ttft 10 --slo-tpot 0.2 --duration 300 -o out/
    """
    from moefleet.compare.output import check_out_dir, write_outputs
    from moefleet.compare.run import run_compare

    con = out_console(as_json)
    # rebuilt from the parsed options (not argv): what reproduces this run's rows
    command = " ".join(shlex.quote(a) for a in (
        "moefleet", "compare", "--model", model, "--traffic", traffic, "--platform",
        platform, "--slo-ttft", f"{slo_ttft:g}", "--slo-tpot", f"{slo_tpot:g}",
        "--duration", f"{duration:g}", "--rate-scale", f"{rate_scale:g}", "--seed",
        str(seed), *(["--quick"] if quick else [])))
    with user_errors():
        if out is not None:
            check_out_dir(out)
        adapter = _measured_model(model) if measure else None
        platforms = [p.strip() for p in platform.split(",") if p.strip()]

        def say(msg: str) -> None:
            print(f"compare: {msg}", file=sys.stderr, flush=True)

        runtime_mb = None
        calibrate = None
        if adapter is not None:
            # Plans run for real must start on the local backend, whose function
            # processes hold more than the default footprint: every row plans with it.
            from moefleet.profiles.footprint import measure_runtime_footprint
            from moefleet.profiles.gpu import RUNTIME_MB

            runtime_mb = max(RUNTIME_MB, measure_runtime_footprint("local") / 2**20)
            say(f"local function runtime footprint: {runtime_mb:.0f} MB (every plan "
                "leaves room for it)")
            from moefleet.compare.measure import calibrate_cpu

            # the rows the measured runs are held to take the engine's CPU times
            calibrate = functools.partial(calibrate_cpu, adapter=adapter)
        res = run_compare(model=model, traffic=traffic, platforms=platforms,
                          slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot, duration_s=duration,
                          rate_scale=rate_scale, seed=seed, quick=quick, say=say,
                          command=command, runtime_mb=runtime_mb,
                          calibrate=calibrate)
        if adapter is not None:
            from moefleet.compare.measure import measure as run_measure

            sc = res.built[0]
            mine = [r for r in res.rows if r.platform == sc.spec.name]
            res.measured = run_measure(sc, mine, measure, adapter, say=say)
        data = res.to_dict()
        written = write_outputs(data, out) if out is not None else []
    if as_json:
        emit_json(data)
        return
    con.print(table(data))
    if data["measured"]:
        con.print(measured_table(data))
        for m in data["measured"]:
            if m.get("skipped"):
                con.print(f"{m['policy']}: {m['skipped']}", highlight=False)
            for i, r in enumerate(m["runs"]):
                if "error" in r:
                    con.print(f"{m['policy']} run {i + 1} failed: {r['error']}",
                              highlight=False)
    for r in data["rows"]:
        if r["absent"]:
            con.print(f"[dim]{r['policy']} ({r['platform']}): absent: {r['absent']}[/]")
    con.print(f"[bold]recommendation:[/] {data['recommendation']}")
    con.print(f"[dim]{len(data['rows'])} policies in {data['wall_s']:.0f} s[/]")
    for p in written:
        con.print(f"wrote {p}")
