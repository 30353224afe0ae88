"""sMoE: DAG and features, the memory filter, gradient flow, a tiny DDPG run."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from moefleet.autoscale.smoe import (
    NUM_FEATURES,
    ActorSpec,
    ConfigSpace,
    DDPGConfig,
    PipelineDAG,
    SmoeAgent,
    SmoeController,
    node_features,
    soft_action,
)
from moefleet.control import FunctionConfig, FunctionMetrics, MetricsSnapshot
from moefleet.plan.plan import DeploymentPlan
from moefleet.sim.synthetic import SyntheticModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")


SPACE = ConfigSpace(memory_mb=(256, 1024, 4096), replicas=(1, 2), concurrency=(1, 4))


def _dag(blocks: int = 3, experts: int = 4, moe: list[int] | None = None) -> PipelineDAG:
    model = SyntheticModel(blocks=blocks, experts=experts, top_k=2, hidden=64, decoder=False)
    prof = model.profile()
    if moe is not None:  # some blocks without experts
        prof = dataclasses.replace(prof, moe_layers=moe,
                                   experts={b: prof.experts[b] for b in moe})
    layers = list(prof.moe_layers)
    plan = DeploymentPlan.uniform(model.name, "openfaas-k8s", layers, [experts] * len(layers),
                                  blocks, 1024)
    return PipelineDAG.from_plan(plan, prof)


def _snapshot(dag: PipelineDAG, tokens: dict[str, int], p95: float = 0.1) -> MetricsSnapshot:
    fm = {}
    for v, name in enumerate(dag.names):
        expert = dag.kinds[v] == "expert"
        tok = tokens.get(name, 0)
        layer_total = 1
        if expert:
            g = next(g for g in dag.groups[:-1] if v in g)
            layer_total = sum(tokens.get(dag.names[u], 0) for u in g) or 1
        fm[name] = FunctionMetrics(
            name=name, kind="expert" if expert else "segment",
            layer=int(name.split("-")[1]),
            expert=0 if expert else None, config=FunctionConfig(1024, 1, 1), instances=1,
            calls=max(1, tok // 16), tokens=tok, busy_s=0.5, instance_s=10.0,
            p95_latency_s=p95 * (1 + tok / 100), token_share=tok / layer_total if expert else 0.0,
            request_share=0.5 if expert else 0.0, interval_s=10.0)
    return MetricsSnapshot(t_s=10.0, interval_s=10.0, functions=fm, arrivals=20, completions=20,
                           p95_latency_s=p95)


def test_dag_edges_levels_and_groups() -> None:
    dag = _dag(blocks=3, experts=4)
    assert dag.names[:6] == ("seg-0", "exp-0-0", "exp-0-1", "exp-0-2", "exp-0-3", "seg-1")
    seg1 = dag.names.index("seg-1")
    assert set(dag.preds[seg1]) == {1, 2, 3, 4}  # gather: all experts of layer 0
    assert dag.preds[1] == (0,)
    levels = dag.levels()
    assert levels[0] == [0] and levels[1] == [1, 2, 3, 4] and levels[2] == [seg1]
    for lv in levels:  # topological batching: predecessors strictly earlier
        for v in lv:
            assert all(dag.depth[u] < dag.depth[v] for u in dag.preds[v])
    assert [len(g) for g in dag.groups] == [4, 4, 4, 3]
    idx, mask = dag.group_index()
    assert idx.shape == (4, 4) and mask.sum() == 15 and not bool(mask[3, 3])


def test_dag_block_without_experts_links_segments() -> None:
    dag = _dag(blocks=3, experts=2, moe=[0, 2])
    s1, s2 = dag.names.index("seg-1"), dag.names.index("seg-2")
    assert dag.preds[s2] == (s1,)
    assert len(dag.groups) == 3  # two MoE layers + segments


def test_features_reflect_layer_skew() -> None:
    dag = _dag(blocks=2, experts=4)
    opts = (SPACE.memory_mb, SPACE.replicas, SPACE.concurrency)
    even = {f"exp-{b}-{i}": 40 for b in range(2) for i in range(4)}
    skew = dict(even, **{"exp-0-0": 400, "exp-0-1": 0, "exp-0-2": 0, "exp-0-3": 0})
    x_even, _ = node_features(dag, _snapshot(dag, even), 0.2, opts)
    x_skew, peak = node_features(dag, _snapshot(dag, skew), 0.2, opts)
    assert x_even.shape == (dag.num_nodes, NUM_FEATURES)
    e00 = dag.names.index("exp-0-0")
    assert x_even[e00, 13].item() == pytest.approx(1.0)  # routing entropy / log K
    assert x_skew[e00, 13].item() == pytest.approx(0.0)
    assert x_skew[e00, 11].item() == pytest.approx(1.0)  # token share
    assert x_skew[e00, 15].item() == pytest.approx(1.0)  # it is the straggler
    assert x_skew[dag.names.index("exp-0-1"), 15].item() < 1.0
    assert peak[e00] > peak[dag.names.index("exp-0-1")]
    assert torch.isfinite(x_skew).all()


def test_memory_filter_masks_configs_before_scoring() -> None:
    dag = _dag(blocks=2, experts=2)
    n = dag.num_nodes
    params = torch.full((n,), 100 * 2**20)  # 100 MB of weights: 256 MB does not fit
    valid = SPACE.valid_mask(params, torch.zeros(n), 4096)
    cfgs = SPACE.configs
    small = [i for i, c in enumerate(cfgs) if c.memory_mb == 256]
    assert not valid[:, small].any() and valid[:, [i for i in range(len(cfgs))
                                                   if i not in small]].all()
    # Many tokens in flight per call: high concurrency no longer fits 1024 MB.
    big = SPACE.valid_mask(params, torch.full((n,), 20_000.0), 4096)
    c1024x4 = [i for i, c in enumerate(cfgs) if c.memory_mb == 1024 and c.concurrency == 4]
    assert not big[:, c1024x4].any()
    agent = SmoeAgent(dag, SPACE, seed=0)
    x = torch.randn(1, n, NUM_FEATURES)
    scores = agent.actor(x, valid[None])
    assert torch.isinf(scores[0][:, small]).all()
    probs = soft_action(scores)
    assert probs[0][:, small].sum().item() == 0.0
    assert torch.allclose(probs.sum(-1), torch.ones(1, n))
    for _ in range(20):  # exploration never picks an invalid config
        act = agent.act(x[0], valid, explore=True)
        assert bool(valid[torch.arange(n), act].all())


def test_nothing_fits_keeps_largest_memory() -> None:
    valid = SPACE.valid_mask(torch.full((2,), 10_000 * 2**20), torch.zeros(2), 4096)
    assert valid.sum(1).tolist() == [2, 2]  # 4096 MB x (1, 2) replicas, concurrency 1


@pytest.mark.parametrize("spec", [ActorSpec(), ActorSpec(dagnn=False),
                                  ActorSpec(pointer=False), ActorSpec(flat=True)])
def test_policy_gradient_reaches_every_actor_parameter(spec: ActorSpec) -> None:
    """Fails if the soft action is replaced by an arg-max (or any non-differentiable
    selection) anywhere between the critic and the actor's parameters."""
    dag = _dag(blocks=2, experts=3)
    agent = SmoeAgent(dag, SPACE, spec, seed=1)
    x = torch.randn(4, dag.num_nodes, NUM_FEATURES)
    x[:, :, 3:6] = SPACE.vectors()[5, :3]  # a current config, so the stay prior acts
    valid = torch.ones(4, dag.num_nodes, SPACE.size, dtype=torch.bool)
    valid[:, :, 0] = False
    agent.actor.zero_grad()
    agent.critic.zero_grad()
    agent.actor_loss(x, valid).backward()
    for name, p in agent.actor.named_parameters():
        assert p.grad is not None, f"no gradient reaches {name}"
        assert float(p.grad.abs().sum()) > 0, f"zero gradient at {name}"


def test_pointer_ignores_padding() -> None:
    dag = _dag(blocks=2, experts=3)  # groups: 3, 3, 2 segments (one padded slot)
    agent = SmoeAgent(dag, SPACE, seed=2)
    ptr = agent.actor.pointer
    h = torch.randn(1, 3, ptr.v.in_features)
    mask = torch.tensor([[True, True, False]])
    out1, w1 = ptr(h, mask)
    h2 = h.clone()
    h2[0, 2] = 100.0  # garbage in the padded slot
    out2, _w2 = ptr(h2, mask)
    assert w1[0, 2].item() == 0.0
    assert torch.allclose(out1[0, :2], out2[0, :2], atol=1e-5)


def test_tiny_training_run_in_the_simulator() -> None:
    from moefleet.autoscale.smoe.harness import build_scenario, run_episode
    from moefleet.workloads import load_workload

    sc = build_scenario("synthetic:blocks=2,experts=2,top_k=1,hidden=64,decoder=0",
                        slo_s=0.2, interval_s=2.0, prompt_tokens=16)
    dag = PipelineDAG.from_plan(sc.plan, sc.profile)
    agent = SmoeAgent(dag, SPACE, ActorSpec(hidden=16),
                      DDPGConfig(warmup=8, batch_size=8), seed=0)
    ctl = SmoeController(agent, sc.slo_s, sc.price_per_s, learn=True)
    before = [p.detach().clone() for p in agent.actor.parameters()]
    arrivals = load_workload("poisson:rate=5").arrivals(40.0, 0)
    out = run_episode(sc, ctl, arrivals, 40.0)
    assert out["completed"] == len(arrivals) and out["cost_usd"] > 0
    assert len(agent.replay) >= 15 and agent.updates > 0  # ~one per 2 s interval
    assert all(math.isfinite(r) and r <= 0 for r in ctl.log.rewards)
    assert any(not torch.equal(b, p) for b, p in zip(before, agent.actor.parameters(),
                                                     strict=True))


def test_snapshot_layer_metrics() -> None:
    dag = _dag(blocks=2, experts=4)
    tokens = {"exp-0-0": 300, "exp-0-1": 100, "exp-1-0": 50, "exp-1-1": 50, "exp-1-2": 50,
              "exp-1-3": 50}
    snap = _snapshot(dag, tokens)
    layers = snap.layers({0: 2e6})
    assert set(layers) == {0, 1}
    assert layers[0].tokens == 400 and layers[1].tokens == 200
    assert layers[0].routing_entropy == pytest.approx(-(0.75 * math.log(0.75)
                                                        + 0.25 * math.log(0.25)))
    assert layers[1].routing_entropy == pytest.approx(math.log(4))  # uniform
    assert layers[0].straggler_ratio["exp-0-0"] == pytest.approx(1.0)
    assert layers[0].straggler_ratio["exp-0-1"] == pytest.approx(0.2 / 0.4)
    assert layers[0].gflops == pytest.approx(400 * 2e6 / 1e9) and layers[1].gflops == 0
    assert layers[0].latency_variance_s2 > 0 and layers[1].latency_variance_s2 == 0


def test_exploration_steps_to_a_neighbour_and_keeps_memory() -> None:
    dag = _dag(blocks=2, experts=2)
    n = dag.num_nodes
    agent = SmoeAgent(dag, SPACE, ActorSpec(hidden=8), DDPGConfig(epsilon=1.0), seed=0)
    cfgs = SPACE.configs
    start = SPACE.index_of(FunctionConfig(1024, 1, 1))
    valid = torch.ones(n, SPACE.size, dtype=torch.bool)
    scores = torch.zeros(n, SPACE.size)
    for _ in range(10):
        act = agent.explore(torch.full((n,), start), valid, scores)
        for a in act.tolist():
            c, s = cfgs[a], cfgs[start]
            assert c.memory_mb == s.memory_mb and c != s  # moved, memory kept
            assert (c.replicas != s.replicas) + (c.concurrency != s.concurrency) == 1
    near = SPACE.neighbours(memory=True)
    assert near.equal(near.T) and not near.diagonal().any()
    assert int(near[start].sum()) == 4  # memory 256/4096, replicas 2, concurrency 4


def test_slo_term_charges_every_group() -> None:
    from moefleet.autoscale.smoe import group_rewards

    dag = _dag(blocks=2, experts=2)
    snap = _snapshot(dag, {}, p95=0.4)  # SLO 0.2: P95 is twice the SLO
    price = lambda mb, gpu=0.0: 1e-5 * mb / 1024  # noqa: E731
    every = group_rewards(dag, snap, 0.2, price, DDPGConfig(slo_weight=2.0))
    last = group_rewards(dag, snap, 0.2, price,
                         DDPGConfig(slo_weight=2.0, slo_every_group=False))
    ok = group_rewards(dag, _snapshot(dag, {}, p95=0.1), 0.2, price, DDPGConfig())
    assert torch.allclose(every - ok, torch.full_like(every, -2.0))  # 2 x (0.2-0.4)/0.2
    assert torch.allclose((last - ok)[:-1], torch.zeros(len(dag.groups) - 1))
    assert (last - ok)[-1].item() == pytest.approx(-2.0)


@pytest.mark.parametrize("spec", [ActorSpec(hidden=8), ActorSpec(hidden=8, flat=True)])
def test_untrained_actor_keeps_the_current_configs(spec: ActorSpec) -> None:
    dag = _dag(blocks=2, experts=2)
    agent = SmoeAgent(dag, SPACE, spec, seed=3)
    x, _ = node_features(dag, _snapshot(dag, {"exp-0-0": 40}), 0.2,
                         (SPACE.memory_mb, SPACE.replicas, SPACE.concurrency))
    valid = torch.ones(dag.num_nodes, SPACE.size, dtype=torch.bool)
    act = agent.act(x, valid, explore=False)
    here = SPACE.index_of(FunctionConfig(1024, 1, 1))
    assert act.tolist() == [here] * dag.num_nodes
    bare = SmoeAgent(dag, SPACE, dataclasses.replace(spec, stay_prior=0.0), seed=3)
    assert bare.act(x, valid, explore=False).tolist() != [here] * dag.num_nodes
