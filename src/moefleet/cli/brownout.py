"""``moefleet brownout distill``: united experts for a model (BrownoutServe)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from moefleet.cli.common import emit_json, out_console, progress, user_errors
from moefleet.report.tables import Col, fit_table, sig3

app = typer.Typer(help="BrownoutServe: united experts and brownout routing.",
                  no_args_is_help=True)


def _parse_ways(text: str) -> list[int]:
    from moefleet.brownout.groups import BrownoutError

    try:
        out = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise BrownoutError(f"--ways {text!r} is not a list of integers",
                            "write e.g. --ways 2,4,8") from None
    if not out:
        raise BrownoutError(f"--ways {text!r} is empty", "write e.g. --ways 2,4,8")
    return out


@app.command("distill")
def distill_cmd(
    model: Annotated[str, typer.Option(help="Zoo name or checkpoint (e.g. tiny-moe-lm-e32).")],
    ways: Annotated[str, typer.Option(help="Experts per united expert, e.g. 2,4,8.")] = "2,4,8",
    grouping: Annotated[str, typer.Option(help="index (the paper) or similarity.")] = "index",
    calib_tokens: Annotated[int, typer.Option(help="Calibration tokens (1..1M).")] = 32768,
    max_epochs: Annotated[int, typer.Option(help="Epoch cap per united expert (1..1000).")] = 40,
    max_pairs: Annotated[int, typer.Option(
        help="Routed pairs kept per member expert (1..1M).")] = 4096,
    force: Annotated[bool, typer.Option(help="Distill again even if cached.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Reports as JSON on stdout.")] = False,
) -> None:
    """Distill united experts (one per group of WAYS experts, per MoE layer); cached.

    Example: moefleet brownout distill --model tiny-moe-lm-e32 --ways 2,4,8 --grouping similarity
    """
    from moefleet.brownout.distill import DistillConfig, distill
    from moefleet.brownout.groups import BrownoutError, check_ways
    from moefleet.brownout.united import check_grouping_kind
    from moefleet.cli.models import load_with_progress

    reports: list[dict[str, Any]] = []
    with user_errors():
        ways_list = _parse_ways(ways)
        check_grouping_kind(grouping)
        if not 1 <= calib_tokens <= 1_000_000:
            raise BrownoutError(f"--calib-tokens {calib_tokens} is out of range", "use 1..1000000")
        if not 1 <= max_epochs <= 1000:
            raise BrownoutError(f"--max-epochs {max_epochs} is out of range", "use 1..1000")
        if not 1 <= max_pairs <= 1_000_000:
            raise BrownoutError(f"--max-pairs {max_pairs} is out of range", "use 1..1000000")
        adapter = load_with_progress(model, as_json)
        for k in ways_list:
            for layer in adapter.moe_layers:
                check_ways(k, adapter.num_experts(layer))
        cfg = DistillConfig(calib_tokens=calib_tokens, max_epochs=max_epochs,
                            max_pairs_per_expert=max_pairs)
        for k in ways_list:
            with progress() as bar:
                task = bar.add_task(f"{model} ways={k}", total=None)

                def on_progress(done: int, total: int, desc: str, k: int = k,
                                task: Any = task) -> None:
                    bar.update(task, completed=done, total=total,
                               description=f"ways={k} {desc}")

                united = distill(adapter, k, grouping, cfg, progress=on_progress, force=force)
            reports.append(united.report)
    if as_json:
        emit_json({"model": model, "grouping": grouping, "reports": reports})
        return
    con = out_console(False)
    cols = [Col("layer"), Col("groups"), Col("rel. error (average init)"),
            Col("rel. error (distilled)")]
    for rep in reports:
        rows = [[str(lay["layer"]), str(len(lay["groups"])), sig3(lay["rel_err_init"]),
                 sig3(lay["rel_err"])] for lay in rep["layers"]]
        con.print(fit_table(f"{model}: {rep['ways']}-way united experts "
                            f"({rep['grouping']} grouping)", cols, rows, width=con.width))
