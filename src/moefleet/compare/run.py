"""Run every policy on one scenario per platform and pick the recommendation.

Recommendation: the cheapest row (cost per 1M output tokens) that meets the SLO (>= 90%
of requests within both SLOs), with the bill term it saves against the cheapest
monolithic row that meets it; when none meets it, the row with the highest attainment
(ties: cheapest) is named as the closest.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moefleet.compare.rows import SLO_TARGET, Row, absent
from moefleet.compare.scenario import Scenario, build_scenario
from moefleet.errors import MoefleetError

Say = Callable[[str], None]
MAX_LISTED = 5000  # arrivals whose lengths the JSON lists one by one
Stage = Callable[[Scenario], list[Row]]


def stages() -> list[tuple[str, Stage]]:
    from moefleet.compare.engine_rows import engine_rows, gpu_engine_row
    from moefleet.compare.ods_rows import ods_rows
    from moefleet.compare.remoe_rows import remoe_rows
    from moefleet.compare.smoe_rows import composed_row, smoe_rows

    return [("monolithic", engine_rows), ("ODS/BO", ods_rows), ("Remoe", remoe_rows),
            ("sMoE", smoe_rows), ("BrownoutServe", lambda sc: [gpu_engine_row(sc, True)]),
            ("composed", lambda sc: [composed_row(sc)])]


@dataclass
class CompareResult:
    inputs: dict[str, Any]
    scenarios: list[dict[str, Any]]
    rows: list[Row]
    recommendation: str
    wall_s: float
    arrivals: dict[str, list[float]] = field(default_factory=dict)
    built: list[Scenario] = field(default_factory=list, repr=False)  # not serialised
    measured: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"inputs": self.inputs, "scenarios": self.scenarios,
                "rows": [r.to_dict() for r in self.rows],
                "recommendation": self.recommendation, "wall_s": self.wall_s,
                "arrivals": self.arrivals, "measured": self.measured}


def recommend(rows: list[Row]) -> str:
    ran = [r for r in rows if r.absent is None and r.cost_per_1m is not None]
    if not ran:
        return "no policy could run on this scenario (see each row's reason)"
    ok = sorted((r for r in ran if r.meets_slo), key=lambda r: r.cost_per_1m or 0.0)
    if not ok:
        best = max(ran, key=lambda r: (r.slo_attainment or 0.0, -(r.cost_per_1m or 0.0)))
        return (f"no policy meets the SLO ({100 * SLO_TARGET:.0f}% of requests within TTFT "
                f"and TPOT); closest: {best.policy} on {best.platform} "
                f"({100 * (best.slo_attainment or 0):.0f}% within, "
                f"${best.cost_per_1m:.3g} per 1M output tokens)")
    win = ok[0]
    text = (f"cheapest meeting the SLO: {win.policy} on {win.platform} at "
            f"${win.cost_per_1m:.3g} per 1M output tokens ({win.fidelity})")
    mono = [r for r in ok if r.family == "monolithic" and r is not win]
    if mono and win.family != "monolithic":
        ref = mono[0]
        ratio = (ref.cost_per_1m or 0) / max(win.cost_per_1m or 1e-300, 1e-300)
        top = _top(ref)
        text += (f", {ratio:.3g}x cheaper than {ref.policy}: it saves on "
                 f"{top[0]} (${top[1]:.3g} there)")
    elif len(ok) > 1:
        nxt = ok[1]
        w_term = _top(win)
        n_term = _top(nxt)
        text += (f"; next {nxt.policy} at ${nxt.cost_per_1m:.3g} pays mostly for "
                 f"{n_term[0]} (${n_term[1]:.3g}), {win.policy} for {w_term[0]} "
                 f"(${w_term[1]:.3g})")
    return text


def _top(row: Row) -> tuple[str, float]:
    """A row's largest bill term (name, USD)."""
    return max(row.bill.items(), key=lambda kv: kv[1], default=("its bill", 0.0))


def run_compare(*, model: str, traffic: str, platforms: list[str], slo_ttft_s: float,
                slo_tpot_s: float, duration_s: float, rate_scale: float = 1.0,
                seed: int = 0, quick: bool = False, say: Say | None = None,
                command: str = "", runtime_mb: float | None = None,
                calibrate: Callable[[Scenario], Any] | None = None) -> CompareResult:
    """Every policy on every platform (inputs are all checked before any policy runs).
    ``runtime_mb``: the functions' runtime footprint every plan leaves room for (default
    :data:`moefleet.profiles.gpu.RUNTIME_MB`; ``--measure`` passes the local one).
    ``calibrate``: measures a scenario's CPU times on this machine (``--measure`` passes
    :func:`moefleet.compare.measure.calibrate_cpu` on the model it runs)."""
    t0 = time.perf_counter()
    if not platforms:
        raise MoefleetError("no platform given", "e.g. --platform alibaba-fc-gpu")
    scs = [build_scenario(model, p, traffic, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s,
                          duration_s=duration_s, rate_scale=rate_scale, seed=seed,
                          quick=quick, runtime_mb=runtime_mb) for p in platforms]
    if calibrate is not None:
        for sc in scs:
            if say is not None:
                say(f"[{sc.spec.name}] timing the engine's CPU step on this machine")
            sc.cpu_cal = calibrate(sc)
    rows: list[Row] = []
    todo = stages()
    for sc in scs:
        for i, (label, stage) in enumerate(todo):
            if say is not None:
                say(f"[{sc.spec.name}] {label} ({i + 1}/{len(todo)}, "
                    f"{time.perf_counter() - t0:.0f} s)")
            try:
                got = stage(sc)
            except MoefleetError as err:  # one family failing leaves the others
                got = [absent(label, label.lower(), sc.spec.name, err.message)]
            seen = {(r.policy, r.platform) for r in rows}
            # the rented server is the same row whichever serverless platform is compared
            rows.extend(r for r in got if (r.policy, r.platform) not in seen)
    for r in rows:
        if not r.command:
            r.command = command
        r.command = f"{r.command}  # from: {command}" if command and command not in \
            r.command else r.command
    inputs = {"model": model, "traffic": traffic, "platforms": platforms,
              "slo_ttft_s": slo_ttft_s, "slo_tpot_s": slo_tpot_s, "duration_s": duration_s,
              "rate_scale": rate_scale, "seed": seed, "quick": quick, "command": command}
    tr = scs[0].traffic
    arrivals: dict[str, Any] = {"t_s": tr.times.round(3).tolist()}
    if len(tr.arrivals) <= MAX_LISTED:  # lengths per request; beyond, the command
        arrivals.update(prompt_tokens=tr.prompts.tolist(),  # reproduces them
                        output_tokens=tr.outputs.tolist())
    return CompareResult(inputs, [sc.describe() for sc in scs], rows, recommend(rows),
                         time.perf_counter() - t0, arrivals, scs)
