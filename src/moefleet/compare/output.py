"""A compare run's output folder: ``results.json`` (atomic), ``pareto.png``/``.svg``
(cost per 1M output tokens vs P95 TPOT, one point per row that ran) and
``arrivals.png`` (requests per interval of the traffic)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from moefleet.errors import MoefleetError
from moefleet.io import write_json_atomic

RESULTS = "results.json"


def check_out_dir(path: Path) -> Path:
    """``path`` as a folder this run can write (created if missing), else a one-line
    error naming it."""
    if path.exists() and not path.is_dir():
        raise MoefleetError(f"-o {path} is a file, not a folder",
                            "give a folder path (it is created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise MoefleetError(f"-o {path}: cannot create the folder ({err.strerror})",
                            "choose a writable location") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise MoefleetError(f"-o {path} is not writable", "choose a writable folder")
    return path


def _atomic_fig(fig: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fig.savefig(tmp, format=path.suffix.lstrip("."), dpi=110, bbox_inches="tight")
    os.replace(tmp, path)


def plot_pareto(data: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["rows"] if r["cost_per_1m_usd"] and r["tpot_p95_s"]]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    fams = sorted({r["family"] for r in rows})
    for fam in fams:
        pts = [r for r in rows if r["family"] == fam]
        ax.scatter([r["tpot_p95_s"] for r in pts], [r["cost_per_1m_usd"] for r in pts],
                   label=fam, s=36)
        for r in pts:
            ax.annotate(r["policy"], (r["tpot_p95_s"], r["cost_per_1m_usd"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    slo = data["inputs"]["slo_tpot_s"]
    ax.axvline(slo, color="grey", ls="--", lw=1, label=f"TPOT SLO {slo:g} s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("P95 TPOT (s)")
    ax.set_ylabel("USD per 1M output tokens")
    ax.set_title(f"{data['inputs']['model']} / {data['inputs']['traffic']}")
    ax.legend(fontsize=7)
    paths = [out / "pareto.png", out / "pareto.svg"]
    for p in paths:
        _atomic_fig(fig, p)
    plt.close(fig)
    return paths


def plot_arrivals(data: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    t = np.asarray(data["arrivals"]["t_s"], float)
    dur = float(data["inputs"]["duration_s"])
    bins = max(1, min(120, int(dur // 10) or 1))
    fig, ax = plt.subplots(figsize=(7.5, 2.6))
    ax.hist(t, bins=bins, range=(0, dur), color="#4477aa")
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"requests / {dur / bins:.0f} s")
    ax.set_title(f"arrivals: {data['inputs']['traffic']} (rate x "
                 f"{data['inputs']['rate_scale']:g}), {len(t)} requests")
    p = out / "arrivals.png"
    _atomic_fig(fig, p)
    plt.close(fig)
    return p


def write_outputs(data: dict[str, Any], out: Path) -> list[Path]:
    check_out_dir(out)
    write_json_atomic(out / RESULTS, data)
    return [out / RESULTS, *plot_pareto(data, out), plot_arrivals(data, out)]
