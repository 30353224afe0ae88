"""sMoE warm start: the popularity-aware demonstrator, behaviour cloning, static-pop."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from moefleet.autoscale.smoe import ActorSpec, ConfigSpace, DDPGConfig, SmoeAgent, SmoeController
from moefleet.autoscale.smoe.graph import PipelineDAG
from moefleet.autoscale.smoe.harness import build_scenario
from moefleet.autoscale.smoe.imitation import agreement, pretrain
from moefleet.autoscale.smoe.popularity import (
    PlanPolicy,
    PopRule,
    PopularityDemonstrator,
    pop_plan,
    predicted_shares,
)
from moefleet.control import FunctionConfig, FunctionMetrics, MetricsSnapshot, StaticPolicy
from moefleet.predict.synthetic import synthetic_trace
from moefleet.traces.schema import write_trace

TINY = "synthetic:blocks=2,experts=4,top_k=2,hidden=64,decoder=0"
SPACE = ConfigSpace(memory_mb=(1024, 4096), replicas=(1, 2, 4), concurrency=(1, 2))
RULE = PopRule(1.25, FunctionConfig(4096, 1, 2), max_replicas=4)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _snapshot(dag: PipelineDAG, shares: dict[str, float], config: FunctionConfig,
              layer_tokens: int = 400) -> MetricsSnapshot:
    """Every expert at ``config``; an expert's tokens = its share x its layer's tokens."""
    fm = {}
    for v, name in enumerate(dag.names):
        expert = dag.kinds[v] == "expert"
        share = shares.get(name, 0.0) if expert else 0.0
        tok = round(share * layer_tokens)
        fm[name] = FunctionMetrics(
            name=name, kind="expert" if expert else "segment", layer=int(name.split("-")[1]),
            expert=int(name.split("-")[2]) if expert else None,
            config=config if expert else FunctionConfig(4096, 2, 1), instances=1,
            calls=max(1, tok // 8), tokens=tok, busy_s=0.5, instance_s=10.0,
            p95_latency_s=0.1, token_share=share, request_share=0.5 if expert else 0.0,
            interval_s=10.0)
    return MetricsSnapshot(t_s=10.0, interval_s=10.0, functions=fm, arrivals=20,
                           completions=20, p95_latency_s=0.2)


def _shares(dag: PipelineDAG, rng: random.Random) -> dict[str, float]:
    out: dict[str, float] = {}
    for g in dag.groups[:-1]:
        w = [rng.uniform(0.05, 1.0) ** 2 for _ in g]
        out.update({dag.names[v]: x / sum(w) for v, x in zip(g, w, strict=True)})
    return out


def _dag() -> PipelineDAG:
    sc = build_scenario(TINY, slo_s=0.5)
    return PipelineDAG.from_plan(sc.plan, sc.profile)


def test_demonstrator_gives_hot_experts_more_replicas() -> None:
    dag = _dag()
    shares = {"exp-0-0": 0.5, "exp-0-1": 0.25, "exp-0-2": 0.15, "exp-0-3": 0.10,
              "exp-1-0": 0.25, "exp-1-1": 0.25, "exp-1-2": 0.25, "exp-1-3": 0.25}
    snap = _snapshot(dag, shares, FunctionConfig(1024, 2, 1))
    demo = PopularityDemonstrator(RULE)
    out, state = demo.decide(snap, demo.initial_state())
    # load 2.0 -> round(2.5) = 3 replicas; 1.0 -> 1 (1.25 rounds down); 0.6, 0.4 -> 1
    assert out["exp-0-0"] == FunctionConfig(1024, 3, 1)
    assert [out[f"exp-0-{i}"].replicas for i in (1, 2, 3)] == [1, 1, 1]
    assert all(out[f"exp-1-{i}"].replicas == 1 for i in range(4))  # uniform layer
    assert out["seg-0"] == RULE.segment and out["seg-1"] == RULE.segment
    # An interval in which layer 0 routed nothing keeps its averaged shares (no
    # scale-down of the hot expert between bursts); the memory is never changed.
    idle = _snapshot(dag, {**{f"exp-0-{i}": 0.0 for i in range(4)},
                           **{k: v for k, v in shares.items() if k.startswith("exp-1")}},
                     FunctionConfig(2048, 3, 1))
    out2, _ = demo.decide(idle, state)
    assert "exp-0-0" not in out2  # already at 3 replicas of its own memory
    assert out2["exp-0-1"] == FunctionConfig(2048, 1, 1)


def test_behaviour_cloning_moves_the_actors_argmax_toward_the_demonstrator() -> None:
    dag = _dag()
    agent = SmoeAgent(dag, SPACE, ActorSpec(hidden=16, stay_prior=0.0),
                      DDPGConfig(bc_lr=5e-3, batch_size=16, warmup=10**6), seed=1)
    rng = random.Random(0)
    ctl = SmoeController(agent, 0.5, lambda mb, gpu=0.0: 1e-5 * mb, learn=True,
                         behaviour=StaticPolicy(), teacher=PopularityDemonstrator(RULE, 1.0))
    state = ctl.initial_state()
    starts = [FunctionConfig(1024, r, 1) for r in (1, 2, 4)]
    for i in range(97):  # 96 labelled transitions (each stored one interval later)
        snap = _snapshot(dag, _shares(dag, rng), starts[i % 3])
        _, state = ctl.decide(snap, state)
    labelled = [t for t in agent.replay if t.target_N is not None]
    assert len(labelled) == 96
    # the labels are per expert: some experts are told to hold more replicas than others
    assert len({int(t) for t in labelled[0].target_N}) > 1
    held_out = labelled[-16:]
    before = agreement(agent.actor, held_out)
    agent.replay = type(agent.replay)(labelled[:-16], maxlen=agent.replay.maxlen)
    stats = pretrain(agent, 300)
    after = agreement(agent.actor, held_out)
    assert stats["agreement_after"] > stats["agreement_before"]
    assert after >= max(0.85, before + 0.3), (before, after)
    # on a new state, the clone gives the hot expert more replicas than the cold one
    snap = _snapshot(dag, {"exp-0-0": 0.55, "exp-0-1": 0.2, "exp-0-2": 0.15, "exp-0-3": 0.1,
                           **{f"exp-1-{i}": 0.25 for i in range(4)}}, FunctionConfig(1024, 2, 1))
    act, _ = SmoeController(agent, 0.5, lambda mb, gpu=0.0: 1e-5 * mb).decide(
        snap, (None, None, None))
    hot = act.get("exp-0-0", snap.functions["exp-0-0"].config).replicas
    cold = act.get("exp-0-3", snap.functions["exp-0-3"].config).replicas
    assert hot > cold


def test_static_pop_plan_uses_the_training_half_of_the_trace(tmp_path: Path) -> None:
    path = write_trace(synthetic_trace(40, moe_layers=(0, 1), num_experts=4, top_k=2,
                                       seed=0), tmp_path / "t.parquet")
    sc = build_scenario(TINY, slo_s=0.5, routing_trace=str(path))
    router = sc.routing()
    shares = predicted_shares(sc)
    first = sorted(router.request_index, key=router.request_index.__getitem__)[:20]
    rows = [router.request_index[r] for r in first]
    for li in range(2):
        want = router.replay_RE[li][rows].sum(axis=0)
        got = np.array([shares[f"exp-{li}-{e}"] for e in range(4)])
        assert got == pytest.approx(want / want.sum())
    full = np.array([shares[f"exp-0-{e}"] for e in range(4)])
    whole = router.replay_RE[0].sum(axis=0)
    assert not np.allclose(full, whole / whole.sum())  # not the whole trace
    plan = pop_plan(sc, PopRule(2.0, FunctionConfig(4096, 1, 2)), shares)
    loads = {n: s * 4 for n, s in shares.items()}
    hot, cold = max(loads, key=loads.__getitem__), min(loads, key=loads.__getitem__)
    assert plan[hot].replicas > plan[cold].replicas
    assert plan["seg-0"] == FunctionConfig(4096, 1, 2)
    pol = PlanPolicy("static-pop", plan)
    snap = _snapshot(PipelineDAG.from_plan(sc.plan, sc.profile), {}, FunctionConfig(1024, 2, 1))
    first_out, st = pol.decide(snap, pol.initial_state())
    assert first_out[hot] == plan[hot] and pol.decide(snap, st)[0] == {}
