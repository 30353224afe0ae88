"""Multi-fork clustering tree over prompts, built by our k-medoids variant (Remoe §IV-B).

Shape legend: P prompts, F feature size, M tree nodes, k clusters of one split.

Tree layout: prompts are permuted (``order_P``) so that every node's members are one
contiguous slice ``order_P[start:end]``; a node's children partition its slice. Leaves
hold at most ``beta`` prompts (unless the node could not be split, which only happens
for ``beta < 1``, rejected up front). Every prompt lies in exactly one leaf.

Splitting a node with more than ``beta`` prompts:
1. roulette-wheel initialisation: the first medoid uniformly at random, each next one
   with probability proportional to the distance to its nearest chosen medoid;
2. assign every member to its nearest medoid, then move each medoid to the member with
   the least total distance to its cluster ("subcluster-level centroid update");
   repeat until the medoids stop moving (at most ``max_iter`` rounds);
3. if fewer than two clusters are non-empty (identical prompts), cut the slice into
   ``fanout`` equal parts in order so the recursion always terminates.

Distances: ``cosine`` (1 - u.v on unit vectors; SPS) or ``sqeuclidean`` (VarED, on
activation distributions). Both make "total distance to a cluster" linear in the
cluster's sum, so a medoid update is one matrix-vector product, not a pairwise matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from moefleet.errors import DataError

Metric = Literal["cosine", "sqeuclidean"]


def _dist_to(X_PF: np.ndarray, y_F: np.ndarray, metric: Metric) -> np.ndarray:
    if metric == "cosine":
        return np.maximum(1.0 - X_PF @ y_F, 0.0)
    return np.maximum(((X_PF - y_F) ** 2).sum(axis=1), 0.0)


def _dist_matrix(X_PF: np.ndarray, Y_kF: np.ndarray, metric: Metric) -> np.ndarray:
    if metric == "cosine":
        return 1.0 - X_PF @ Y_kF.T
    sq = (X_PF**2).sum(1)[:, None] + (Y_kF**2).sum(1)[None, :] - 2.0 * X_PF @ Y_kF.T
    return np.maximum(sq, 0.0)


def _medoid(X_mF: np.ndarray, metric: Metric) -> int:
    """Member with the least total distance to all members (linear in the sum)."""
    s_F = X_mF.sum(axis=0)
    if metric == "cosine":
        return int(np.argmax(X_mF @ s_F))  # sum_j (1 - x.y_j) = m - x.s
    m = X_mF.shape[0]
    return int(np.argmin(m * (X_mF**2).sum(1) - 2.0 * X_mF @ s_F))


def kmedoids(X_mF: np.ndarray, k: int, metric: Metric, rng: np.random.Generator,
             max_iter: int = 20) -> np.ndarray:
    """Cluster labels (m,) in 0..k'-1 with k' <= k non-empty clusters."""
    m = X_mF.shape[0]
    medoids = [int(rng.integers(m))]
    d_m = _dist_to(X_mF, X_mF[medoids[0]], metric)
    for _ in range(1, k):
        total = float(d_m.sum())
        if total <= 0:
            break
        nxt = int(rng.choice(m, p=d_m / total))
        medoids.append(nxt)
        d_m = np.minimum(d_m, _dist_to(X_mF, X_mF[nxt], metric))
    med = np.asarray(medoids)
    labels = np.zeros(m, np.int64)
    for _ in range(max_iter):
        labels = np.argmin(_dist_matrix(X_mF, X_mF[med], metric), axis=1)
        new = med.copy()
        for c in range(med.size):
            members = np.flatnonzero(labels == c)
            if members.size:
                new[c] = members[_medoid(X_mF[members], metric)]
        if np.array_equal(new, med):
            break
        med = new
    _, labels = np.unique(labels, return_inverse=True)  # drop empty clusters
    return labels.reshape(-1)


@dataclass(frozen=True)
class ClusterTree:
    """Arrays of the tree; node 0 is the root (see module doc for the layout)."""

    order_P: np.ndarray
    start_M: np.ndarray
    end_M: np.ndarray
    parent_M: np.ndarray  # -1 for the root
    medoid_M: np.ndarray  # prompt index of the node's medoid
    first_child_M: np.ndarray  # children are first_child .. first_child + num_children - 1
    num_children_M: np.ndarray

    @property
    def num_nodes(self) -> int:
        return int(self.start_M.size)

    def leaves(self) -> np.ndarray:
        return np.flatnonzero(self.num_children_M == 0)

    def members(self, node: int) -> np.ndarray:
        return self.order_P[self.start_M[node] : self.end_M[node]]

    def children(self, node: int) -> np.ndarray:
        first = int(self.first_child_M[node])
        return np.arange(first, first + int(self.num_children_M[node]))

    def descend(self, medoid_sim_M: np.ndarray) -> int:
        """Leaf reached by always taking the child whose medoid is most similar."""
        node = 0
        while self.num_children_M[node] > 0:
            kids = self.children(node)
            node = int(kids[np.argmax(medoid_sim_M[kids])])
        return node

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {f"tree_{k}": v for k, v in self.__dict__.items()}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> ClusterTree:
        return cls(**{k[5:]: v for k, v in arrays.items() if k.startswith("tree_")})


def build_tree(X_PF: np.ndarray, beta: int, fanout: int, metric: Metric, seed: int,
               max_iter: int = 20) -> ClusterTree:
    """Split recursively until every leaf has at most ``beta`` prompts (module doc)."""
    if beta < 1 or fanout < 2:
        raise DataError(f"need beta >= 1 and fanout >= 2, got beta={beta}, fanout={fanout}",
                        "Remoe uses beta=150; use fanout e.g. 4")
    P = X_PF.shape[0]
    if P == 0:
        raise DataError("cannot build a clustering tree of 0 prompts", "profile more prompts")
    rng = np.random.default_rng(seed)
    order = np.arange(P)
    start, end, parent, first, nkids = [0], [P], [-1], [0], [0]
    medoid = [int(_medoid(X_PF, metric))]
    queue = [0]  # breadth-first: children of one node get consecutive ids
    while queue:
        node = queue.pop(0)
        s, e = start[node], end[node]
        if e - s <= beta:
            continue
        idx = order[s:e]
        labels = kmedoids(X_PF[idx], min(fanout, e - s), metric, rng, max_iter)
        if labels.max(initial=0) < 1:
            labels = np.arange(e - s) * fanout // (e - s)  # degenerate: equal chunks
        perm = np.argsort(labels, kind="stable")
        order[s:e] = idx[perm]
        bounds = np.searchsorted(labels[perm], np.arange(int(labels.max()) + 2)) + s
        first[node], nkids[node] = len(start), int(labels.max()) + 1
        for c in range(nkids[node]):
            cs, ce = int(bounds[c]), int(bounds[c + 1])
            members = order[cs:ce]
            start.append(cs)
            end.append(ce)
            parent.append(node)
            first.append(0)
            nkids.append(0)
            medoid.append(int(members[_medoid(X_PF[members], metric)]))
            queue.append(len(start) - 1)
    return ClusterTree(order, *(np.asarray(a, np.int64) for a in
                                (start, end, parent, medoid, first, nkids)))


def retrieve(tree: ClusterTree, sim_P: np.ndarray, alpha: int) -> np.ndarray:
    """Indices of up to ``alpha`` similar prompts for one query.

    ``sim_P`` is the query's similarity to every prompt (P,): one matrix-vector product
    is cheaper than walking in Python, and only medoids and candidates are read; the
    tree decides *which* prompts are neighbours, as in the paper.

    The walk ends in a leaf; all its prompts are taken (the top ``alpha`` of them if it
    has more); while fewer than ``alpha`` are taken, the siblings' prompts (the rest of
    the parent's slice) fill in, most similar first, then the grandparent's, and so on
    up to the root.
    """
    node = tree.descend(sim_P[tree.medoid_M])
    leaf = tree.members(node)
    if leaf.size >= alpha:
        return leaf[np.argsort(-sim_P[leaf], kind="stable")[:alpha]]
    picked = [leaf[np.argsort(-sim_P[leaf], kind="stable")]]
    have = leaf.size
    while have < alpha and tree.parent_M[node] >= 0:
        par = int(tree.parent_M[node])
        rest = np.r_[tree.order_P[tree.start_M[par] : tree.start_M[node]],
                     tree.order_P[tree.end_M[node] : tree.end_M[par]]]
        take = rest[np.argsort(-sim_P[rest], kind="stable")[: alpha - have]]
        picked.append(take)
        have += take.size
        node = par
    return np.concatenate(picked)
