"""Balanced k-means: split P points into K clusters of exactly P/K points each.

Shape legend: P points (FFN neurons), M feature size, K clusters (experts).

Lloyd iterations with the assignment step replaced by a capacity-constrained one:
greedy over all (point, cluster) pairs by increasing distance, then pairwise swaps
between clusters while a swap lowers the total squared distance. Invariant of the
result: ``bincount(labels_P) == P // K`` for every cluster. Deterministic: k-means++
seeding draws from the given ``torch.Generator`` and every sort is stable.
"""

from __future__ import annotations

import torch

from moefleet.errors import MoefleetError


def kmeans_pp_init(x_PM: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """k-means++ seeding; returns centroids c_KM (rows of x_PM)."""
    P = x_PM.shape[0]
    first = int(torch.randint(P, (1,), generator=gen))
    chosen = [first]
    d2_P = ((x_PM - x_PM[first]) ** 2).sum(-1)
    for _ in range(1, k):
        total = float(d2_P.sum())
        # All remaining points coinciding with a centroid (total 0): pick any.
        probs_P = torch.ones(P, dtype=torch.float64) if total <= 0.0 else d2_P.double() / total
        nxt = int(torch.multinomial(probs_P, 1, generator=gen))
        chosen.append(nxt)
        d2_P = torch.minimum(d2_P, ((x_PM - x_PM[nxt]) ** 2).sum(-1))
    return x_PM[chosen].clone()


def greedy_balanced_assign(d2_PK: torch.Tensor) -> torch.Tensor:
    """Labels with exactly P/K points per cluster, taking the cheapest pairs first."""
    P, K = d2_PK.shape
    cap = P // K
    order = torch.sort(d2_PK.reshape(-1), stable=True).indices.tolist()
    labels = [-1] * P
    room = [cap] * K
    left = P
    for flat in order:
        p, c = divmod(flat, K)
        if labels[p] < 0 and room[c] > 0:
            labels[p] = c
            room[c] -= 1
            left -= 1
            if left == 0:
                break
    return torch.tensor(labels, dtype=torch.long)


def swap_refine(d2_PK: torch.Tensor, labels_P: torch.Tensor, max_rounds: int = 10) -> torch.Tensor:
    """Swap points between cluster pairs while that lowers the cost; sizes unchanged."""
    labels_P = labels_P.clone()
    K = d2_PK.shape[1]
    for _ in range(max_rounds):
        improved = False
        for a in range(K):
            for b in range(a + 1, K):
                in_a = torch.nonzero(labels_P == a).flatten()
                in_b = torch.nonzero(labels_P == b).flatten()
                gain_a = d2_PK[in_a, a] - d2_PK[in_a, b]  # saved by moving a-point to b
                gain_b = d2_PK[in_b, b] - d2_PK[in_b, a]
                ga, ia = torch.sort(gain_a, descending=True, stable=True)
                gb, ib = torch.sort(gain_b, descending=True, stable=True)
                n = min(len(ga), len(gb))
                # Pair the best movers of each side; a prefix of pairs with positive
                # total gain is a strict improvement.
                ok = (ga[:n] + gb[:n]) > 1e-12
                m = int(ok.long().cumprod(0).sum())
                if m:
                    labels_P[in_a[ia[:m]]] = b
                    labels_P[in_b[ib[:m]]] = a
                    improved = True
        if not improved:
            break
    return labels_P


def balanced_kmeans(
    x_PM: torch.Tensor, k: int, iters: int = 30, seed: int = 0
) -> torch.Tensor:
    """labels_P in [0, k) with exactly P/k points per label (see module docstring)."""
    P = x_PM.shape[0]
    if k < 1 or P % k:
        raise MoefleetError(
            f"cannot split {P} neurons into {k} equal clusters", f"pick a divisor of {P}"
        )
    x_PM = x_PM.float()
    gen = torch.Generator().manual_seed(seed)
    c_KM = kmeans_pp_init(x_PM, k, gen)
    labels_P = torch.full((P,), -1, dtype=torch.long)
    sq_P = x_PM.pow(2).sum(-1)
    for _ in range(iters):
        # |x|^2 + |c|^2 - 2 x.c: one matmul, much cheaper than cdist for wide features.
        d2_PK = (sq_P[:, None] + c_KM.pow(2).sum(-1)[None] - 2 * x_PM @ c_KM.T).clamp_min(0)
        new_P = swap_refine(d2_PK, greedy_balanced_assign(d2_PK))
        if torch.equal(new_P, labels_P):
            break
        labels_P = new_P
        for c in range(k):
            c_KM[c] = x_PM[labels_P == c].mean(0)
    return labels_P
