"""``moefleet platforms list|show``: the platform catalog (prices, memory options, limits)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from moefleet.cli.common import emit_json, out_console, user_errors

app = typer.Typer(
    help="Serverless and rented platforms: prices, memory options, limits.",
    no_args_is_help=True,
)

JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable result on stdout.")]


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def _summary(name: str) -> dict[str, Any]:
    """One catalog row; JSON-ready. Prices in USD, memory in MB, payload in bytes."""
    from moefleet.platform import load_platform

    spec = load_platform(name)
    row: dict[str, Any] = {
        "name": spec.name,
        "kind": spec.kind,
        "provider": spec.provider,
        "memory_min_mb": None,
        "memory_max_mb": None,
        "memory_options": None,
        "price_per_gb_s": None,
        "price_per_hour": None,
        "sync_payload_bytes": None,
    }
    if spec.memory is not None and spec.prices is not None:
        row["memory_min_mb"] = spec.memory.lowest_mb
        row["memory_max_mb"] = spec.memory.highest_mb
        row["memory_options"] = len(spec.memory_options_mb())
        row["price_per_gb_s"] = spec.prices.per_gb_s
    if spec.limits is not None:
        row["sync_payload_bytes"] = spec.limits.sync_payload_bytes
    if spec.hourly is not None:
        row["price_per_hour"] = spec.hourly.price_per_hour
    return row


@app.command("list")
def list_cmd(as_json: JsonOpt = False) -> None:
    """List the catalog's platforms.

    Example: moefleet platforms list --json
    """
    from moefleet.platform import list_platforms

    with user_errors():
        rows = [_summary(n) for n in list_platforms()]
    if as_json:
        emit_json({"platforms": rows})
        return
    t = Table(title="moefleet platforms")
    t.add_column("name", no_wrap=True)
    for col in ("kind", "memory (MB)", "price", "sync payload"):
        t.add_column(col, overflow="fold")
    for r in rows:
        if r["kind"] == "faas":
            mem = f"{r['memory_min_mb']}-{r['memory_max_mb']} ({r['memory_options']} options)"
            price = f"${r['price_per_gb_s']:.4g}/GB-s"
        else:
            mem, price = "-", f"${r['price_per_hour']:g}/h"
        payload = _fmt_bytes(r["sync_payload_bytes"]) if r["sync_payload_bytes"] else "-"
        t.add_row(r["name"], r["kind"], mem, price, payload)
    out_console(False).print(t)


def _flatten(obj: Any, prefix: str = "") -> list[tuple[str, str]]:
    """Dotted field names and printable values, in schema order."""
    if isinstance(obj, dict):
        out: list[tuple[str, str]] = []
        for k, v in obj.items():
            out.extend(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(obj, list) and obj and all(isinstance(x, dict) for x in obj):
        return [kv for i, x in enumerate(obj) for kv in _flatten(x, f"{prefix}[{i}]")]
    if isinstance(obj, list):
        return [(prefix, ", ".join(str(x) for x in obj))]
    return [(prefix, "-" if obj is None else str(obj))]


@app.command("show")
def show_cmd(
    name: Annotated[str, typer.Argument(help="Catalog name (see `list`) or a YAML path.")],
    as_json: JsonOpt = False,
) -> None:
    """Show every field of one platform (units: MB, s, bytes, bytes/s, USD).

    Example: moefleet platforms show aws-lambda-2020
    """
    from moefleet.platform import load_platform

    with user_errors():
        spec = load_platform(name)
    data = spec.model_dump(mode="json", exclude_none=True)
    if spec.memory is not None:
        data["derived"] = {
            "memory_options_count": len(spec.memory_options_mb()),
            "vcpus_at_min_memory": spec.vcpus(spec.memory.lowest_mb),
            "vcpus_at_max_memory": spec.vcpus(spec.memory.highest_mb),
        }
    if as_json:
        emit_json(data)
        return
    t = Table(title=f"platform {spec.name}", show_header=True)
    # Long keys (network.function_bandwidth_bytes_per_s) fold instead of being cut.
    t.add_column("field", style="bold", overflow="fold")
    t.add_column("value", overflow="fold")
    for key, value in _flatten(data):
        t.add_row(key, value)
    out_console(False).print(t)
