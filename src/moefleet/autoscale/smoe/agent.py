"""DDPG for sMoE: actor + critic with target networks, a replay memory, and the
controller that acts (and optionally learns) once per control interval.

The MDP (our reading of the paper's section 4.4): within a timestep the agent decides
the decision groups one after the other (MoE layers in order, then the segments); the
state does not change between them. Group g gets reward r_g = -beta * cost_g /
cost_ref_g; every group (``slo_every_group``; only the last one before) also gets
lambda * (SLO - P95) / SLO when P95 > SLO (eq. 13, both terms made unit-free so one
beta fits every model). The TD target of group g < G-1 is
``r_g + gamma * Q'(s_t, g+1, pi'(s_t))``; of the last group
``r_G + gamma * Q'(s_{t+1}, 0, pi'(s_{t+1}))``.

Training feeds the critic the *soft* action (softmax over valid scores), so the actor
loss -Q(s, softmax(actor(s))) has a gradient; the arg-max is used only to act. The
critic learns from the executed (one-hot) actions in the replay memory.

Why the knobs are what they are (diagnosed on the 4x8 scenario, see README):
- ``slo_weight`` (eq. 13's weight on the SLO term): at weight 1 halving every expert's
  replicas earns more reward than a P95 30% over the SLO costs, so the reward's optimum
  is an SLO-breaking plan; the SLO term is scaled so a violation outweighs the savings.
- Exploration samples from the soft action *restricted to neighbouring configurations*
  (one option step in replicas or concurrency, same memory). Uniform random configs
  changed memory on several functions per interval; each memory change cold-starts the
  function, so every exploring interval broke the SLO and the rewards measured the
  noise, not the policy (even one-step memory moves at 5% per function gave the static
  plan a P95 of 8x the SLO). Memory still changes whenever the actor's arg-max says so.
- The SLO term goes to every group. Q of group g sees only group g's action, and the
  bootstrap from group g+1 evaluates the *target* policy's action, so with the term on
  the last group only, no layer's Q ever depended on the SLO damage its own config did:
  every expert group learned "cheaper is better", and longer training walked the
  experts down to configs that broke the SLO by 100x. Each layer's latency is part of
  the end-to-end P95, so each group is charged for it.
- The critic uses a Huber loss: SLO penalties are one to two orders above cost terms.
- ``bc_floor``: with the imitation term faded to 0, the critic alone walked the cloned
  actor to SLO-breaking plans (README); a floor keeps part of the teacher's pull.
"""

from __future__ import annotations

import copy
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from moefleet.autoscale.errors import AutoscaleError
from moefleet.autoscale.smoe.graph import PipelineDAG, node_features, num_features
from moefleet.autoscale.smoe.imitation import teacher_loss
from moefleet.autoscale.smoe.nets import ActorSpec, SmoeActor, SmoeCritic, soft_action
from moefleet.autoscale.smoe.space import ConfigSpace
from moefleet.control import Decisions, MetricsSnapshot, PolicyState, ScalingController


@dataclass(frozen=True)
class DDPGConfig:
    gamma: float = 0.9
    tau: float = 0.02
    actor_lr: float = 3e-4
    critic_lr: float = 1e-3
    batch_size: int = 16
    replay_size: int = 20_000
    warmup: int = 64  # transitions before the first update
    updates_per_step: int = 1
    beta: float = 0.1  # the reward's cost coefficient (eq. 13)
    slo_penalty_cap: float = 4.0  # the SLO term is clipped at -cap (units of the SLO)
    slo_weight: float = 2.0  # weight of the SLO term (eq. 13 has 1; see the module doc)
    slo_every_group: bool = True  # the SLO term on every group, not the last only
    temperature: float = 1.0
    explore_local: bool = True  # explore along neighbouring configs from the soft action
    huber: bool = True  # Huber critic loss instead of MSE
    epsilon: float = 0.03  # exploration: chance a function moves to another valid config
    epsilon_min: float = 0.02
    epsilon_decay: float = 0.995  # per control interval
    bc_weight: float = 1.0  # imitation of demonstration transitions, fading out ...
    bc_updates: int = 3000  # ... linearly over this many updates ...
    bc_floor: float = 0.0  # ... but never below this weight (0 = fades out entirely)
    bc_pretrain_steps: int = 600  # behaviour cloning of the teacher before DDPG ...
    bc_lr: float = 3e-3  # ... with its own optimiser at this rate

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bc_floor) and 0.0 <= self.bc_floor <= 10.0):
            raise AutoscaleError(f"imitation floor must be in [0, 10], got {self.bc_floor!r}",
                                 "e.g. --imitation-floor 0.1")


@dataclass
class Transition:
    x_NF: torch.Tensor
    valid_NC: torch.Tensor
    action_N: torch.Tensor
    reward_G: torch.Tensor
    x2_NF: torch.Tensor
    valid2_NC: torch.Tensor
    demo: bool = False  # the action came from a demonstrating controller
    slo_ok: bool = True  # the interval it ran in met the SLO (only those are imitated)
    target_N: torch.Tensor | None = None  # the teacher's config per node (-1 = none)


def imitation_weight(cfg: DDPGConfig, updates: int) -> float:
    """The imitation term's weight after ``updates`` DDPG updates: ``bc_weight`` fading
    linearly to 0 over ``bc_updates``, held at ``bc_floor`` from where it would go lower.
    Invariant: ``bc_floor <= weight <= max(bc_floor, bc_weight)``. The
    floor keeps the critic's gradient from walking the actor away from the teacher's
    clone once the fade is over (README, sMoE training)."""
    fade = cfg.bc_weight * max(0.0, 1.0 - updates / max(cfg.bc_updates, 1))
    return max(cfg.bc_floor, fade)


def group_rewards(dag: PipelineDAG, snap: MetricsSnapshot, slo_s: float,
                  price_per_s: Callable[[int, float], float], cfg: DDPGConfig) -> torch.Tensor:
    """Eq. 13 per decision group from the snapshot of the interval the action ran in.
    Cost of a function = its alive-instance seconds x the price per second of its
    memory and GPU share (pods hold their request while alive); the reference is one
    1024 MB CPU instance per function for the interval."""
    ref = price_per_s(1024, 0.0) * snap.interval_s
    out = torch.zeros(len(dag.groups))
    for gi, g in enumerate(dag.groups):
        cfgs = [snap.functions[dag.names[v]].config for v in g]
        cost = sum(snap.functions[dag.names[v]].instance_s
                   * price_per_s(c.memory_mb, c.gpu_share) for v, c in zip(g, cfgs, strict=True))
        out[gi] = -cfg.beta * cost / (ref * len(g))
    slo = cfg.slo_weight * slo_term(snap, slo_s, cfg.slo_penalty_cap)
    if cfg.slo_every_group:
        out += slo
    else:
        out[-1] += slo
    return out


def slo_term(snap: MetricsSnapshot, slo_s: float, cap: float) -> float:
    """(SLO - P95) / SLO when P95 exceeds the SLO, else 0. An interval that completed
    nothing while requests wait counts its whole length as the P95 (stalling must not
    look free)."""
    p95 = snap.p95_latency_s
    if snap.completions == 0 and snap.in_flight_requests > 0:
        p95 = max(p95, snap.interval_s)
    if p95 <= slo_s:
        return 0.0
    return max(-cap, (slo_s - p95) / slo_s)


class SmoeAgent:
    """Networks, targets, optimisers and replay for one (pipeline, config space)."""

    def __init__(self, dag: PipelineDAG, space: ConfigSpace, spec: ActorSpec | None = None,
                 ddpg: DDPGConfig | None = None, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.rng = random.Random(seed)
        self.dag, self.space = dag, space
        self.spec = spec or ActorSpec()
        self.cfg = ddpg or DDPGConfig()
        gidx, gmask = dag.group_index()
        cvec = space.vectors()
        nf = num_features(space.has_gpu)
        self.actor = SmoeActor(self.spec, nf, dag.pred_mask(), dag.levels(), gidx, gmask, cvec)
        self.critic = SmoeCritic(nf, max(self.spec.hidden, 32), gidx, gmask, cvec)
        self.actor_t = copy.deepcopy(self.actor)
        self.critic_t = copy.deepcopy(self.critic)
        for p in (*self.actor_t.parameters(), *self.critic_t.parameters()):
            p.requires_grad_(False)
        self.opt_a = torch.optim.Adam(self.actor.parameters(), lr=self.cfg.actor_lr)
        self.opt_c = torch.optim.Adam(self.critic.parameters(), lr=self.cfg.critic_lr)
        self.neighbours_CC = space.neighbours()
        self.replay: deque[Transition] = deque(maxlen=self.cfg.replay_size)
        self.epsilon = self.cfg.epsilon
        # Model selection (see train.py): the best-validated actor and its score.
        self.best: dict[str, float] | None = None
        self.actor_best: dict[str, torch.Tensor] | None = None
        # Warm start record (train.py): the teacher's rule, its search, the cloning.
        self.warm: dict[str, Any] = {}
        self.steps = 0
        self.updates = 0

    # ---- acting ---------------------------------------------------------------------
    @torch.no_grad()
    def act(self, x_NF: torch.Tensor, valid_NC: torch.Tensor, explore: bool) -> torch.Tensor:
        """Config index per node: the arg-max of the scores (never an invalid one)."""
        scores_NC = self.actor(x_NF[None], valid_NC[None])[0]
        action_N = scores_NC.argmax(dim=-1)
        return self.explore(action_N, valid_NC, scores_NC) if explore else action_N

    def explore(self, action_N: torch.Tensor, valid_NC: torch.Tensor,
                scores_NC: torch.Tensor | None = None) -> torch.Tensor:
        """With chance epsilon per function, another valid config: with
        ``explore_local`` one drawn from the soft action over the neighbours of the
        given one (uniform over them without scores), else uniform over all valid
        configs. An invalid given action always becomes a valid one."""
        action_N = action_N.clone()
        for v in range(action_N.shape[0]):
            a = int(action_N[v])
            if not bool(valid_NC[v, a]):
                action_N[v] = self.rng.choice(torch.nonzero(valid_NC[v]).flatten().tolist())
                continue
            if self.rng.random() >= self.epsilon:
                continue
            if not self.cfg.explore_local:
                action_N[v] = self.rng.choice(torch.nonzero(valid_NC[v]).flatten().tolist())
                continue
            near = torch.nonzero(self.neighbours_CC[a] & valid_NC[v]).flatten().tolist()
            if not near:
                continue
            if scores_NC is None:
                action_N[v] = self.rng.choice(near)
            else:
                p = torch.softmax(scores_NC[v, near] / self.cfg.temperature, dim=0).tolist()
                action_N[v] = self.rng.choices(near, weights=p)[0]
        return action_N

    # ---- learning -------------------------------------------------------------------
    def remember(self, t: Transition) -> None:
        self.replay.append(t)

    def update(self) -> dict[str, float]:
        """One DDPG step on a replay batch (no-op before ``warmup`` transitions)."""
        cfg = self.cfg
        if len(self.replay) < max(cfg.warmup, cfg.batch_size):
            return {}
        batch = self.rng.sample(list(self.replay), cfg.batch_size)
        x = torch.stack([t.x_NF for t in batch])
        valid = torch.stack([t.valid_NC for t in batch])
        act = torch.stack([t.action_N for t in batch])
        r_BG = torch.stack([t.reward_G for t in batch])
        x2 = torch.stack([t.x2_NF for t in batch])
        valid2 = torch.stack([t.valid2_NC for t in batch])
        C = valid.shape[-1]
        a_onehot = nn.functional.one_hot(act, C).float()
        with torch.no_grad():
            # One target pass over s_t and s_{t+1} together (the DAGNN is latency-bound).
            xx, vv = torch.cat([x, x2]), torch.cat([valid, valid2])
            q_both = self.critic_t(xx, soft_action(self.actor_t(xx, vv), cfg.temperature))
            q_same, q_next = q_both[:len(batch)], q_both[len(batch):]
            # Group g bootstraps from group g+1 at the same t; the last from group 0 at t+1.
            boot_BG = torch.cat([q_same[:, 1:], q_next[:, :1]], dim=1)
            y_BG = r_BG + cfg.gamma * boot_BG
        q_BG = self.critic(x, a_onehot)
        loss_c = (nn.functional.smooth_l1_loss(q_BG, y_BG) if cfg.huber
                  else nn.functional.mse_loss(q_BG, y_BG))
        self.opt_c.zero_grad()
        loss_c.backward()
        nn.utils.clip_grad_norm_(self.critic.parameters(), 5.0)
        self.opt_c.step()
        loss_a = self.actor_loss(x, valid)
        bc_w = imitation_weight(cfg, self.updates)
        teach = teacher_loss(self.actor, batch) if bc_w > 0 else None
        # Without a teacher's labels, imitate only demonstrated decisions that kept the
        # SLO: HPA and ElasticMoE break it on bursts, and copying those would teach it.
        demo_B = torch.tensor([t.demo and t.slo_ok for t in batch])
        if teach is not None:
            loss_a = loss_a + bc_w * teach
        elif bc_w > 0 and bool(demo_B.any()):
            # Warm start from logged experience: cross-entropy toward the demonstrated
            # configs (valid by construction), fading out so the critic takes over.
            logp_BNC = torch.log_softmax(self.actor(x[demo_B], valid[demo_B]), dim=-1)
            nll = -logp_BNC.gather(-1, act[demo_B][..., None]).mean()
            loss_a = loss_a + bc_w * nll
        self.opt_a.zero_grad()
        loss_a.backward()
        nn.utils.clip_grad_norm_(self.actor.parameters(), 5.0)
        self.opt_a.step()
        self._soft_update()
        self.updates += 1
        return {"critic_loss": loss_c.item(), "actor_loss": loss_a.item()}

    def actor_loss(self, x_BNF: torch.Tensor, valid_BNC: torch.Tensor) -> torch.Tensor:
        """-Q(s, softmax(actor(s))): the deterministic policy gradient through the soft
        action (eq. 14); the critic's parameters are not stepped by this loss."""
        a_BNC = soft_action(self.actor(x_BNF, valid_BNC), self.cfg.temperature)
        return -self.critic(x_BNF, a_BNC).mean()

    def _soft_update(self) -> None:
        tau = self.cfg.tau
        with torch.no_grad():
            for net, tgt in ((self.actor, self.actor_t), (self.critic, self.critic_t)):
                for p, pt in zip(net.parameters(), tgt.parameters(), strict=True):
                    pt.mul_(1 - tau).add_(p, alpha=tau)

    def decay_epsilon(self) -> None:
        self.epsilon = max(self.cfg.epsilon_min, self.epsilon * self.cfg.epsilon_decay)


@dataclass(frozen=True)
class _Prev:
    x_NF: torch.Tensor
    valid_NC: torch.Tensor
    action_N: torch.Tensor
    demo: bool = False
    target_N: torch.Tensor | None = None


@dataclass
class StepLog:
    rewards: list[float] = field(default_factory=list)
    losses: list[dict[str, float]] = field(default_factory=list)
    decide_s: list[float] = field(default_factory=list)


class SmoeController(ScalingController):
    """The sMoE controller: ``decide(snapshot, state)`` builds features, masks invalid
    configs, takes the arg-max config of every function and returns those that change.
    With ``learn=True`` it also turns each snapshot into the reward of the previous
    decision, stores the transition and runs DDPG updates (the agent's weights and
    replay are the mutable part; the returned state stays an immutable value).
    A ``teacher`` (learning only) labels every snapshot with its own decision, which
    the actor imitates (DAgger-style: on the states the learner visits); it never acts."""

    name = "smoe"

    def __init__(self, agent: SmoeAgent, slo_s: float,
                 price_per_s: Callable[[int, float], float],
                 *, learn: bool = False, behaviour: ScalingController | None = None,
                 teacher: ScalingController | None = None) -> None:
        if not (math.isfinite(slo_s) and slo_s > 0):
            raise AutoscaleError(f"SLO must be > 0 s, got {slo_s!r}")
        self.agent, self.slo_s, self.price_per_s, self.learn = agent, slo_s, price_per_s, learn
        self.configs = agent.space.configs
        sp = agent.space
        self.options: tuple[Any, ...] = (sp.memory_mb, sp.replicas, sp.concurrency)
        if sp.has_gpu:  # a GPU space also sees each function's current share
            self.options += (sp.gpu_share,)
        self.log = StepLog()
        self.behaviour = behaviour  # acts instead of the actor (logged experience)
        self.teacher = teacher

    def initial_state(self) -> PolicyState:
        return (None, self.behaviour.initial_state() if self.behaviour is not None else None,
                self.teacher.initial_state() if self.teacher is not None else None)

    def decide(self, snapshot: MetricsSnapshot, state: PolicyState) -> tuple[Decisions,
                                                                             PolicyState]:
        import time

        if not snapshot.functions:  # nothing deployed or observed yet: nothing to decide
            return {}, state
        t0 = time.perf_counter()
        ag = self.agent
        x_NF, peak_N = node_features(ag.dag, snapshot, self.slo_s, self.options)
        valid_NC = ag.space.valid_mask(torch.tensor(ag.dag.param_bytes), peak_N,
                                       ag.dag.bytes_per_token)
        # (prev, behaviour state, teacher state); shorter tuples are older states.
        parts = state if isinstance(state, tuple) else (state,)
        prev, b_state, t_state = (*parts, None, None)[:3]
        if self.learn and isinstance(prev, _Prev):
            r_G = group_rewards(ag.dag, snapshot, self.slo_s, self.price_per_s, ag.cfg)
            self.log.rewards.append(float(r_G.sum()))
            ag.remember(Transition(prev.x_NF, prev.valid_NC, prev.action_N, r_G, x_NF,
                                   valid_NC, prev.demo,
                                   slo_term(snapshot, self.slo_s, 1.0) == 0.0, prev.target_N))
            for _ in range(ag.cfg.updates_per_step):
                out = ag.update()
                if out:
                    self.log.losses.append(out)
            ag.decay_epsilon()
        target_N = None
        if self.learn and self.teacher is not None:
            taught, t_state = self.teacher.decide(snapshot, t_state)
            target_N = self._indices(taught, snapshot)
            target_N[~valid_NC.gather(1, target_N[:, None])[:, 0]] = -1  # filtered out
        if self.behaviour is not None:
            wanted, b_state = self.behaviour.decide(snapshot, b_state)
            action_N = self._indices(wanted, snapshot)
            action_N = ag.explore(action_N, valid_NC) if self.learn else action_N
        else:
            action_N = ag.act(x_NF, valid_NC, explore=self.learn)
        out_d: Decisions = {}
        for v, name in enumerate(ag.dag.names):
            cfg = self.configs[int(action_N[v])]
            if cfg != snapshot.functions[name].config:
                out_d[name] = cfg
        self.log.decide_s.append(time.perf_counter() - t0)
        return out_d, (_Prev(x_NF, valid_NC, action_N, self.behaviour is not None, target_N),
                       b_state, t_state)

    def _indices(self, wanted: Decisions, snapshot: MetricsSnapshot) -> torch.Tensor:
        """Config index per node of ``wanted`` (the current config where it is silent)."""
        return torch.tensor([self.agent.space.index_of(wanted.get(n, snapshot.functions[n].config))
                             for n in self.agent.dag.names])
