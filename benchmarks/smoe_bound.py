"""What any controller could reach in the sMoE scenario: fixed plans and a clairvoyant one.

    python benchmarks/smoe_bound.py [--windows 2] [--patterns slow,normal,bursty]
    python benchmarks/smoe_bound.py --scenario skewed   # -> smoe_bound_skewed.json

Same harness, windows, arrivals and cost rule as ``benchmarks/smoe_cost.py``. Two
families of reference controllers (simulated; not baselines, never trained on):

- ``fixed``: every segment function gets one configuration and every expert another,
  held for the whole window (a grid over the options that matter here);
- ``clairvoyant``: knows the window's future arrivals. It keeps a ``high`` plan while
  a request arrives before the next decision takes effect and a ``low`` plan
  (1 replica, same memory: a memory change would cold-start every function) otherwise.
  No causal controller can scale ahead of a burst better than this one, so its best
  (cost, P95) is a bound on what reactive scaling can do in this scenario.
- ``hotcold`` (skewed scenario only): fixed per-expert plans from the routing trace's
  popularity: experts whose token share is above 1.25 / E of their layer get the ``hot``
  configuration, the others the ``cold`` one (what a popularity-aware static plan can
  reach); ``clairvoyant-hotcold`` switches between such a plan and one replica each.

Writes benchmarks/results/smoe_bound.json: per pattern and controller the cost relative
to the static plan and the median per-window P95 / SLO, and per pattern the cheapest
controller of each family with P95 <= 1.02 x SLO (null when none).
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from moefleet.autoscale.smoe.evaluate import eval_windows
from moefleet.autoscale.smoe.harness import run_episode, window_arrivals
from moefleet.autoscale.smoe.train import (
    DEFAULT_TRACE,
    SCENARIOS,
    scenario_for,
    scenario_setup,
)
from moefleet.control import (
    Decisions,
    FunctionConfig,
    MetricsSnapshot,
    PolicyState,
    ScalingController,
)
from moefleet.io import write_json_atomic

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "smoe_bound.json"
SLACK = 1.02
Pair = tuple[FunctionConfig, FunctionConfig]  # (every segment, every expert)


class PairPolicy(ScalingController):
    """Sets every segment to ``plan(t)[0]`` and every expert to ``plan(t)[1]`` (hot
    experts, named in ``hot``, to ``hot_cfg`` instead while the high plan holds)."""

    def __init__(self, name: str, high: Pair, low: Pair | None = None,
                 arrivals_s: list[float] | None = None, lookahead_s: float = 0.0,
                 hot: frozenset[tuple[int, int]] = frozenset(),
                 hot_cfg: FunctionConfig | None = None) -> None:
        self.name, self.high, self.low = name, high, low
        self.times = arrivals_s or []
        self.lookahead_s = lookahead_s
        self.hot, self.hot_cfg = hot, hot_cfg

    def _busy(self, t: float) -> bool:
        i = bisect.bisect_left(self.times, t)
        return i < len(self.times) and self.times[i] < t + self.lookahead_s

    def decide(self, snapshot: MetricsSnapshot, state: PolicyState) -> tuple[Decisions,
                                                                             PolicyState]:
        busy = self.low is None or self._busy(snapshot.t_s)
        plan = self.high if busy else self.low
        out: Decisions = {}
        for name, m in snapshot.functions.items():
            want = plan[0] if m.kind == "segment" else plan[1]
            if busy and self.hot_cfg is not None and (m.layer, m.expert) in self.hot:
                want = self.hot_cfg
            if m.config != want:
                out[name] = want
        return out, state


def _pair(seg: tuple[int, int, int], exp: tuple[int, int, int]) -> Pair:
    return FunctionConfig(*seg), FunctionConfig(*exp)


def candidates(interval_s: float, apply_s: float) -> dict[str, Any]:
    """name -> factory(arrival times) of every reference controller."""
    out: dict[str, Any] = {}
    for seg in ((4096, 1, 1), (4096, 2, 1), (4096, 1, 2)):
        for exp in ((512, 2, 1), (512, 4, 1), (1024, 1, 1), (1024, 1, 2), (1024, 2, 1),
                    (1024, 2, 2), (2048, 1, 1), (2048, 1, 2)):
            name = f"fixed seg={seg} exp={exp}"
            out[name] = (lambda ts, s=seg, e=exp, n=name: PairPolicy(n, _pair(s, e)))
    low = _pair((4096, 1, 1), (1024, 1, 1))
    for seg, exp in (((4096, 2, 1), (1024, 2, 1)), ((4096, 4, 1), (1024, 2, 1)),
                     ((4096, 2, 1), (1024, 3, 1)), ((4096, 4, 1), (1024, 4, 1))):
        for look in (interval_s + apply_s, 2 * interval_s + apply_s):
            name = f"clairvoyant high=seg{seg}/exp{exp} look={look:g}s"
            out[name] = (lambda ts, s=seg, e=exp, n=name, lk=look:
                         PairPolicy(n, _pair(s, e), low, ts, lk))
    return out


def hot_experts(router: Any, layers: list[int], factor: float = 1.25
                ) -> frozenset[tuple[int, int]]:
    """(layer, expert) of the trace's hot experts: token share > factor / E."""
    import numpy as np

    hot = set()
    for li, (layer, rows) in enumerate(zip(layers, router.ids, strict=True)):
        e = router.num_experts[li]
        share = np.bincount(rows.reshape(-1), minlength=e) / rows.size
        hot |= {(layer, j) for j in range(e) if share[j] > factor / e}
    return frozenset(hot)


def hotcold(hot: frozenset[tuple[int, int]], interval_s: float, apply_s: float
            ) -> dict[str, Any]:
    """Popularity-aware fixed plans and their clairvoyant switching (module doc)."""
    out: dict[str, Any] = {}
    for seg in ((4096, 2, 1), (4096, 1, 2)):
        for h, c in (((1024, 2, 1), (1024, 1, 1)), ((1024, 3, 1), (1024, 1, 1)),
                     ((1024, 2, 2), (1024, 1, 1)), ((2048, 2, 1), (1024, 1, 1)),
                     ((1024, 3, 1), (1024, 2, 1)), ((1024, 4, 1), (1024, 2, 1))):
            name = f"hotcold seg={seg} hot={h} cold={c}"
            out[name] = (lambda ts, s=seg, h=h, c=c, n=name: PairPolicy(
                n, _pair(s, c), hot=hot, hot_cfg=FunctionConfig(*h)))
    low = _pair((4096, 1, 1), (1024, 1, 1))
    for seg, h, c in (((4096, 2, 1), (1024, 2, 1), (1024, 1, 1)),
                      ((4096, 2, 1), (1024, 3, 1), (1024, 1, 1)),
                      ((4096, 2, 1), (1024, 4, 1), (1024, 2, 1))):
        look = interval_s + apply_s
        name = f"clairvoyant-hotcold high=seg{seg}/hot{h}/cold{c} look={look:g}s"
        out[name] = (lambda ts, s=seg, h=h, c=c, n=name, lk=look: PairPolicy(
            n, _pair(s, c), low, ts, lk, hot=hot, hot_cfg=FunctionConfig(*h)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--patterns", default="slow,normal,bursty")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scenario", default="uniform", choices=SCENARIOS)
    ap.add_argument("--routing-trace", default=DEFAULT_TRACE)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    setup = scenario_setup(args.scenario, routing_trace=args.routing_trace)
    sc = scenario_for(setup)
    out_path = args.out or (RESULTS if args.scenario == "uniform" else
                            RESULTS.with_name(f"smoe_bound_{args.scenario}.json"))
    cands = candidates(sc.interval_s, 1.0)
    fams = ["fixed", "clairvoyant"]
    if sc.router is not None:
        cands.update(hotcold(hot_experts(sc.router, list(sc.profile.moe_layers)),
                             sc.interval_s, 1.0))
        fams += ["hotcold", "clairvoyant-hotcold"]
    out: dict[str, Any] = {
        "benchmark": "smoe_bound", "simulated": True, "model": sc.model,
        "scenario": setup.scenario, "routing_trace": setup.routing_trace,
        "platform": sc.spec.name, "slo_s": sc.slo_s, "interval_s": sc.interval_s,
        "mean_rps": setup.mean_rps, "windows_per_pattern": args.windows,
        "note": "reference controllers, not baselines: 'clairvoyant' reads future "
                "arrivals (not causal). Cost relative to the static plan on the same "
                "windows; P95 = median of the windows' P95 over the SLO.",
        "command": " ".join(["python", *sys.argv]), "patterns": {},
    }
    for pattern in [p.strip() for p in args.patterns.split(",") if p.strip()]:
        eps = [window_arrivals(w, setup.mean_rps, args.seed + i)
               for i, w in enumerate(eval_windows(setup, pattern, args.windows))]
        static = [run_episode(sc, None, a, d, seed=args.seed + i) for i, (a, d) in
                  enumerate(eps)]
        ref = sum(r["cost_usd"] for r in static)
        rows: dict[str, Any] = {"static": {
            "cost_vs_static": 1.0,
            "p95_over_slo": statistics.median(r["p95_s"] for r in static) / sc.slo_s}}
        for name, make in cands.items():
            res = [run_episode(sc, make([x.t_s for x in a]), a, d, seed=args.seed + i)
                   for i, (a, d) in enumerate(eps)]
            rows[name] = {"cost_vs_static": sum(r["cost_usd"] for r in res) / ref,
                          "p95_over_slo": statistics.median(r["p95_s"] for r in res)
                          / sc.slo_s,
                          "window_p95_over_slo": [r["p95_s"] / sc.slo_s for r in res]}
            print(f"{pattern} {name}: {rows[name]['cost_vs_static']:.3f} "
                  f"P95/SLO {rows[name]['p95_over_slo']:.3f}", file=sys.stderr, flush=True)
        best: dict[str, Any] = {}
        for fam in fams:
            fam_rows = {n: r for n, r in rows.items() if n.split(" ")[0] == fam}
            ok = {n: r for n, r in fam_rows.items() if r["p95_over_slo"] <= SLACK}
            pick = min(ok, key=lambda n: ok[n]["cost_vs_static"]) if ok else None
            lowest = min(fam_rows, key=lambda n: fam_rows[n]["p95_over_slo"])
            best[fam] = {"cheapest_within_slo": pick,
                         "cost_vs_static": ok[pick]["cost_vs_static"] if pick else None,
                         "lowest_p95": lowest,
                         "lowest_p95_over_slo": fam_rows[lowest]["p95_over_slo"],
                         "lowest_p95_cost_vs_static": fam_rows[lowest]["cost_vs_static"]}
        out["patterns"][pattern] = {"static_cost_usd": ref, "controllers": rows,
                                    "best": best}
    out["wall_s"] = time.perf_counter() - t0
    write_json_atomic(out_path, out)
    for p, r in out["patterns"].items():
        for fam, b in r["best"].items():
            print(f"{p} {fam}: cheapest within {SLACK} x SLO = {b['cheapest_within_slo']} "
                  f"({b['cost_vs_static']}); lowest P95 {b['lowest_p95_over_slo']:.3f} "
                  f"at {b['lowest_p95_cost_vs_static']:.3f} x static")


if __name__ == "__main__":
    main()
