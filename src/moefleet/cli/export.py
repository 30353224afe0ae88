"""``moefleet export PLAN --format openfaas|knative|ray-serve``: manifests to apply."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from moefleet.cli.common import check_outputs, is_stdout, out_console, user_errors, write_data
from moefleet.errors import MoefleetError


def export_cmd(
    plan: Annotated[Path, typer.Argument(help="Plan YAML.")],
    fmt: Annotated[str, typer.Option("--format", "-f", help="openfaas|knative|ray-serve.")],
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Write YAML here (default, or -: stdout).")] = None,
    image: Annotated[str, typer.Option(help="Container image of the functions.")] = (
        "moefleet/function:latest"),
    decisions: Annotated[Path | None, typer.Option(
        help="JSON {function: {memory_mb, replicas, concurrency}} overriding the plan "
             "(a controller's current decisions).")] = None,
) -> None:
    """Write Kubernetes/Ray manifests for a plan's functions.

    Example: moefleet export plan.yaml --format knative -o services.yaml
    """
    with user_errors():
        check_outputs(("--out", out), stdout=("--out",))
        from moefleet.control import FunctionConfig
        from moefleet.plan import DeploymentPlan
        from moefleet.plan.export import export
        from moefleet.platform import load_platform

        p = DeploymentPlan.load(plan)
        dec = None
        if decisions is not None:
            try:
                raw = json.loads(decisions.read_text())
                dec = {k: FunctionConfig(int(v["memory_mb"]), int(v.get("replicas", 1)),
                                         int(v.get("concurrency", 1)),
                                         float(v.get("gpu_share", 0.0)))
                       for k, v in raw.items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                raise MoefleetError(f"cannot read decisions {decisions}: {err}",
                                    'write {"exp-0-1": {"memory_mb": 1024, "replicas": 2}}'
                                    ) from None
        spec = load_platform(p.platform)
        p.check_platform(spec)  # a plan its platform cannot run is not exported
        text = export(p, fmt, spec, image=image, decisions=dec)
        write_data(out or "-", text)
        if out is not None and not is_stdout(out):
            out_console(False).print(f"wrote {out} ({fmt})", highlight=False)
