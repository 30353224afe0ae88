"""Similar Prompts Searching: soft cosine similarity, clustering tree, retrieval, prediction."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moefleet.errors import DataError
from moefleet.predict import (
    DOPPredictor,
    FunctionEmbedding,
    RandomEmbedding,
    Request,
    SPSPredictor,
    evaluate,
)
from moefleet.predict.synthetic import build_trace, synthetic_trace
from moefleet.predict.tree import (
    ClusterTree,
    TreeIndex,
    build_tree,
    kcentroids,
    kmedoids,
    node_representatives,
    retrieve,
    top_alpha,
)
from moefleet.traces.schema import Trace


def _unit_rows(P: int, D: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((P, D))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _check_tree(tree: ClusterTree, P: int, beta: int) -> None:
    leaves = tree.leaves()
    assert all(tree.members(int(n)).size <= beta for n in leaves)
    # Every prompt is in exactly one leaf.
    members = np.concatenate([tree.members(int(n)) for n in leaves])
    np.testing.assert_array_equal(np.sort(members), np.arange(P))
    for node in range(tree.num_nodes):
        assert tree.medoid_M[node] in tree.members(node)
        kids = tree.children(node)
        if kids.size:  # children partition the parent's slice, in order
            assert tree.start_M[kids[0]] == tree.start_M[node]
            assert tree.end_M[kids[-1]] == tree.end_M[node]
            np.testing.assert_array_equal(tree.end_M[kids[:-1]], tree.start_M[kids[1:]])
            assert (tree.parent_M[kids] == node).all()


def test_soft_cosine_similarity_matches_the_gram_matrix_form() -> None:
    emb = RandomEmbedding(8, seed=2)
    pred = SPSPredictor(emb)
    a, b = [3, 1, 4, 1, 5], [9, 2, 6]
    Z = np.concatenate([emb(a), emb(b)]).astype(np.float64)
    Z /= np.linalg.norm(Z, axis=1, keepdims=True)
    C = Z @ Z.T
    v1 = np.r_[np.ones(len(a)), np.zeros(len(b))]
    v2 = 1 - v1
    scs = v1 @ C @ v2 / (np.sqrt(v1 @ C @ v1) * np.sqrt(v2 @ C @ v2) + 1e-12)
    assert pred.prompt_vector(a) @ pred.prompt_vector(b) == pytest.approx(scs, abs=1e-9)


@pytest.mark.parametrize("update", ["centroid", "medoid"])
@pytest.mark.parametrize("metric", ["cosine", "sqeuclidean"])
def test_tree_invariants(metric: str, update: str) -> None:
    X = _unit_rows(230, 6, seed=0)
    kw = {"metric": metric, "seed": 0, "update": update}
    tree = build_tree(X, beta=15, fanout=3, **kw)  # type: ignore[arg-type]
    _check_tree(tree, 230, 15)
    assert tree.leaves().size >= 230 // 15
    again = build_tree(X, beta=15, fanout=3, **kw)  # type: ignore[arg-type]
    np.testing.assert_array_equal(tree.order_P, again.order_P)  # seeded


def test_tree_of_identical_prompts_terminates() -> None:
    X = np.tile(_unit_rows(1, 4, seed=1), (40, 1))
    tree = build_tree(X, beta=6, fanout=4, metric="cosine", seed=0)
    _check_tree(tree, 40, 6)


@pytest.mark.parametrize("split", [kmedoids, kcentroids])
def test_splits_separate_obvious_clusters(split) -> None:
    rng = np.random.default_rng(0)
    X = np.concatenate([rng.normal(0, 0.01, (20, 2)), rng.normal(5, 0.01, (20, 2))])
    labels = split(X, 2, "sqeuclidean", rng)
    assert len(set(labels[:20])) == 1 and len(set(labels[20:])) == 1
    assert labels[0] != labels[-1]
    # Two opposite directions on the sphere: cosine clusters them apart as well.
    U = np.concatenate([np.tile([1.0, 0.0], (5, 1)), np.tile([-1.0, 0.0], (5, 1))])
    U = U + rng.normal(0, 0.01, U.shape)
    U /= np.linalg.norm(U, axis=1, keepdims=True)
    cos = split(U, 2, "cosine", rng)
    assert len(set(cos[:5])) == 1 and len(set(cos[5:])) == 1 and cos[0] != cos[-1]


def test_retrieval_fills_from_siblings_when_the_leaf_is_small() -> None:
    X = _unit_rows(60, 5, seed=3)
    tree = build_tree(X, beta=8, fanout=3, metric="cosine", seed=0)
    q = _unit_rows(1, 5, seed=9)[0]
    sim, node_sim = X @ q, node_representatives(tree, X, "centroid") @ q
    leaf = tree.descend(node_sim)
    leaf_members = set(tree.members(leaf).tolist())
    got = retrieve(tree, sim, 12, node_sim)
    assert got.size == 12 and len(set(got.tolist())) == 12
    assert leaf_members <= set(got.tolist()), "the whole (small) leaf comes first"
    extra = [i for i in got.tolist() if i not in leaf_members]
    parent = int(tree.parent_M[leaf])
    parent_members = set(tree.members(parent).tolist())
    if len(parent_members) >= 12:  # siblings alone can fill the gap: no cousins
        assert set(extra) <= parent_members
    # Within the leaf-sized budget, retrieval is the leaf's own top-alpha.
    few = retrieve(tree, sim, 2, node_sim)
    assert set(few.tolist()) <= leaf_members
    want = sorted(leaf_members, key=lambda i: -sim[i])[:2]
    assert few.tolist() == want


def test_retrieval_returns_everything_when_alpha_exceeds_prompts() -> None:
    X = _unit_rows(10, 3, seed=4)
    tree = build_tree(X, beta=3, fanout=2, metric="cosine", seed=0)
    got = retrieve(tree, X @ X[0], 50, node_representatives(tree, X, "medoid") @ X[0])
    np.testing.assert_array_equal(np.sort(got), np.arange(10))


def test_bf_prediction_is_the_softmax_weighted_mean_of_neighbours() -> None:
    train = synthetic_trace(12, moe_layers=(0,), num_experts=4, top_k=1, seed=5)
    pred = SPSPredictor(RandomEmbedding(8, 1), "bf", alpha=3, temperature=0.5).fit(train)
    req = Request("q", (1, 2, 3, 4))
    u = pred.prompt_vector(req.token_ids)
    sim = pred.U_PD.astype(np.float64) @ u
    top = np.argsort(-sim)[:3]
    w = np.exp(sim[top] / 0.5)
    w /= w.sum()
    want = np.tensordot(w, pred.A_PLE[top], axes=1)
    np.testing.assert_allclose(pred.predict_distribution([req])[0], want, rtol=1e-6)
    np.testing.assert_allclose(pred.predict_counts([req]), want * 4, rtol=1e-6)
    np.testing.assert_allclose(pred.A_PLE.sum(axis=-1), 1.0)


def test_a_profiled_prompt_is_its_own_nearest_neighbour() -> None:
    a = synthetic_trace(30, vocab=20, moe_layers=(0,), num_experts=4, seed=1,
                        request_prefix="a")
    pred = SPSPredictor(RandomEmbedding(16, 0), "tree", alpha=5, beta=10).fit(a)
    tree = pred.tree
    assert tree is not None
    _check_tree(tree, 30, 10)
    idx, sim = pred.neighbours(pred.U_PD[0].astype(np.float64))
    assert idx[0] == 0 and sim[0] == pytest.approx(1.0, abs=1e-6)


def test_custom_embedding_must_be_passed_again_on_load(tmp_path: Path) -> None:
    train = synthetic_trace(10, seed=0)
    emb = FunctionEmbedding(lambda ids: np.eye(64)[np.asarray(ids) % 64], "custom:onehot")
    pred = SPSPredictor(emb, "bf", alpha=3).fit(train)
    path = pred.save(tmp_path / "sps.npz")
    with pytest.raises(DataError, match="cannot rebuild"):
        SPSPredictor.load(path).predict_counts([[1, 2]])
    loaded = SPSPredictor.load(path, embed=emb)
    np.testing.assert_array_equal(loaded.predict_counts([[1, 2]]), pred.predict_counts([[1, 2]]))


def test_wrong_embedding_size_and_bad_parameters() -> None:
    pred = SPSPredictor(RandomEmbedding(8, 0), "bf").fit(synthetic_trace(5, seed=0))
    pred._embed = RandomEmbedding(4, 0)
    with pytest.raises(DataError, match="embedding has size 4"):
        pred.predict_counts([[1]])
    with pytest.raises(DataError):
        SPSPredictor(RandomEmbedding(8, 0), alpha=0)
    with pytest.raises(DataError):
        SPSPredictor(RandomEmbedding(8, 0), method="pam")  # type: ignore[arg-type]
    with pytest.raises(DataError, match="no embedding source"):
        SPSPredictor().fit(synthetic_trace(5, seed=0))


def test_top_alpha_is_the_stable_argsort_prefix() -> None:
    rng = np.random.default_rng(0)
    for n, alpha in ((50, 7), (50, 50), (50, 80), (5, 1), (40, 0)):
        x = rng.integers(0, 6, n).astype(np.float64)  # many ties, incl. at the cut
        np.testing.assert_array_equal(top_alpha(x, alpha),
                                      np.argsort(-x, kind="stable")[:alpha])


@pytest.mark.parametrize(("fanout", "alpha", "update"),
                         [(2, 3, "centroid"), (2, 12, "medoid"), (4, 40, "centroid"),
                          (3, 500, "medoid")])
def test_tree_index_search_equals_reference_retrieval(fanout: int, alpha: int,
                                                      update: str) -> None:
    # Float32 vectors on a coarse grid: every prompt dot product is exact, so the lazy
    # walk and the full-similarity reference must agree bitwise, ties included.
    X = np.round(_unit_rows(300, 6, seed=5) * 8).astype(np.float32) / 8
    tree = build_tree(X.astype(np.float64), beta=20, fanout=fanout, metric="cosine", seed=0,
                      update=update)  # type: ignore[arg-type]
    index = TreeIndex.build(tree, X, update)  # type: ignore[arg-type]
    for q in np.round(_unit_rows(25, 6, seed=6) * 8).astype(np.float32) / 8:
        sim = X @ q
        want = retrieve(tree, sim, min(alpha, 300), index.R_MD @ q)
        got, got_sim = index.search(q, min(alpha, 300))
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got_sim, sim[want])


def _topic_trace(num_requests: int, seed: int, prefix: str) -> Trace:
    """Requests on 4 topics, each with its own 30-token vocabulary whose tokens route to
    the topic's 'home' experts (noise 0.2), so similar prompts have similar activations
    and a global average (DOP) cannot fit any single request."""
    rng = np.random.default_rng(seed)
    rule = np.random.default_rng(99)
    E, K, L = 8, 2, 2
    home = rule.permutation(E * L).reshape(L, E) % E  # topic c's experts per layer
    rid, layer, pos, tok, att, ids = [], [], [], [], [], []
    for r in range(num_requests):
        c = int(rng.integers(4))
        T = int(rng.integers(10, 40))
        t = 30 * c + rng.integers(0, 30, T)
        for li in range(L):
            pref = home[li, 2 * c : 2 * c + 2]
            choice = np.where(rng.random((T, 1)) < 0.8, pref[None, :],
                              rng.integers(0, E, (T, K)))
            choice[:, 1] = np.where(choice[:, 1] == choice[:, 0], (choice[:, 0] + 1) % E,
                                    choice[:, 1])
            rid += [f"{prefix}{r}"] * T
            layer.append(np.full(T, li))
            pos.append(np.arange(T))
            tok.append(t)
            att.append(np.r_[t[:1], t[:-1]])
            ids.append(choice)
    return build_trace(rid, np.concatenate(layer), np.concatenate(pos), np.concatenate(tok),
                       np.concatenate(att), np.concatenate(ids), [E] * L, list(range(L)))


def _sps_bar(results: dict) -> tuple[float, float, float]:
    js = {n: r["js"] for n, r in results["predictors"].items()}
    return js["sps"], js["bf"], js["dop"]


def test_sps_accuracy_bar_on_a_topic_trace() -> None:
    """The issue's bar, on data whose structure is known: SPS JS <= DOP's and within
    10% of BF's (the slow test below checks it on real ShareGPT routing)."""
    emb = RandomEmbedding(32, 0)
    preds = {"sps": SPSPredictor(emb, "tree", beta=40, seed=0),
             "bf": SPSPredictor(emb, "bf"), "dop": DOPPredictor()}
    res = evaluate(preds, _topic_trace(400, 0, "tr"), _topic_trace(80, 1, "te"),
                   batch_tokens=500)
    sps, bf, dop = _sps_bar(res)
    assert sps <= dop and sps <= 1.10 * bf, (sps, bf, dop)
    assert bf < 0.5 * dop, "the trace must reward finding similar prompts"


@pytest.mark.slow
def test_sps_accuracy_bar_on_sharegpt_tiny_moe_lm() -> None:
    """Issue #7: on tiny-moe-lm, trained on sharegpt:train (400 prompts) and scored on
    sharegpt:test (100), SPS's JS divergence is <= DOP's and within 10% of BF's.

    The same numbers as ``moefleet predict eval --model tiny-moe-lm --train
    sharegpt:train --test sharegpt:test --max-tokens 1000000 --test-tokens 1000000``.
    """
    from moefleet.data import load_prompts
    from moefleet.models import load_adapter, zoo
    from moefleet.predict import adapter_embedding
    from moefleet.traces import profile

    if not zoo.has_entry("tiny-moe-lm") or not zoo.is_built("tiny-moe-lm"):
        pytest.skip("tiny-moe-lm is not built in this cache (moefleet models build tiny-moe-lm)")
    adapter = load_adapter("tiny-moe-lm")
    traces = {}
    for split in ("train", "test"):
        prompts = load_prompts("sharegpt", split=split)
        traces[split] = profile(adapter, [p.request_id for p in prompts],
                                [p.text for p in prompts], max_tokens=1_000_000,
                                max_length=256, dataset=f"sharegpt:{split}")
    emb = adapter_embedding(adapter)
    preds = {"sps": SPSPredictor(emb, "tree"), "bf": SPSPredictor(emb, "bf"),
             "dop": DOPPredictor()}
    res = evaluate(preds, traces["train"], traces["test"])
    assert res["test"]["requests"] == 100
    sps, bf, dop = _sps_bar(res)
    assert sps <= dop, (sps, dop)
    assert sps <= 1.10 * bf, (sps, bf)
