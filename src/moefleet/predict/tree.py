"""Multi-fork clustering tree over prompts (Remoe §IV-B), built by recursive splitting.

Shape legend: P prompts, F feature size, D prompt-vector size, M tree nodes, k clusters
of one split.

Tree layout: prompts are permuted (``order_P``) so that every node's members are one
contiguous slice ``order_P[start:end]``; a node's children partition its slice. Leaves
hold at most ``beta`` prompts (unless the node could not be split, which only happens
for ``beta < 1``, rejected up front). Every prompt lies in exactly one leaf.

Splitting a node with more than ``beta`` prompts (``update`` picks step 2's rule):
1. roulette-wheel initialisation: the first seed uniformly at random, each next one
   with probability proportional to the distance to its nearest chosen seed;
2. assign every member to its nearest representative, then update the representatives:
   ``"medoid"`` (the paper's k-medoids) moves each to the member with the least total
   distance to its cluster; ``"centroid"`` (our default) uses the cluster's mean (for
   cosine, the mean direction: spherical k-means); repeat until the assignment stops
   changing (at most ``max_iter`` rounds);
3. if fewer than two clusters are non-empty (identical prompts), cut the slice into
   ``fanout`` equal parts in order so the recursion always terminates.

Why centroids: a medoid is one prompt, a noisy stand-in for its cluster. On a 4-topic
synthetic trace (tests/unit/test_predict_sps.py) medoid splits left ~10% of a leaf's
prompts from another topic and SPS's JS divergence was 1.8-2.1x brute force's; centroid
splits (best of 3 seedings) and a centroid walk brought it to 0.93-0.98x. ``medoid_M``
is kept either way: the member nearest the node's mean (the medoid in the linearised
sense below).

Distances: ``cosine`` (1 - u.v on unit vectors; SPS) or ``sqeuclidean`` (VarED, on
activation distributions). Both make "total distance to a cluster" linear in the
cluster's sum, so a medoid update is one matrix-vector product, not a pairwise matrix.

Queries walk from the root to the child whose representative is most similar to the
query (``node_sim_M``), then retrieve. :func:`retrieve` is the reference definition (it
takes the query's similarity to every prompt and node); :class:`TreeIndex` answers the
same query touching only the representatives on the walk and the prompts it returns
from (a leaf, then siblings while short), which is what makes the tree faster than
brute force. Both pick the same prompts in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from moefleet.errors import DataError

Metric = Literal["cosine", "sqeuclidean"]
Update = Literal["centroid", "medoid"]


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


def _roulette_seeds(X_mF: np.ndarray, k: int, metric: Metric,
                    rng: np.random.Generator) -> np.ndarray:
    """Up to k distinct member indices (step 1 of the module doc)."""
    m = X_mF.shape[0]
    seeds = [int(rng.integers(m))]
    d_m = _dist_to(X_mF, X_mF[seeds[0]], metric)
    for _ in range(1, k):
        total = float(d_m.sum())
        if total <= 0:
            break
        nxt = int(rng.choice(m, p=d_m / total))
        seeds.append(nxt)
        d_m = np.minimum(d_m, _dist_to(X_mF, X_mF[nxt], metric))
    return np.asarray(seeds)


def kmedoids(X_mF: np.ndarray, k: int, metric: Metric, rng: np.random.Generator,
             max_iter: int = 20) -> np.ndarray:
    """Cluster labels (m,) in 0..k'-1 with k' <= k non-empty clusters (medoid update)."""
    med = _roulette_seeds(X_mF, k, metric, rng)
    labels = np.zeros(X_mF.shape[0], np.int64)
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


def _means(X_mF: np.ndarray, labels: np.ndarray, k: int, metric: Metric) -> np.ndarray:
    """Y_kF: each cluster's mean (unit mean direction for cosine); 0 rows if empty."""
    # A one-hot product, not np.add.at: the latter is unbuffered and ~50x slower here.
    onehot_km = np.zeros((k, labels.size))
    onehot_km[labels, np.arange(labels.size)] = 1.0
    sums = onehot_km @ X_mF
    if metric == "cosine":
        return sums / np.maximum(np.linalg.norm(sums, axis=1, keepdims=True), 1e-12)
    return sums / np.maximum(np.bincount(labels, minlength=k), 1)[:, None]


def kcentroids(X_mF: np.ndarray, k: int, metric: Metric, rng: np.random.Generator,
               max_iter: int = 20, restarts: int = 3) -> np.ndarray:
    """Cluster labels (m,) in 0..k'-1 (centroid update: spherical k-means for cosine,
    k-means for sqeuclidean), seeded like :func:`kmedoids`.

    Runs ``restarts`` seedings and keeps the lowest total distance to the centroids:
    one seeding sometimes settles with two seeds in one group and one seed on two
    groups, and a bad split near the root misleads every query below it.
    """
    best: tuple[float, np.ndarray] | None = None
    for _ in range(max(1, restarts)):
        Y = X_mF[_roulette_seeds(X_mF, k, metric, rng)].astype(np.float64)
        labels = np.argmin(_dist_matrix(X_mF, Y, metric), axis=1)
        for _ in range(max_iter):
            Y = _means(X_mF, labels, Y.shape[0], metric)
            new = np.argmin(_dist_matrix(X_mF, Y, metric), axis=1)
            if np.array_equal(new, labels):
                break
            labels = new
        Y = _means(X_mF, labels, Y.shape[0], metric)
        cost = float(_dist_matrix(X_mF, Y, metric)[np.arange(labels.size), labels].sum())
        if best is None or cost < best[0]:
            best = (cost, labels)
    assert best is not None
    _, labels = np.unique(best[1], return_inverse=True)  # drop empty clusters
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

    def descend(self, node_sim_M: np.ndarray) -> int:
        """Leaf reached by always taking the child whose representative is most similar
        (``node_sim_M``: the query's similarity to each node's representative)."""
        node = 0
        while self.num_children_M[node] > 0:
            kids = self.children(node)
            node = int(kids[np.argmax(node_sim_M[kids])])
        return node

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {f"tree_{k}": v for k, v in self.__dict__.items()}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> ClusterTree:
        return cls(**{k[5:]: v for k, v in arrays.items() if k.startswith("tree_")})


def build_tree(X_PF: np.ndarray, beta: int, fanout: int, metric: Metric, seed: int,
               max_iter: int = 20, update: Update = "centroid") -> ClusterTree:
    """Split recursively until every leaf has at most ``beta`` prompts (module doc)."""
    if update not in ("centroid", "medoid"):
        raise DataError(f"unknown cluster update {update!r}", "use 'centroid' or 'medoid'")
    split = kcentroids if update == "centroid" else kmedoids
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
        labels = split(X_PF[idx], min(fanout, e - s), metric, rng, max_iter)
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


def top_alpha(sim_n: np.ndarray, alpha: int) -> np.ndarray:
    """Positions of the ``alpha`` largest values, largest first, ties to the lower position.

    Equals ``np.argsort(-sim_n, kind="stable")[:alpha]`` (the tie rule included), but
    selects in O(n) and sorts only the ``alpha`` picked, since n is often >> alpha.
    """
    n = sim_n.size
    if alpha >= n:
        return np.argsort(-sim_n, kind="stable")
    if alpha <= 0:
        return np.zeros(0, np.int64)
    kth = np.partition(sim_n, n - alpha)[n - alpha]  # the alpha-th largest value
    above = np.flatnonzero(sim_n > kth)
    tied = np.flatnonzero(sim_n == kth)[: alpha - above.size]  # lowest positions win ties
    sel = np.concatenate([above, tied])
    return sel[np.lexsort((sel, -sim_n[sel]))]


def node_representatives(tree: ClusterTree, U_PD: np.ndarray, update: Update) -> np.ndarray:
    """R_MD: what a query is compared with at each node on the walk.

    ``"medoid"``: the medoid prompt's vector. ``"centroid"``: the unit mean direction of
    the node's prompt vectors (from prefix sums over the tree order: O(M D), no loop).
    """
    if update == "medoid":
        return np.asarray(U_PD[tree.medoid_M])
    cum = np.zeros((U_PD.shape[0] + 1, U_PD.shape[1]))
    np.cumsum(np.asarray(U_PD, np.float64)[tree.order_P], axis=0, out=cum[1:])
    sums = cum[tree.end_M] - cum[tree.start_M]
    return sums / np.maximum(np.linalg.norm(sums, axis=1, keepdims=True), 1e-12)


@dataclass(frozen=True)
class TreeIndex:
    """A tree plus the prompt vectors it searches, laid out for slice-only queries.

    Invariants: ``U_ord_PD[j] = U_PD[tree.order_P[j]]`` (so a node's members are the
    contiguous rows ``start_M[n]:end_M[n]``, read without a gather copy) and ``R_MD[n]``
    is node n's representative (:func:`node_representatives`; children have consecutive
    ids, so the rows compared at one step are contiguous). Both are derived, never saved.
    """

    tree: ClusterTree
    U_ord_PD: np.ndarray
    R_MD: np.ndarray

    @classmethod
    def build(cls, tree: ClusterTree, U_PD: np.ndarray, update: Update = "centroid",
              ) -> TreeIndex:
        dtype = np.asarray(U_PD).dtype
        return cls(tree, np.ascontiguousarray(U_PD[tree.order_P]),
                   np.ascontiguousarray(node_representatives(tree, U_PD, update), dtype))

    def search(self, u_D: np.ndarray, alpha: int) -> tuple[np.ndarray, np.ndarray]:
        """(prompt indices, their similarity u . U) of :func:`retrieve`'s answer.

        Only the representatives on the walk and the slices retrieval reads are
        multiplied.
        """
        t, u_D = self.tree, np.asarray(u_D, self.U_ord_PD.dtype)
        node = 0
        while int(t.num_children_M[node]) > 0:
            first = int(t.first_child_M[node])
            kids_sim = self.R_MD[first : first + int(t.num_children_M[node])] @ u_D
            node = first + int(np.argmax(kids_sim))
        s, e = int(t.start_M[node]), int(t.end_M[node])
        sim = self.U_ord_PD[s:e] @ u_D
        take = top_alpha(sim, alpha)
        pos, sims = [s + take], [sim[take]]
        have = take.size
        while have < alpha and int(t.parent_M[node]) >= 0:
            node = int(t.parent_M[node])
            ps, pe = int(t.start_M[node]), int(t.end_M[node])
            # The parent's slice minus the child's, in slice order (as retrieve() does).
            rest = np.r_[np.arange(ps, s), np.arange(e, pe)]
            rsim = np.concatenate([self.U_ord_PD[ps:s] @ u_D, self.U_ord_PD[e:pe] @ u_D])
            take = top_alpha(rsim, alpha - have)
            pos.append(rest[take])
            sims.append(rsim[take])
            have += take.size
            s, e = ps, pe
        return t.order_P[np.concatenate(pos)], np.concatenate(sims)


def retrieve(tree: ClusterTree, sim_P: np.ndarray, alpha: int,
             node_sim_M: np.ndarray) -> np.ndarray:
    """Indices of up to ``alpha`` similar prompts for one query (the reference rule).

    ``sim_P`` is the query's similarity to every prompt (P,) and ``node_sim_M`` to every
    node's representative (M,); :class:`TreeIndex` computes only the entries it reads.

    The walk ends in a leaf; all its prompts are taken (the top ``alpha`` of them if it
    has more); while fewer than ``alpha`` are taken, the siblings' prompts (the rest of
    the parent's slice) fill in, most similar first, then the grandparent's, and so on
    up to the root.
    """
    node = tree.descend(node_sim_M)
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
