"""The demo's report: a terminal table and a two-panel PNG (ODS/BO Fig. 14 analogue).

Rows: the serverless plans (BO, oracle = ODS on the workload's real counts, unadjusted =
ODS on the predictor's counts without BO, LambdaML) and the CPU cluster.
Columns: MoE cost by the analytical model on the workload's real routing, the bill the
local runtime measured for the same workload, throughput (model and measured), whether
the plan meets the SLO, and cost relative to the oracle plan.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from moefleet.report.tables import Col, fit_table, sig3

ORDER = ("bo", "oracle", "unadjusted", "lambdaml", "cpu_cluster")
LABELS = {"bo": "BO + ODS", "oracle": "oracle", "unadjusted": "unadjusted",
          "lambdaml": "LambdaML", "cpu_cluster": "CPU cluster"}


def _rows(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    plans = report["plans"]
    return [(k, plans[k]) for k in ORDER if k in plans]


def demo_table(report: dict[str, Any]) -> Table:
    """Costs in USD to 3 significant digits; on a narrow terminal latency, throughput
    and the run/model ratio are left out (``--json`` has them)."""
    oracle = report["plans"]["oracle"]["cost_usd"]
    cols = [Col("plan", numeric=False), Col("MoE cost, model (USD)"), Col("× oracle"),
            Col("latency (s)", drop=2), Col("SLO"), Col("MoE bill, run (USD)"),
            Col("run / model", drop=1), Col("tokens/s, run", drop=3)]
    rows = []
    for key, row in _rows(report):
        cost = row["moe_prorated_usd"] if key == "cpu_cluster" else row["cost_usd"]
        m = row.get("measured") or {}
        ran = bool(m) and "error" not in m
        rows.append([LABELS[key], sig3(cost), sig3(cost / oracle), sig3(row["latency_s"]),
                     "met" if row["slo_met"] else "NO",
                     sig3(m["moe_cost_usd"]) if ran else ("failed" if m else "-"),
                     sig3(m["moe_cost_usd"] / cost) if ran else "-",
                     sig3(m["throughput_tokens_per_s"]) if ran else "-"])
    title = (f"{report['model']} on {report['platform']}: "
             f"{report['workload']['tokens']:,} tokens of {report['workload']['dataset']}, "
             f"SLO {sig3(report['slo_s'])} s")
    return fit_table(title, cols, rows)


def demo_png(report: dict[str, Any], path: str | Path) -> Path:
    from moefleet.report.figures import pyplot, save_png

    plt = pyplot()

    rows = _rows(report)
    names = [LABELS[k] for k, _ in rows]
    model_cost = [r["moe_prorated_usd"] if k == "cpu_cluster" else r["cost_usd"]
                  for k, r in rows]
    measured = [(r.get("measured") or {}).get("moe_cost_usd", 0.0) for _, r in rows]
    tput = [r["throughput_tokens_per_s"] for _, r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(rows))
    ax1.bar([i - 0.2 for i in x], model_cost, 0.4, label="analytical model")
    if any(measured):
        ax1.bar([i + 0.2 for i in x], measured, 0.4, label="measured (local runtime)")
    ax1.set_xticks(list(x), names, rotation=20, ha="right")
    ax1.set_yscale("log")  # LambdaML is ~20x the others: a linear axis hides them
    ax1.set_ylabel("billed cost of all MoE layers (USD, log)")
    ax1.set_title("cost per workload (cluster: busy seconds only)")
    ax1.legend()
    ax2.bar(list(x), tput, color="tab:green")
    ax2.set_xticks(list(x), names, rotation=20, ha="right")
    ax2.set_ylabel("tokens / s (analytical model)")
    ax2.set_title(f"throughput (SLO {report['slo_s']:.2f} s)")
    fig.suptitle(f"{report['model']} on {report['platform']}")
    fig.tight_layout()
    save_png(fig, Path(path), dpi=110)
    return Path(path)
