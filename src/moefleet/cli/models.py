"""``moefleet models list|info|build``."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from moefleet.cli.common import emit_json, err_console, out_console, progress, user_errors
from moefleet.errors import MoefleetError

app = typer.Typer(help="The model zoo and any supported checkpoint.", no_args_is_help=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable result on stdout.")]


@app.command("list")
def list_cmd(as_json: JsonOpt = False) -> None:
    """List zoo models and whether they are built.

    Example: moefleet models list --json
    """
    from moefleet.models import supported_architectures, zoo

    rows = []
    for name in zoo.names():
        e = zoo.get_entry(name)
        rows.append(
            {
                "name": name,
                "description": e.description,
                "built": zoo.is_built(name),
                "path": str(zoo.model_dir(name)),
                "tags": list(e.tags),
            }
        )
    from moefleet.models.real_shapes import RANDOM_NOTE, SHAPES

    for shape in SHAPES.values():  # built on load, nothing cached: never "built"
        rows.append({"name": shape.name, "description": f"{shape.hub_id}'s published "
                     f"config, {shape.num_layers} layers (NAME:layers=N for a slice); "
                     f"{RANDOM_NOTE}", "built": False, "path": "", "tags": ["real-shape",
                                                                          "random"]})
    if as_json:
        emit_json({"models": rows, "supported_architectures": supported_architectures()})
        return
    t = Table(title="moefleet model zoo")
    for col in ("name", "built", "description"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(str(r["name"]), "yes" if r["built"] else "no", str(r["description"]))
    con = out_console(False)
    con.print(t)
    con.print(
        "Any local checkpoint or hub id of these architectures works too: "
        + ", ".join(supported_architectures())
    )


def load_with_progress(model: str, json_mode: bool,
                       dtype: str | None = None):  # -> MoEModelAdapter
    """Load a model (in ``dtype``: None keeps the checkpoint's); a zoo model that is not
    built yet is built with a progress bar."""
    from moefleet.models import load_adapter, zoo

    if zoo.has_entry(model) and not zoo.is_built(model):
        build_with_progress(model, force=False)
    return load_adapter(model, dtype=dtype)


def build_with_progress(name: str, force: bool) -> None:
    from moefleet.models import zoo

    with progress() as bar:
        task = bar.add_task(f"building {name}", total=None)

        def on_progress(done: int, total: int, desc: str) -> None:
            bar.update(task, completed=done, total=total, description=f"{name}: {desc}")

        def on_wait(msg: str) -> None:
            err_console.print(f"[yellow]note:[/] {msg}", highlight=False)

        zoo.build(name, force=force, progress=on_progress, on_wait=on_wait)


@app.command("build")
def build_cmd(
    name: Annotated[str, typer.Argument(help="Zoo model name (see `moefleet models list`).")],
    force: Annotated[bool, typer.Option(help="Rebuild even if cached.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Build a zoo model into the cache (once; later calls reuse it).

    Example: moefleet models build minilm-moe-e8
    """
    from moefleet.models import zoo

    with user_errors():
        zoo.get_entry(name)
        cached = zoo.is_built(name) and not force
        build_with_progress(name, force)
        report = zoo.build_report(name) or {}
    if as_json:
        emit_json(report)
    elif cached:  # nothing was done: say so, not the build's whole report
        out_console(False).print(
            f"{name} is already built -> {zoo.model_dir(name)} (details: moefleet models "
            f"info {name}; rebuild: --force)", highlight=False)
    else:
        out_console(False).print(f"[green]built[/] {name} -> {zoo.model_dir(name)}")
        for k, v in report.items():
            if k not in ("recipe",):
                out_console(False).print(f"  {k}: {v}")


@app.command("info")
def info_cmd(
    model: Annotated[str, typer.Argument(help="Zoo name, checkpoint directory or hub id.")],
    as_json: JsonOpt = False,
) -> None:
    """Structure and sizes of a model: layers, MoE layers, experts, top-k, bytes.

    Example: moefleet models info tiny-mixtral-random
    """
    from dataclasses import asdict

    from moefleet.models import zoo
    from moefleet.models.base import param_bytes

    with user_errors():
        if zoo.has_entry(model) and not zoo.is_built(model):
            # info is a quick look: it never starts a (possibly long) build.
            raise MoefleetError(f"zoo model {model} is not built yet",
                                f"build it first: moefleet models build {model}")
        from moefleet.models import load_adapter

        adapter = load_adapter(model)
        info: dict[str, Any] = asdict(adapter.summary())
        layer0 = adapter.moe_layers[0]
        info["bytes_per_expert"] = param_bytes(adapter.expert_view(layer0, 0))
        info["bytes_per_segment"] = [
            param_bytes(adapter.segment(layer)) for layer in range(adapter.num_layers)
        ]
        if zoo.has_entry(model):
            info["build"] = zoo.build_report(model)
    if as_json:
        emit_json(info)
        return
    t = Table(title=f"{info['name']} ({info['family']})", show_header=False)
    for key in ("num_layers", "moe_layers", "num_experts", "top_k", "hidden_size",
                "vocab_size", "causal"):
        t.add_row(key, str(info[key]))
    mb = 1024 * 1024
    t.add_row("expert params", f"{info['expert_param_bytes'] / mb:.2f} MiB")
    t.add_row("non-expert params", f"{info['non_expert_param_bytes'] / mb:.2f} MiB")
    t.add_row("one expert", f"{info['bytes_per_expert'] / 1024:.1f} KiB")
    out_console(False).print(t)
