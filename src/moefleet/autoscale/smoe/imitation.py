"""Behaviour cloning of a teacher's labels (the warm start before DDPG).

Transitions may carry ``target_N``: the config index a teacher (the popularity-aware
demonstrator, :mod:`moefleet.autoscale.smoe.popularity`) chose for each node in that
state, -1 where it chose none or its choice was filtered out. The loss is the actor's
cross-entropy toward those labels over the labelled nodes; it trains the same actor
DDPG then fine-tunes (the scores stay differentiable; nothing here acts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from moefleet.autoscale.smoe.agent import SmoeAgent


class _Labelled(Protocol):
    x_NF: torch.Tensor
    valid_NC: torch.Tensor
    target_N: torch.Tensor | None


def teacher_loss(actor: torch.nn.Module, batch: Sequence[_Labelled]) -> torch.Tensor | None:
    """Mean cross-entropy of the actor's scores toward the teacher's labels over the
    batch's labelled nodes; None when the batch has no label."""
    rows = [t for t in batch if t.target_N is not None and bool((t.target_N >= 0).any())]
    if not rows:
        return None
    x_BNF = torch.stack([t.x_NF for t in rows])
    valid_BNC = torch.stack([t.valid_NC for t in rows])
    tgt_BN = torch.stack([t.target_N for t in rows if t.target_N is not None])
    logp_BNC = torch.log_softmax(actor(x_BNF, valid_BNC), dim=-1)
    keep_BN = tgt_BN >= 0
    picked_BN = logp_BNC.gather(-1, tgt_BN.clamp(min=0)[..., None])[..., 0]
    return -(picked_BN[keep_BN]).mean()


@torch.no_grad()
def agreement(actor: torch.nn.Module, batch: Sequence[_Labelled]) -> float:
    """Share of labelled nodes where the actor's arg-max is the teacher's config."""
    hit = total = 0
    for t in batch:
        if t.target_N is None:
            continue
        keep = t.target_N >= 0
        act_N = actor(t.x_NF[None], t.valid_NC[None])[0].argmax(-1)
        hit += int((act_N[keep] == t.target_N[keep]).sum())
        total += int(keep.sum())
    return hit / total if total else 0.0


def pretrain(agent: SmoeAgent, steps: int, batch_size: int | None = None
             ) -> dict[str, Any]:
    """``steps`` supervised steps of the actor on labelled replay transitions (teacher
    only, no critic), then the target actor is synced to it so DDPG starts from the
    cloned policy. Returns the arg-max agreement on the labelled replay before/after."""
    labelled = [t for t in agent.replay if t.target_N is not None]
    if not labelled or steps <= 0:
        return {"steps": 0, "labelled": len(labelled)}
    bs = batch_size or agent.cfg.batch_size
    probe = labelled[-256:]
    before = agreement(agent.actor, probe)
    loss = torch.tensor(0.0)
    # Its own optimiser: a supervised rate far above DDPG's actor rate (which would need
    # tens of thousands of steps), and DDPG's Adam moments stay untouched.
    opt = torch.optim.Adam(agent.actor.parameters(), lr=agent.cfg.bc_lr)
    for _ in range(steps):
        batch = agent.rng.sample(labelled, min(bs, len(labelled)))
        out = teacher_loss(agent.actor, batch)
        if out is None:
            continue
        loss = out
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(agent.actor.parameters(), 5.0)
        opt.step()
    agent.actor_t.load_state_dict(agent.actor.state_dict())
    return {"steps": steps, "labelled": len(labelled), "agreement_before": before,
            "agreement_after": agreement(agent.actor, probe), "last_loss": float(loss.detach())}
