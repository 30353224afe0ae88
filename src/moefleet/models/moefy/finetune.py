"""Fine-tuning steps of the conversion: LS refit, layer-wise and end-to-end distillation.

Shape legend: B batch, T sequence, N tokens, D hidden, I = E*F neurons, E experts,
F neurons per expert, K top-k.

All three change only the FFN side of a block (experts, shared map, LayerNorm); the
router and attention stay as converted, so routing is frozen while experts adapt to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moefleet.models.moefy.model import BertMoEModel, MoEFFN
from moefleet.models.moefy.options import ConvertOptions


@dataclass
class CalibBatch:
    """One padded batch of calibration text and its running hidden states."""

    ids_BT: torch.Tensor
    mask_BT: torch.Tensor
    bias_B11T: torch.Tensor | None
    h_moe_BTD: torch.Tensor
    h_dense_BTD: torch.Tensor


def _trainable(moe: MoEFFN) -> list[torch.Tensor]:
    """What fine-tuning may change: experts, shared map, LayerNorm; never the router."""
    return [moe.w1_EFD, moe.b1_EF, moe.alpha_EF, moe.w2_EDF, moe.b2_ED,
            moe.shared.weight, moe.shared.bias, moe.norm.weight, moe.norm.bias]


def finetune_end_to_end(
    moe: BertMoEModel, batches: list[CalibBatch], opts: ConvertOptions
) -> float:
    """Fine-tune every block's FFN side so the last hidden state matches the dense one.

    Layer-wise distillation cannot see how a layer's error grows through the layers
    above it; this pass can. Steps alternate k = 1 and k = 2 (routing frozen); each uses
    ``e2e_batch`` calibration sequences. Returns the last loss; restores ``top_k``.
    """
    params = [p for block in moe.blocks for p in _trainable(block.moe)]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=opts.e2e_lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(opts.e2e_steps, 1))
    gen = torch.Generator().manual_seed(opts.seed * 1000 + 999)
    keep, loss_value = moe.config.top_k, 0.0
    ks = [1, 2] if moe.config.num_experts > 1 else [1]
    try:
        for step in range(opts.e2e_steps):
            b = batches[int(torch.randint(len(batches), (1,), generator=gen))]
            rows = torch.randperm(b.ids_BT.shape[0], generator=gen)[: opts.e2e_batch]
            mask_BT = b.mask_BT[rows]
            moe.set_top_k(ks[step % len(ks)])
            opt.zero_grad()
            h_BTD = moe(b.ids_BT[rows], mask_BT)
            real = mask_BT.bool()
            t_BTD = b.h_dense_BTD[rows]
            loss = F.mse_loss(h_BTD[real], t_BTD[real])
            if opts.e2e_cosine_weight:
                m_BT1 = mask_BT[..., None].to(h_BTD.dtype)
                cos_B = F.cosine_similarity((h_BTD * m_BT1).sum(1), (t_BTD * m_BT1).sum(1))
                loss = loss + opts.e2e_cosine_weight * (1 - cos_B).mean()
            loss.backward()
            opt.step()
            sched.step()
            loss_value = float(loss.detach())
    finally:
        moe.set_top_k(keep)
        for p in params:
            p.requires_grad_(False)
    return loss_value


def distill(moe: MoEFFN, x_ND: torch.Tensor, target_ND: torch.Tensor,
            opts: ConvertOptions, seed: int) -> float:
    """Fine-tune experts, shared map and LayerNorm so LN(x + moe(x)) matches the dense
    block output. Returns the last minibatch loss.

    Routing is frozen (the gate is not trained here). Each step averages the loss for
    k = 1 and k = 2 so both load-time choices benefit; the k = 2 output reuses the k = 1
    output (top-2 = top-1 + the runner-up), so both cost two expert passes, not three.
    """
    with torch.no_grad():
        ids_NK = moe.router.gate(x_ND).topk(min(2, moe.num_experts), dim=-1).indices
    params = _trainable(moe)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=opts.distill_lr)
    # Cosine decay: large early steps to move far, small late ones to settle.
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(opts.distill_steps, 1))
    gen = torch.Generator().manual_seed(seed)
    loss_value = 0.0
    for _ in range(opts.distill_steps):
        pick = torch.randint(x_ND.shape[0], (opts.distill_batch,), generator=gen)
        x, t, ids = x_ND[pick], target_ND[pick], ids_NK[pick]
        ones_N1 = torch.ones(ids.shape[0], 1)
        opt.zero_grad()
        y_ND = moe.experts(x, ids[:, :1], ones_N1)
        base_ND = x + moe.shared(x)
        loss = F.mse_loss(moe.norm(base_ND + y_ND), t)
        if ids.shape[1] > 1:
            y_ND = y_ND + moe.experts(x, ids[:, 1:], ones_N1)
            loss = (loss + F.mse_loss(moe.norm(base_ND + y_ND), t)) / 2
        loss.backward()
        opt.step()
        sched.step()
        loss_value = float(loss.detach())
    for p in params:
        p.requires_grad_(False)
    return loss_value


@torch.no_grad()
def refit_outputs(moe: MoEFFN, x_ND: torch.Tensor, target_ND: torch.Tensor, ridge: float,
                  ks: list[int]) -> None:
    """Least-squares refit of every output-side weight given the router's choices.

    Solves target_ND ~ sum_sel (w2_e phi_e + b2_e) + shared(x) for w2_EDF, b2_ED and the
    shared map, with phi_e = gelu(z) - alpha*z of expert e's neurons (zero when e is not
    selected). Rows for each k in ``ks`` are stacked, so one set of weights serves them
    all. Ridge ``ridge * mean diagonal`` keeps the collinear design well posed.
    """
    E, Fe = moe.alpha_EF.shape
    D = x_ND.shape[1]
    logits_NE = moe.router.gate(x_ND)
    z_NEF = torch.einsum("nd,efd->nef", x_ND, moe.w1_EFD) + moe.b1_EF
    phi_NI = (F.gelu(z_NEF) - moe.alpha_EF * z_NEF).reshape(x_ND.shape[0], E * Fe)
    cols = E * Fe + E + D + 1
    gram = torch.zeros(cols, cols, dtype=torch.float64)
    rhs = torch.zeros(cols, D, dtype=torch.float64)
    ones_N1 = torch.ones(x_ND.shape[0], 1)
    for k in ks:
        sel_NE = torch.zeros_like(logits_NE).scatter_(1, logits_NE.topk(k, -1).indices, 1.0)
        a = torch.cat([phi_NI * sel_NE.repeat_interleave(Fe, 1), sel_NE, x_ND, ones_N1], 1)
        gram += (a.T @ a).double()
        rhs += (a.T @ target_ND).double()
    gram += torch.eye(cols, dtype=torch.float64) * ridge * gram.diagonal().mean()
    # The ridged Gram matrix is symmetric positive definite: Cholesky is the cheap solve.
    sol = torch.cholesky_solve(rhs, torch.linalg.cholesky(gram)).float()  # [cols, D]
    moe.w2_EDF.copy_(sol[: E * Fe].reshape(E, Fe, D).permute(0, 2, 1))
    moe.b2_ED.copy_(sol[E * Fe : E * Fe + E])
    moe.shared.weight.copy_(sol[E * Fe + E : E * Fe + E + D].T)
    moe.shared.bias.copy_(sol[-1])
