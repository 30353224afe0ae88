"""Views of expert popularity: summary numbers, a terminal table, a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from moefleet.traces.schema import Trace

_BARS = " ▁▂▃▄▅▆▇█"


def routing_summary(trace: Trace) -> dict[str, Any]:
    """Per MoE layer: counts, shares, max/mean load ratio and normalised entropy."""
    counts_LE = trace.popularity()
    layers = []
    for li, layer in enumerate(trace.moe_layers):
        e = trace.num_experts(layer)
        c = counts_LE[li, :e].astype(float)
        share = c / max(1.0, c.sum())
        nz = share[share > 0]
        entropy = float(-(nz * np.log(nz)).sum() / np.log(e)) if e > 1 else 1.0
        layers.append(
            {
                "layer": layer,
                "counts": [int(x) for x in c],
                "share": [round(float(x), 6) for x in share],
                "max_over_mean": float(c.max() / max(1e-9, c.mean())),
                "entropy_norm": round(entropy, 6),
                "hottest_expert": int(c.argmax()),
            }
        )
    return {
        "model": trace.meta.get("model"),
        "dataset": trace.meta.get("dataset"),
        "top_k": trace.top_k,
        "num_requests": trace.meta.get("num_requests"),
        "num_tokens": trace.num_tokens,
        "layers": layers,
    }


def _spark(share: list[float]) -> str:
    top = max(share) if share else 1.0
    return "".join(_BARS[round(s / top * (len(_BARS) - 1))] if top else " " for s in share)


def routing_table(summary: dict[str, Any]) -> Table:
    t = Table(
        title=f"Expert popularity — {summary['model']} on {summary['dataset'] or '?'} "
        f"({summary['num_tokens']} tokens, top-{summary['top_k']})"
    )
    t.add_column("layer", justify="right")
    t.add_column("experts (bar = share)", no_wrap=True)
    t.add_column("hottest", justify="right")
    t.add_column("max/mean", justify="right")
    t.add_column("entropy", justify="right")
    t.add_column("shares %", overflow="fold")
    for row in summary["layers"]:
        t.add_row(
            str(row["layer"]),
            _spark(row["share"]),
            f"E{row['hottest_expert']}",
            f"{row['max_over_mean']:.2f}",
            f"{row['entropy_norm']:.3f}",
            " ".join(f"{100 * s:.0f}" for s in row["share"]),
        )
    return t


def routing_png(summary: dict[str, Any], path: str | Path) -> Path:
    """Heatmap of expert shares per layer (rows layers, columns experts)."""
    from moefleet.report.figures import pyplot, save_png

    plt = pyplot()

    rows = summary["layers"]
    width = max(len(r["share"]) for r in rows)
    grid = np.full((len(rows), width), np.nan)
    for i, r in enumerate(rows):
        grid[i, : len(r["share"])] = r["share"]
    fig, ax = plt.subplots(figsize=(max(4, 0.5 * width + 2), 0.45 * len(rows) + 1.6))
    im = ax.imshow(grid * 100, aspect="auto", cmap="viridis")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(len(rows)), [str(r["layer"]) for r in rows])
    ax.set_xticks(range(width))
    ax.set_title(f"{summary['model']}: share of token slots per expert (%)")
    fig.colorbar(im, ax=ax, label="% of layer's token slots")
    fig.tight_layout()
    return save_png(fig, path, dpi=120)
