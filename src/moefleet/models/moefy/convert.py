"""Dense BERT -> BertMoE (MoEfication-style, our implementation).

Shape legend: B batch, T tokens per sequence, N real (non-pad) calibration tokens,
D hidden, I dense FFN width (= E*F), E experts, F neurons per expert, K top-k.

Layer by layer, on calibration text, with the MoE model's own (already converted)
lower layers feeding layer l, so each layer sees the inputs it will see at inference:

    x_ND (attention output) -> fit per-neuron linear GELU approximations (alpha, beta)
      -> balanced k-means of neurons on their co-activation profiles -> E groups of F
      -> importance_NE = |expert e's non-linear residual output| per token
      -> linear gate trained to rank experts by importance (soft-target cross-entropy)
      -> [optional] least-squares refit of the output side given the gate's choices
      -> [optional] distil experts + shared map against the dense block's output
      -> propagate the converted layer's output to layer l+1

Invariant (no refit, no distillation): with top_k = E the converted model equals the
dense one up to float rounding; the split loses nothing, only routing does. The two
optional steps trade that exactness for fidelity at the top_k actually used (1 and 2).

Measured on MiniLM-L6, 8 experts (see entries.py for the shipped recipe): the split and
the gate alone reach ~0.78 embedding cosine at k=2 (the gate is within ~0.01 relative
error of oracle routing, so the split, not the gate, is the limit); distillation on more
calibration tokens is what lifts it past 0.9. The refit adds little once distilling.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from moefleet.models.moefy.cluster import balanced_kmeans
from moefleet.models.moefy.finetune import (
    CalibBatch,
    distill,
    finetune_end_to_end,
    refit_outputs,
)
from moefleet.models.moefy.model import BertMoEModel, MoEFFN
from moefleet.models.moefy.options import ConvertOptions
from moefleet.models.moefy.source import (
    config_from_dense,
    copy_non_expert_weights,
    ffn_weights,
    tokenize,
)

Progress = Callable[[int, int, str], None]


def linear_gelu_fit(z_NI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-neuron least squares gelu(z) ~ alpha*z + beta over the calibration tokens."""
    act_NI = F.gelu(z_NI)
    zc_NI = z_NI - z_NI.mean(0)
    alpha_I = (zc_NI * (act_NI - act_NI.mean(0))).mean(0) / zc_NI.pow(2).mean(0).clamp_min(1e-8)
    beta_I = act_NI.mean(0) - alpha_I * z_NI.mean(0)
    return alpha_I, beta_I


def cluster_neurons(
    resid_NI: torch.Tensor, w2_DI: torch.Tensor, num_experts: int, opts: ConvertOptions,
    seed: int,
) -> torch.Tensor:
    """labels_I: neurons whose residual outputs are large on the same tokens group together.

    A neuron's profile is |residual activation| x |its output weights| over a token sample,
    L2-normalised, so the clustering sees *when* a neuron matters, not how much.
    """
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randperm(resid_NI.shape[0], generator=gen)[: opts.cluster_tokens]
    profile_IS = (resid_NI[pick].abs() * w2_DI.norm(dim=0)).T
    return balanced_kmeans(F.normalize(profile_IS, dim=1), num_experts, opts.kmeans_iters, seed)


@torch.no_grad()
def split_ffn(moe: MoEFFN, x_ND: torch.Tensor, dense_ffn: tuple[torch.Tensor, ...],
              opts: ConvertOptions, seed: int) -> torch.Tensor:
    """Fill ``moe``'s experts and shared map from the dense FFN; returns importance_NE."""
    w1_ID, b1_I, w2_DI, b2_D = dense_ffn
    E = moe.num_experts
    z_NI = F.linear(x_ND, w1_ID, b1_I)
    alpha_I, beta_I = linear_gelu_fit(z_NI)
    resid_NI = F.gelu(z_NI) - alpha_I * z_NI - beta_I
    labels_I = cluster_neurons(resid_NI, w2_DI, E, opts, seed)
    perm_I = torch.argsort(labels_I, stable=True)  # expert e = neurons perm[e*F:(e+1)*F]
    Fe = w1_ID.shape[0] // E
    w2p_EDF = w2_DI[:, perm_I].reshape(-1, E, Fe).permute(1, 0, 2)
    moe.w1_EFD.copy_(w1_ID[perm_I].reshape(E, Fe, -1))
    moe.b1_EF.copy_(b1_I[perm_I].reshape(E, Fe))
    moe.alpha_EF.copy_(alpha_I[perm_I].reshape(E, Fe))
    moe.w2_EDF.copy_(w2p_EDF)
    moe.b2_ED.copy_(-torch.einsum("edf,ef->ed", w2p_EDF, beta_I[perm_I].reshape(E, Fe)))
    # shared(x) = W2 (alpha*(W1 x + b1) + beta) + b2: all experts' linear parts at once.
    moe.shared.weight.copy_((w2_DI * alpha_I) @ w1_ID)
    moe.shared.bias.copy_(w2_DI @ (alpha_I * b1_I + beta_I) + b2_D)
    resid_NEF = resid_NI[:, perm_I].reshape(-1, E, Fe)
    return torch.stack(
        [(resid_NEF[:, e] @ w2p_EDF[e].T).norm(dim=-1) for e in range(E)], dim=1
    )


def fit_gate(moe: MoEFFN, x_ND: torch.Tensor, importance_NE: torch.Tensor,
             opts: ConvertOptions, seed: int) -> None:
    """Train the router so softmax(logits) matches softmax(importance / (T * mean)).

    Inputs are standardised for the optimiser's sake and the scaling is folded back into
    the router's weights afterwards, so the router itself takes raw x_ND.
    """
    mu_D, sd_D = x_ND.mean(0), x_ND.std(0).clamp_min(1e-6)
    xs_ND = (x_ND - mu_D) / sd_D
    scaled_NE = importance_NE / importance_NE.mean(-1, keepdim=True).clamp_min(1e-12)
    target_NE = torch.softmax(scaled_NE / opts.gate_temperature, dim=-1)
    gen = torch.Generator().manual_seed(seed)
    E, D = importance_NE.shape[1], x_ND.shape[1]
    w_ED = (torch.randn(E, D, generator=gen) * D**-0.5).requires_grad_()
    b_E = torch.zeros(E, requires_grad=True)
    opt = torch.optim.Adam([w_ED, b_E], lr=opts.gate_lr)
    for _ in range(opts.gate_steps):
        opt.zero_grad()
        logp_NE = torch.log_softmax(F.linear(xs_ND, w_ED, b_E), dim=-1)
        loss = -(target_NE * logp_NE).sum(-1).mean()
        loss.backward()
        opt.step()
    with torch.no_grad():
        w = w_ED / sd_D
        moe.router.gate.weight.copy_(w)
        moe.router.gate.bias.copy_(b_E - w @ mu_D)


@torch.no_grad()
def _dense_preln(dense: Any, layer: int, a_BTD: torch.Tensor) -> torch.Tensor:
    """The dense block's FFN half before its LayerNorm: a + FFN(a)."""
    w1_ID, b1_I, w2_DI, b2_D = ffn_weights(dense, layer)
    return a_BTD + F.linear(F.gelu(F.linear(a_BTD, w1_ID, b1_I)), w2_DI, b2_D)


def convert_bert(dense: Any, tokenizer: Any, texts: list[str], opts: ConvertOptions,
            progress: Progress | None = None) -> tuple[BertMoEModel, dict[str, Any]]:
    """Build a BertMoE from an HF ``BertModel`` using ``texts`` for calibration."""
    opts.validate(int(dense.config.intermediate_size))
    moe = BertMoEModel(config_from_dense(dense, opts.num_experts, opts.top_k)).eval()
    copy_non_expert_weights(dense, moe)
    for p in moe.parameters():
        p.requires_grad_(False)
    L = len(moe.blocks)
    batches: list[CalibBatch] = []
    with torch.no_grad():
        for i in range(0, len(texts), opts.batch_size):
            enc = tokenize(tokenizer, texts[i : i + opts.batch_size], opts.max_length)
            h = moe.embeddings(enc["input_ids"])
            bias = moe.mask_bias(enc["attention_mask"], h.dtype)
            batches.append(CalibBatch(enc["input_ids"], enc["attention_mask"], bias, h, h))
    stats: dict[str, Any] = {"calib_tokens": int(sum(int(b.mask_BT.sum()) for b in batches))}
    per_layer: list[dict[str, float]] = []
    for layer, block in enumerate(moe.blocks):
        if progress:
            progress(layer, L, f"converting layer {layer + 1}/{L}")
        seed = opts.seed * 1000 + layer
        started = time.perf_counter()
        with torch.no_grad():
            a_moe = [block.attn(b.h_moe_BTD, b.bias_B11T)[0] for b in batches]
            real = [b.mask_BT.bool() for b in batches]
            x_ND = torch.cat([a[m] for a, m in zip(a_moe, real, strict=True)])
            # The dense path advances alongside; its pre-LN block output u is the refit's
            # target, its post-LN output the distillation's.
            u_rows: list[torch.Tensor] = []
            for b, m in zip(batches, real, strict=True):
                u_BTD = _dense_preln(dense, layer, block.attn(b.h_dense_BTD, b.bias_B11T)[0])
                b.h_dense_BTD = dense.encoder.layer[layer].output.LayerNorm(u_BTD)
                if opts.refit:
                    u_rows.append(u_BTD[m])
            target_ND = torch.cat([b.h_dense_BTD[m] for b, m in zip(batches, real, strict=True)])
        # Split statistics and the gate need far fewer tokens than distillation does.
        gen = torch.Generator().manual_seed(seed)
        fit_ND = x_ND[torch.randperm(x_ND.shape[0], generator=gen)[: opts.fit_tokens]]
        importance_NE = split_ffn(block.moe, fit_ND, ffn_weights(dense, layer), opts, seed)
        fit_gate(block.moe, fit_ND, importance_NE, opts, seed)
        row: dict[str, float] = {}
        if opts.refit:
            with torch.no_grad():
                # Pre-LN dense output minus the MoE residual: what routed+shared must add.
                u_ND = torch.cat(u_rows)
                del u_rows
                gen = torch.Generator().manual_seed(seed)
                pick = torch.randperm(x_ND.shape[0], generator=gen)[: opts.refit_tokens]
                ks = sorted({1, min(2, opts.num_experts)})
                refit_outputs(block.moe, x_ND[pick], (u_ND - x_ND)[pick], opts.refit_ridge, ks)
        if opts.distill_steps:
            row["distill_loss"] = distill(block.moe, x_ND, target_ND, opts, seed)
        with torch.no_grad():
            agree_N = block.moe.router.gate(fit_ND).argmax(-1) == importance_NE.argmax(-1)
            row["gate_top1_agreement"] = float(agree_N.float().mean())
            for b, a in zip(batches, a_moe, strict=True):
                b.h_moe_BTD = block.moe(a)
        row["seconds"] = round(time.perf_counter() - started, 2)
        per_layer.append(row)
    stats["layers"] = per_layer
    if opts.e2e_steps:
        if progress:
            progress(L, L, "end-to-end fine-tune")
        started = time.perf_counter()
        stats["e2e_loss"] = finetune_end_to_end(moe, batches, opts)
        stats["e2e_seconds"] = round(time.perf_counter() - started, 2)
    if progress:
        progress(L, L, "converted")
    return moe, stats


