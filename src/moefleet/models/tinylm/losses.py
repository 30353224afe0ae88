"""Training losses of ``tiny-moe-lm``.

Shape legend: N tokens (rows), V vocabulary, L MoE layers.

The next-token loss is the largest non-matmul cost of a small-model step on CPU (one
softmax over N x V logits forward, another backward, plus dtype copies and a zero-filled
gradient). :class:`FusedCrossEntropy` does one pass forward, keeps the probabilities,
and writes the logits' gradient directly: ``(softmax - onehot) / N``.
"""

from __future__ import annotations

from typing import Any

import torch

# Rows per chunk: bounds the fp32 temporaries to CHUNK x V while keeping each chunk
# large enough to amortise per-op overhead.
_CHUNK = 256


class FusedCrossEntropy(torch.autograd.Function):
    """mean_n( logsumexp(logits_NV[n]) - logits_NV[n, target_N[n]] ), computed in fp32.

    The saved probabilities keep the logits' dtype (bf16 under autocast), so the gradient
    has the same precision the logits' matmul backward would use anyway.
    """

    @staticmethod
    def forward(ctx: Any, logits_NV: torch.Tensor, target_N: torch.Tensor) -> torch.Tensor:
        n = logits_NV.shape[0]
        probs_NV = torch.empty_like(logits_NV)
        total = torch.zeros((), dtype=torch.float64)
        for start in range(0, n, _CHUNK):
            rows = slice(start, start + _CHUNK)
            chunk_CV = logits_NV[rows].to(torch.float32, copy=True)  # modified in place
            # One exp per logit: shift by the row max, exponentiate in place, normalise.
            max_C = chunk_CV.amax(dim=-1)
            picked_C = chunk_CV.gather(1, target_N[rows, None]).squeeze(1) - max_C
            exp_CV = chunk_CV.sub_(max_C[:, None]).exp_()
            sum_C = exp_CV.sum(dim=-1)
            total += (sum_C.log() - picked_C).sum(dtype=torch.float64)
            # copy_ converts dtype while writing: one pass instead of .to() then a copy.
            probs_NV[rows].copy_(exp_CV.div_(sum_C[:, None]))
        ctx.save_for_backward(probs_NV, target_N)
        return (total / n).to(torch.float32)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None]:
        probs_NV, target_N = ctx.saved_tensors
        n = probs_NV.shape[0]
        # The probabilities are not needed afterwards, so the gradient overwrites them.
        grad_NV = probs_NV
        grad_NV[torch.arange(n), target_N] -= 1
        grad_NV.mul_((grad_out / n).to(grad_NV.dtype))
        return grad_NV, None


def cross_entropy(logits_NV: torch.Tensor, target_N: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL (nats); equals ``F.cross_entropy`` up to float rounding."""
    out: torch.Tensor = FusedCrossEntropy.apply(logits_NV, target_N)
    return out


def balance_loss(aux_L: list[torch.Tensor]) -> torch.Tensor:
    """Mean over layers of the per-layer balance terms (1.0 when routing is uniform)."""
    return torch.stack(aux_L).mean()
