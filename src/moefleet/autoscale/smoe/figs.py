"""The numbers behind sMoE's Fig. 7 (cost and P95 per model) and Fig. 8 (patterns x
input sizes): one checkpoint against every baseline on held-out windows, normalised to
the best baseline.

The best baseline of a cell is the cheapest baseline whose median window P95 is within
``SLO_SLACK`` x SLO; when none is, the one with the lowest P95 (and
``best_baseline_meets_slo`` is False). Costs are divided by its cost, so the best
baseline is 1.0 and the bar (cost <= 0.75 x best at P95 <= 1.02 x SLO) reads directly
off ``smoe``'s row. Simulated throughout (the harness's cost rule, ``harness.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from moefleet.autoscale.errors import AutoscaleError
from moefleet.autoscale.smoe.evaluate import BASELINES, baseline, evaluate, smoe_factory
from moefleet.autoscale.smoe.harness import Scenario
from moefleet.autoscale.smoe.space import ConfigSpace
from moefleet.autoscale.smoe.train import TrainSetup
from moefleet.control import ScalingController

ExtraFn = Callable[[Scenario, TrainSetup, ConfigSpace],
                   dict[str, Callable[[], ScalingController | None]]]
SLO_SLACK = 1.02  # the bar's P95 slack
COST_BAR = 0.75  # the bar's cost ratio against the best baseline
MAX_PROMPT_TOKENS = 4096  # bounds the simulated pass (a user number)


def best_baseline(rows: dict[str, Any], names: Sequence[str] = BASELINES
                  ) -> tuple[str, bool]:
    """(name, meets the SLO) of the best baseline among ``names`` present in ``rows``."""
    base = {n: r for n, r in rows.items() if n in names}
    if not base:
        raise AutoscaleError("no baseline rows to compare against",
                             f"evaluate at least one of {', '.join(names)}")
    ok = {n: r for n, r in base.items() if r["p95_over_slo"] <= SLO_SLACK}
    if ok:
        return min(ok, key=lambda n: ok[n]["cost_usd"]), True
    return min(base, key=lambda n: base[n]["p95_over_slo"]), False


def normalise(rows: dict[str, Any], learned: str = "smoe",
              names: Sequence[str] = BASELINES) -> dict[str, Any]:
    """One cell: every controller's row plus ``cost_over_best``; the learned
    controller's ``cost_ratio_vs_best_baseline``, ``p95_over_slo`` and the bar."""
    ref, meets = best_baseline(rows, names)
    ctl = {n: {**r, "cost_over_best": r["cost_usd"] / rows[ref]["cost_usd"]}
           for n, r in rows.items()}
    ratio, p95 = ctl[learned]["cost_over_best"], ctl[learned]["p95_over_slo"]
    return {"best_baseline": ref, "best_baseline_meets_slo": meets,
            "cost_ratio_vs_best_baseline": ratio, "p95_over_slo": p95,
            "bar_cost_met": ratio <= COST_BAR, "bar_p95_met": p95 <= SLO_SLACK,
            "controllers": ctl}


def compare(checkpoint: str | Path, *, pattern: str = "bursty", windows: int = 2,
            seed: int = 0, prompt_tokens: int | None = None,
            baselines: Sequence[str] = BASELINES, data_path: str | None = None,
            extra: ExtraFn | None = None,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The checkpoint's best actor (``smoe``) and ``baselines`` on ``windows`` held-out
    windows of ``pattern``, normalised (:func:`normalise`). ``prompt_tokens`` replaces
    the training input size (the SLO stays the checkpoint's); ``static-pop`` is then
    planned for that size, as a planner given the input size would. ``extra`` adds
    reference controllers (named rows, never candidates for the best baseline)."""
    if pattern not in ("slow", "normal", "bursty"):
        raise AutoscaleError(f"unknown pattern {pattern!r}", "use slow, normal or bursty")
    if not 1 <= windows <= 20:
        raise AutoscaleError(f"windows must be in 1..20, got {windows}", "pass --windows 2")
    if prompt_tokens is not None and not 1 <= prompt_tokens <= MAX_PROMPT_TOKENS:
        raise AutoscaleError(f"prompt_tokens must be in 1..{MAX_PROMPT_TOKENS}, got "
                             f"{prompt_tokens}", "e.g. 64")
    unknown = [b for b in baselines if b not in BASELINES]
    if unknown or not baselines:
        raise AutoscaleError(f"unknown or no baselines {unknown or list(baselines)}",
                             f"use some of {', '.join(BASELINES)}")
    sc, setup, make, space = smoe_factory(checkpoint)
    trained_tokens = setup.prompt_tokens
    if prompt_tokens is not None:
        sc = dataclasses.replace(sc, prompt_tokens=prompt_tokens)
        setup = dataclasses.replace(setup, prompt_tokens=prompt_tokens)
    ctls: dict[str, Any] = {"smoe": make}
    for b in baselines:
        ctls[b] = (lambda b=b: baseline(b, sc, space, setup, data_path))
    for name, factory in (extra(sc, setup, space) if extra is not None else {}).items():
        if name in ctls:
            raise AutoscaleError(f"extra controller {name!r} shadows a compared one",
                                 "name reference rows apart from smoe and the baselines")
        ctls[name] = factory
    rows = evaluate(ctls, sc, setup, [pattern], windows, seed, data_path,
                    progress=progress)[pattern]
    return {"model": sc.model, "routing_trace": setup.routing_trace, "slo_s": sc.slo_s,
            "interval_s": sc.interval_s, "pattern": pattern, "windows": windows,
            "prompt_tokens": sc.prompt_tokens, "trained_prompt_tokens": trained_tokens,
            **normalise(rows, "smoe", baselines)}


def _total_wall(hist: list[dict[str, Any]]) -> float:
    """Wall seconds over all (resumed) sessions: each session's clock restarts at 0."""
    total, last = 0.0, 0.0
    for row in hist:
        if row["wall_s"] < last:
            total += last
        last = row["wall_s"]
    return total + last


def training_record(checkpoint: str | Path) -> dict[str, Any]:
    """How a checkpoint was trained: episodes, sessions, wall and CPU seconds (CPU is
    cumulative over resumed sessions; runs from before CPU accounting count from their
    resume), the kept actor's validation and the warm start (without the search table)."""
    from moefleet.autoscale.smoe.train import load_checkpoint

    _, agent, setup, _, hist = load_checkpoint(checkpoint)
    return {"checkpoint": str(checkpoint), "model": setup.model, "episodes": len(hist),
            "wall_s": _total_wall(hist),
            "sessions": 1 + sum(b["wall_s"] < a["wall_s"] for a, b in itertools.pairwise(hist)),
            "cpu_s": hist[-1].get("cpu_s") if hist else None,
            "updates": agent.updates, "kept": agent.best,
            "imitation_floor": agent.cfg.bc_floor,
            "warm_start": {k: v for k, v in agent.warm.items() if k != "search"}}


def summary_line(prefix: str, res: dict[str, Any]) -> str:
    """One progress line for a compared cell: its cost ratio and P95 over the SLO."""
    return (f"{prefix}: cost/best ({res['best_baseline']}) = "
            f"{res['cost_ratio_vs_best_baseline']:.3f}, P95/SLO = {res['p95_over_slo']:.3f}")


def finish_run(out: dict[str, Any], path: Path, started: tuple[float, float],
               plot: Callable[[dict[str, Any], Path], None]) -> None:
    """Stamp a figure run's load, wall and CPU seconds (``started`` = perf_counter,
    process_time at its start), write its JSON atomically and its plot beside it."""
    import os
    import time

    from moefleet.io import write_json_atomic

    out["load_avg_end"] = os.getloadavg()
    out["wall_s"] = time.perf_counter() - started[0]
    out["cpu_s"] = time.process_time() - started[1]
    write_json_atomic(path, out)
    plot(out, path.with_suffix(".png"))
