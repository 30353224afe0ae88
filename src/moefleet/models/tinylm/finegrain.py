"""Fine-grained upcycling: split every expert of a trained ``TinyMoELM`` into ``parts``
smaller experts (by clustering its FFN neurons) and give each a router row.

Shape legend: E experts, P parts per expert, F expert intermediate size, D hidden size,
M neuron feature size.

Why the split is exact at init: a SwiGLU expert is a sum over its neurons,
``down[:, j] * silu(gate[j] . x) * up[j] . x``, so the P sub-experts holding a partition of
the neurons add up to the expert. With router rows equal to the parent's
(``router_mix = 0``) each sub-expert gets a softmax probability of p_parent / P, top-(K*P)
picks exactly the sub-experts of the K chosen parents, and renormalised weights are
w_parent / P; scaling each sub-expert's down projection by P restores the parent's
output (tested to 1e-4). ``router_mix > 0`` tilts every sub-expert's row towards the
mean gate direction of its own neurons, so tokens that excite a cluster prefer it: the
symmetry short training then breaks into genuinely fine-grained routing.

Neurons are grouped by balanced k-means (exactly F/P per part) on their unit-normalised
``[gate row | up row | down column]`` vectors, so each part is a coherent sub-function.
"""

from __future__ import annotations

import dataclasses

import torch

from moefleet.errors import MoefleetError
from moefleet.models.moefy.cluster import balanced_kmeans
from moefleet.models.tinylm.model import ModelConfig, TinyMoELM


def finegrained_config(cfg: ModelConfig, parts: int) -> ModelConfig:
    """The config after splitting: E*P experts of F/P neurons, top-(K*P)."""
    if parts < 1 or cfg.ffn % parts:
        raise MoefleetError(
            f"cannot split experts of {cfg.ffn} neurons into parts={parts}",
            f"use a divisor of {cfg.ffn}",
        )
    return dataclasses.replace(
        cfg, ffn=cfg.ffn // parts, experts=cfg.experts * parts, top_k=cfg.top_k * parts
    )


def neuron_parts(w13_2FD: torch.Tensor, w2_DF: torch.Tensor, parts: int, seed: int) -> torch.Tensor:
    """labels_F in [0, parts): which sub-expert each neuron of one expert goes to."""
    f = w2_DF.shape[1]
    gate_FD, up_FD = w13_2FD[:f], w13_2FD[f:]
    feats_FM = torch.cat([gate_FD, up_FD, w2_DF.T], dim=1).float()
    feats_FM = feats_FM / feats_FM.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return balanced_kmeans(feats_FM, parts, seed=seed)


@torch.no_grad()
def split_into_finer_experts(model: TinyMoELM, parts: int, router_mix: float,
                             seed: int) -> TinyMoELM:
    """A new ``TinyMoELM`` with every expert split in ``parts`` (see module docstring).

    Sub-expert ``e * parts + c`` holds cluster ``c`` of parent ``e``'s neurons, so the
    parents' order (and any per-expert statistic) maps back by integer division.
    """
    cfg = model.cfg
    new_cfg = finegrained_config(cfg, parts)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    f = cfg.ffn
    for layer, block in enumerate(model.block_list):
        moe = block.moe
        gate_ED = moe.gate.weight.detach()
        w13, w2 = [], []
        rows = []
        for e in range(cfg.experts):
            w13_2FD, w2_DF = moe.w13_E2FD[e].detach(), moe.w2_EDF[e].detach()
            labels_F = neuron_parts(w13_2FD, w2_DF, parts, seed + 7919 * layer + e)
            for c in range(parts):
                idx = torch.nonzero(labels_F == c).flatten()
                w13.append(torch.cat([w13_2FD[:f][idx], w13_2FD[f:][idx]]))
                w2.append(w2_DF[:, idx] * parts)
                centroid_D = w13_2FD[:f][idx].mean(0)
                scale = router_mix * gate_ED[e].norm() / centroid_D.norm().clamp_min(1e-12)
                rows.append(gate_ED[e] + scale * centroid_D)
        prefix = f"blocks.{layer}.moe."
        state[prefix + "gate.weight"] = torch.stack(rows)
        state[prefix + "w13_E2FD"] = torch.stack(w13)
        state[prefix + "w2_EDF"] = torch.stack(w2)
    new = TinyMoELM(new_cfg)
    new.load_state_dict(state, strict=True)
    return new.eval()
