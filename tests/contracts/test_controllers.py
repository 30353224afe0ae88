"""One contract over every controller we ship (seam 3 has one shape).

Each case builds a fresh controller and a sequence of windows it is meant to see:
scaling controllers (baselines, FaaSConf-like, static-pop, the popularity rule, sMoE's
actor, a replay) and each wrapper read metrics snapshots of one small pipeline; SALC
reads latency windows. Every controller must be

- a :class:`moefleet.control.Controller` (``name``, ``initial_state``, ``decide``);
- pure: the same window and state give the same decision and next state, and neither
  the window nor the state it was given changes;
- deterministic: two fresh controllers fed the same windows decide the same;
- within bounds: decisions name only functions of the window and obey the case's bounds
  (a wrapper's bounds, the floor, sMoE's configuration space; SALC's [min, 1]);
- fine with an empty window: no functions / no samples -> nothing decided.

A case marked ``acts`` must change something over its windows (and the static plan must
not), so a controller that never decides cannot pass for a correct one.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from moefleet.autoscale import ElasticMoEPolicy, HPAPolicy, make_policy
from moefleet.autoscale.faasconf import FaaSConfLikePolicy, default_ladder
from moefleet.autoscale.smoe import ActorSpec, ConfigSpace, PipelineDAG, SmoeAgent, SmoeController
from moefleet.autoscale.smoe.harness import Recorder
from moefleet.autoscale.smoe.popularity import PlanPolicy, PopRule, PopularityDemonstrator
from moefleet.brownout.salc import SALC, LatencyWindow, SALCDecisions
from moefleet.control import (
    Bounded,
    Controller,
    Deferred,
    FunctionConfig,
    FunctionMetrics,
    MemoryFloor,
    MetricsSnapshot,
    Replayed,
    ScalingBounds,
    StaticPolicy,
)
from moefleet.plan.plan import DeploymentPlan
from moefleet.sim.synthetic import SyntheticModel

SPACE = ConfigSpace(memory_mb=(256, 1024, 4096), replicas=(1, 2), concurrency=(1, 4))
BOUNDS = ScalingBounds(min_replicas=1, max_replicas=3, max_concurrency=2,
                       memory_options_mb=(512, 1024, 2048))
FLOOR_MB = 1536


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _dag() -> PipelineDAG:
    model = SyntheticModel(blocks=2, experts=2, top_k=1, hidden=32, decoder=False)
    prof = model.profile()
    layers = list(prof.moe_layers)
    plan = DeploymentPlan.uniform(model.name, "openfaas-k8s", layers, [2] * len(layers), 2,
                                  1024)
    return PipelineDAG.from_plan(plan, prof)


DAG = _dag()
NAMES = list(DAG.names)


def _metrics(name: str, kind: str, layer: int, load: float, share: float) -> FunctionMetrics:
    calls = round(20 * load)
    return FunctionMetrics(
        name=name, kind=kind, layer=layer, expert=0 if kind == "expert" else None,  # type: ignore[arg-type]
        config=FunctionConfig(1024, 1, 1), instances=1, in_flight=round(2 * load),
        queued=round(load) if load > 1.5 else 0, calls=calls, tokens=50 * calls,
        cold_starts=0, busy_s=3.0 * load, instance_s=10.0, p95_latency_s=0.05 * load,
        token_share=share if kind == "expert" else 0.0,
        request_share=min(1.0, 2 * share) if kind == "expert" else 0.0,
        capacity_tokens_per_s=100.0, interval_s=10.0)


def _snapshot(t: float, load: float) -> MetricsSnapshot:
    """All of the pipeline's functions at ``load`` (the first expert of each layer takes
    most tokens); ``t`` seconds into the run."""
    fm: dict[str, FunctionMetrics] = {}
    for v, name in enumerate(NAMES):
        kind = DAG.kinds[v]
        layer = next((i for i, g in enumerate(DAG.groups[:-1]) if v in g), 0)
        first = kind == "expert" and name.endswith("-0")
        share = 0.75 if first else 0.25
        fm[name] = _metrics(name, kind, layer, load * (1.5 if first else 1.0), share)
    return MetricsSnapshot(t_s=t, interval_s=10.0, functions=fm, arrivals=round(10 * load),
                           completions=round(10 * load), p95_latency_s=0.2 * load,
                           slo_s=0.3, slo_violation_rate=0.5 if load > 1.5 else 0.0)


SNAPSHOTS = [_snapshot(10.0 * (i + 1), load) for i, load in enumerate((0.2, 1.0, 3.0, 3.0, 0.5))]
EMPTY_SNAPSHOT = MetricsSnapshot(t_s=60.0, interval_s=10.0, functions={})


def _window(now: float, ttft_s: float, tpot_s: float, n: int = 12) -> LatencyWindow:
    return LatencyWindow(now, tuple((now - 0.1 * i, ttft_s) for i in range(n)),
                         tuple((now - 0.05 * i, tpot_s) for i in range(n)))


WINDOWS = [_window(1.0, 0.1, 0.05), _window(2.0, 0.4, 0.3), _window(3.0, 0.5, 0.2),
           _window(3.5, 0.5, 0.2), _window(4.0, 0.1, 0.05), _window(9.0, 0.1, 0.05)]


def _check_config(cfg: FunctionConfig) -> None:
    assert cfg.memory_mb > 0 and cfg.replicas >= 1 and cfg.concurrency >= 1


def _within(bounds: ScalingBounds, memory: bool = True) -> Callable[[Any, Any], None]:
    def check(decisions: dict[str, FunctionConfig], window: MetricsSnapshot) -> None:
        for cfg in decisions.values():
            assert bounds.min_replicas <= cfg.replicas <= bounds.max_replicas
            assert bounds.min_concurrency <= cfg.concurrency <= bounds.max_concurrency
            assert not memory or cfg.memory_mb in bounds.memory_options_mb
    return check


def _floored(decisions: dict[str, FunctionConfig], window: MetricsSnapshot) -> None:
    assert all(cfg.memory_mb >= FLOOR_MB for cfg in decisions.values())


def _in_space(decisions: dict[str, FunctionConfig], window: MetricsSnapshot) -> None:
    assert all(cfg in SPACE.configs for cfg in decisions.values())


def _thresholds(salc: SALC) -> Callable[[Any, Any], None]:
    def check(decisions: SALCDecisions, window: LatencyWindow) -> None:
        for d, cfg in ((decisions.prefill, salc.prefill), (decisions.decode, salc.decode)):
            assert cfg.min_threshold <= d.threshold <= 1.0
    return check


def _salc_empty(decisions: SALCDecisions, state: Any) -> None:
    assert {decisions.prefill.action, decisions.decode.action} <= {"no-data", "wait"}


def _scaling_empty(decisions: dict[str, FunctionConfig], state: Any) -> None:
    assert decisions == {}


@dataclass
class Case:
    make: Callable[[], Any]
    windows: Sequence[Any] = tuple(SNAPSHOTS)
    empty: Any = EMPTY_SNAPSHOT
    bounds: Callable[[Any, Any], None] | None = None
    on_empty: Callable[[Any, Any], None] = _scaling_empty
    acts: bool | None = True  # None: may or may not decide over these windows


def _smoe() -> SmoeController:
    agent = SmoeAgent(DAG, SPACE, ActorSpec(hidden=8), seed=0)
    return SmoeController(agent, 0.3, lambda mb, share: mb * 1e-8)


def _replayed() -> Replayed:
    a, b = NAMES[0], NAMES[-1]
    return Replayed([(11.0, a, FunctionConfig(2048, 2, 1)), (31.0, b, FunctionConfig(512)),
                     (31.0, "gone", FunctionConfig(512))], interval_s=10.0)


_SALC = SALC(slo_ttft_s=0.3, slo_tpot_s=0.15, window_s=2.0, interval_s=1.0, min_threshold=0.2)
RULE = PopRule(rho=2.0, segment=FunctionConfig(1024, 2, 1), max_replicas=3)

CASES: dict[str, Case] = {
    "salc": Case(lambda: SALC(slo_ttft_s=0.3, slo_tpot_s=0.15, window_s=2.0, interval_s=1.0,
                              min_threshold=0.2),
                 windows=WINDOWS, empty=LatencyWindow(10.0), bounds=_thresholds(_SALC),
                 on_empty=_salc_empty),
    "static": Case(StaticPolicy, acts=False),
    "hpa": Case(lambda: HPAPolicy(target=1.0)),
    "hpa-rps": Case(lambda: HPAPolicy(target=1.0, metric="rps")),
    "elasticmoe": Case(lambda: ElasticMoEPolicy(0.7)),
    "faasconf": Case(lambda: FaaSConfLikePolicy(0.3, 3, default_ladder((512, 1024, 2048),
                                                                       (1, 2)))),
    "static-pop": Case(lambda: PlanPolicy("static-pop", {n: FunctionConfig(2048, 2, 1)
                                                          for n in NAMES[:2]})),
    "pop-demo": Case(lambda: PopularityDemonstrator(RULE)),
    "smoe": Case(_smoe, bounds=_in_space, acts=None),  # an untrained actor may stay
    "replayed": Case(_replayed),
    "bounded": Case(lambda: Bounded(HPAPolicy(), BOUNDS, upscale_delay_s=10.0,
                                    downscale_delay_s=25.0, tolerance=0.1),
                    bounds=_within(BOUNDS)),
    "make_policy-elasticmoe": Case(lambda: make_policy("elasticmoe", BOUNDS),
                                   bounds=_within(BOUNDS)),
    "deferred": Case(lambda: Deferred(ElasticMoEPolicy(), start_s=25.0)),
    "memory-floor": Case(lambda: MemoryFloor(FaaSConfLikePolicy(
        0.3, 3, default_ladder((512, 1024, 2048), (1, 2))), dict.fromkeys(NAMES, FLOOR_MB)),
        bounds=_floored),
    "recorder": Case(lambda: Recorder(HPAPolicy(), lambda mb, share: mb * 1e-8,
                                      {NAMES[0]: FunctionConfig(1024, 2, 1)})),
    "nested": Case(lambda: MemoryFloor(Deferred(Bounded(ElasticMoEPolicy(), BOUNDS), 15.0),
                                       dict.fromkeys(NAMES, FLOOR_MB)),
                   # the floor is outermost: above the bounds' memory options
                   bounds=lambda d, w: (_within(BOUNDS, memory=False)(d, w), _floored(d, w))),
}


def _same(a: Any, b: Any) -> bool:
    """Deep equality that also compares tensors (sMoE's state holds some)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and bool(torch.equal(a, b)))
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(
            _same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, tuple | list):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b, strict=True)))
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(_same(a[k], b[k]) for k in a))
    return bool(a == b)


def _run(ctl: Any, windows: Sequence[Any]) -> list[tuple[Any, Any]]:
    state = ctl.initial_state()
    out = []
    for w in windows:
        decision, state = ctl.decide(w, state)
        out.append((decision, state))
    return out


@pytest.fixture(params=list(CASES), ids=list(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    return CASES[request.param]


def test_is_a_controller(case: Case) -> None:
    ctl = case.make()
    assert isinstance(ctl, Controller)
    assert isinstance(ctl.name, str) and ctl.name


def test_pure_same_input_same_output_nothing_mutated(case: Case) -> None:
    ctl = case.make()
    state = ctl.initial_state()
    for w in case.windows:
        w_before, s_before = copy.deepcopy(w), copy.deepcopy(state)
        d1, s1 = ctl.decide(w, state)
        d2, s2 = ctl.decide(w, state)  # the same window and state again
        assert _same(d1, d2) and _same(s1, s2)
        assert _same(w, w_before), "the window was mutated"
        assert _same(state, s_before), "the state it was given was mutated"
        state = s1


def test_deterministic_across_fresh_instances(case: Case) -> None:
    a, b = _run(case.make(), case.windows), _run(case.make(), case.windows)
    assert all(_same(x, y) for x, y in zip(a, b, strict=True))


def test_decisions_within_bounds(case: Case) -> None:
    changed = False
    for w, (decision, _) in zip(case.windows, _run(case.make(), case.windows), strict=True):
        if isinstance(decision, SALCDecisions):
            changed |= any(d.action in ("shrink", "grow") for d in decision)
        else:
            assert set(decision) <= set(w.functions), "decided for an unknown function"
            for cfg in decision.values():
                _check_config(cfg)
            changed |= any(cfg != w.functions[n].config for n, cfg in decision.items())
        if case.bounds is not None:
            case.bounds(decision, w)
    if case.acts is not None:
        assert changed == case.acts, ("expected decisions over these windows" if case.acts
                                      else "a controller that never decides decided")


def test_handles_an_empty_window(case: Case) -> None:
    ctl = case.make()
    decision, state = ctl.decide(case.empty, ctl.initial_state())
    case.on_empty(decision, state)
    # and a later non-empty window still works from that state
    ctl.decide(case.windows[0], state)
