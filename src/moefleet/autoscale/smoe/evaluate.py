"""Evaluate controllers on held-out Azure windows in the harness (same scenario, same
arrivals, same cost accounting for all).

Controllers by name: ``static`` (the uniform starting plan), ``static-pop`` (the
popularity-aware static plan ServerlessMoE's ODS would deploy from *predicted* expert
popularity, see :mod:`moefleet.autoscale.smoe.popularity`: shares from the training
half of the routing trace, the rule chosen on training windows only), ``hpa``
(OpenFaaS-style requests-per-second HPA), ``elasticmoe``, ``faasconf`` (FaaSConf-like,
see :mod:`moefleet.autoscale.faasconf`), and any sMoE checkpoint (``smoe`` and its
ablations). Held-out: training uses a pattern's first ``windows_per_pattern`` windows
(busiest first); evaluation takes the ones after them.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moefleet.autoscale.baselines import ElasticMoEPolicy, HPAPolicy
from moefleet.autoscale.errors import AutoscaleError
from moefleet.autoscale.faasconf import FaaSConfLikePolicy, default_ladder
from moefleet.autoscale.smoe.harness import (
    Scenario,
    pattern_windows,
    run_episode,
    window_arrivals,
)
from moefleet.autoscale.smoe.popularity import (
    PlanPolicy,
    candidate_rules,
    pop_plan,
    predicted_shares,
    search_static_pop,
)
from moefleet.autoscale.smoe.space import ConfigSpace
from moefleet.autoscale.smoe.train import TrainSetup, controller_from_checkpoint
from moefleet.control import Bounded, ScalingBounds, ScalingController
from moefleet.errors import UnknownNameError

BASELINES = ("static", "static-pop", "hpa", "elasticmoe", "faasconf")
HPA_RPS_PER_REPLICA = 10.0  # ASSUMPTION: OpenFaaS-style rps target per replica


def baseline(name: str, sc: Scenario, space: ConfigSpace, setup: TrainSetup | None = None,
             data_path: str | None = None) -> ScalingController | None:
    """A baseline controller (None = the static plan), wrapped in the shared bounds and
    delays where it scales. ``static-pop`` needs the ``setup`` (its training windows)."""
    bounds = ScalingBounds(1, space.replicas[-1], 1, space.concurrency[-1])
    if name == "static":
        return None
    if name == "static-pop":
        if setup is None:
            raise AutoscaleError("the static-pop baseline needs the training setup",
                                 "pass the checkpoint's setup")
        plan = static_pop(sc, setup, space, data_path)["plan"]
        return None if plan is None else PlanPolicy("static-pop", plan)
    if name == "hpa":
        return Bounded(HPAPolicy(HPA_RPS_PER_REPLICA, "rps"), bounds,
                             downscale_delay_s=3 * sc.interval_s, tolerance=0.1)
    if name == "elasticmoe":
        return Bounded(ElasticMoEPolicy(), bounds, downscale_delay_s=3 * sc.interval_s,
                             tolerance=0.1)
    if name == "faasconf":
        hops = 2 * len(sc.profile.segments) + len(sc.plan.layers)
        return FaaSConfLikePolicy(sc.slo_s, hops, default_ladder(space.memory_mb[1:],
                                                                  space.replicas))
    raise UnknownNameError(f"unknown controller {name!r}",
                           f"use one of {', '.join(BASELINES)} or an sMoE checkpoint path")


_STATIC_POP: dict[tuple[Any, ...], dict[str, Any]] = {}


def static_pop(sc: Scenario, setup: TrainSetup, space: ConfigSpace,
               data_path: str | None = None) -> dict[str, Any]:
    """The static-pop plan of a setup (searched once per process on the training
    validation windows): ``plan`` (None = no candidate met the SLO there, so the
    uniform starting plan stands), ``rule`` and the search ``table``."""
    key = (setup, space.fingerprint(), data_path)
    if key not in _STATIC_POP:
        from moefleet.autoscale.smoe.train import Validation

        val = Validation(sc, setup, data_path)
        rule, table = search_static_pop(sc, val.episodes,
                                        candidate_rules(sc, max_replicas=space.replicas[-1],
                                                        gpu_shares=space.gpu_share))
        shares = predicted_shares(sc)
        _STATIC_POP[key] = {
            "rule": None if rule is None else rule.label(), "table": table,
            "plan": None if rule is None else pop_plan(sc, rule, shares),
            "predicted_shares": shares}
    return _STATIC_POP[key]


def eval_windows(setup: TrainSetup, pattern: str, count: int,
                 data_path: str | None = None) -> list[Any]:
    found = pattern_windows(pattern, minutes=setup.window_minutes, path=data_path)
    held = found[setup.windows_per_pattern:setup.windows_per_pattern + count]
    if not held:
        raise AutoscaleError(f"no held-out {pattern} windows left after the "
                             f"{setup.windows_per_pattern} training windows",
                             "train on fewer windows per pattern")
    return held


def evaluate(controllers: dict[str, Callable[[], ScalingController | None]], sc: Scenario,
             setup: TrainSetup, patterns: list[str], windows: int, seed: int = 0,
             data_path: str | None = None,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Per pattern and controller: total cost, P95 over all windows' requests (median of
    the windows' P95s), share of intervals within the SLO, decision latency; each
    window's P95 / SLO and the P95 / SLO of every control interval that served requests
    (with its end time); and the alive-pod seconds per function kind and GPU share
    (which shares a controller used)."""
    out: dict[str, Any] = {}
    for pattern in patterns:
        ws = eval_windows(setup, pattern, windows, data_path)
        rows: dict[str, Any] = {}
        for name, make in controllers.items():
            costs, p95s, ok, dec, series = [], [], [], [], []
            pods: dict[str, dict[str, float]] = {}
            for i, w in enumerate(ws):
                arrivals, duration = window_arrivals(w, setup.mean_rps, seed + i, data_path)
                r = run_episode(sc, make(), arrivals, duration, seed=seed + i)
                costs.append(r["cost_usd"])
                p95s.append(r["p95_s"])
                ok += [p <= sc.slo_s for p in r["window_p95_s"]]
                dec += r["decide_s"]
                series.append({"t_s": r["window_t_s"],
                               "p95_over_slo": [p / sc.slo_s for p in r["window_p95_s"]]})
                for kind, shares in r["pod_s_by_gpu_share"].items():
                    for share, secs in shares.items():
                        pods.setdefault(kind, {})[share] = pods.get(kind, {}).get(share,
                                                                                 0.0) + secs
                if progress is not None:
                    progress(f"{pattern} {name} window {i + 1}/{len(ws)}")
            rows[name] = {
                "cost_usd": sum(costs), "p95_s": statistics.median(p95s),
                "p95_over_slo": statistics.median(p95s) / sc.slo_s,
                "intervals_within_slo": sum(ok) / len(ok) if ok else 1.0,
                "decision_latency_s": statistics.median(dec) if dec else 0.0,
                "pod_s_by_gpu_share": pods,
                "windows": [f"{w.function[:8]}@{w.start_minute} cv={w.cv:.2f}" for w in ws],
                "window_p95_over_slo": [p / sc.slo_s for p in p95s],
                "interval_p95_over_slo": series,  # per window: served intervals only
            }
        out[pattern] = rows
    return out


def smoe_factory(path: str | Path) -> tuple[Scenario, TrainSetup,
                                            Callable[[], ScalingController], ConfigSpace]:
    """A checkpoint's scenario, setup, controller factory (acting only) and space."""
    sc, ctl, setup = controller_from_checkpoint(path)

    def make() -> ScalingController:
        ctl.log.decide_s.clear()
        return ctl

    return sc, setup, make, ctl.agent.space
