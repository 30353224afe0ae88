"""Bayesian token-feature predictor and its count table, against hand-computed numbers.

The hand-built trace (one MoE layer, 3 experts, top-1):

    request A: tokens [5, 7, 5] at positions 0, 1, 2, attention ids [5, 5, 7],
               experts [0, 2, 1]
    request B: tokens [5, 7]    at positions 0, 1,    attention ids [5, 5], experts [0, 2]

Token frequencies: 5 three times, 7 twice -> P'(5) = 0.6, P'(7) = 0.4.
Table for token 5: n(5, pos 0, att 5, e0) = 2, n(5, pos 2, att 7, e1) = 1.
score = (2 * 0.6, 1 * 0.4, 0) = (1.2, 0.4, 0) -> q = (0.75, 0.25, 0), m = 3.
Layer marginal (slot shares): e0 2, e1 1, e2 2 of 5 -> (0.4, 0.2, 0.4).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moefleet.errors import DataError
from moefleet.predict import BayesPredictor, CountTable, TableKey
from moefleet.predict._trace import TraceArrays
from moefleet.predict.synthetic import build_trace, synthetic_trace
from moefleet.predict.table import pack_context, unpack_context
from moefleet.traces.schema import Trace

MARG = np.array([0.4, 0.2, 0.4])


@pytest.fixture
def tiny() -> Trace:
    return build_trace(
        ["A", "A", "A", "B", "B"],
        layer_N=np.array([4, 4, 4, 4, 4]),
        pos_N=np.array([0, 1, 2, 0, 1]),
        tok_N=np.array([5, 7, 5, 5, 7]),
        att_N=np.array([5, 5, 7, 5, 5]),
        ids_NK=np.array([[0], [2], [1], [0], [2]]),
        num_experts=[3],
        moe_layers=[4],
    )


def test_rare_backoff_uses_the_routing_of_rare_tokens(tiny: Trace) -> None:
    # Token 7 was seen twice (both at e2), token 5 three times.
    rare2 = BayesPredictor(backoff="rare", rare_max=2).fit(tiny)
    np.testing.assert_allclose(rare2.posterior([9])[0, 0], [0.0, 0.0, 1.0])
    rare3 = BayesPredictor(backoff="rare", rare_max=3).fit(tiny)  # both tokens are "rare"
    np.testing.assert_allclose(rare3.posterior([9])[0, 0], MARG)
    none = BayesPredictor(backoff="rare", rare_max=1).fit(tiny)  # no rare token: marginal
    np.testing.assert_allclose(none.posterior([9])[0, 0], MARG)
    # Shrinkage of a seen token goes toward that prior: (3 q + 1 * (0, 0, 1)) / 4.
    shrunk = BayesPredictor(backoff="rare", smoothing=1.0).fit(tiny)
    np.testing.assert_allclose(shrunk.posterior([5])[0, 0], [0.5625, 0.1875, 0.25])


def test_posterior_matches_hand_computation(tiny: Trace) -> None:
    sharp = BayesPredictor(smoothing=0.0).fit(tiny)
    np.testing.assert_allclose(sharp.posterior([5])[0, 0], [0.75, 0.25, 0.0])
    smooth = BayesPredictor(smoothing=1.0, backoff="layer").fit(tiny)
    # (3 * q + 1 * marg) / 4
    np.testing.assert_allclose(smooth.posterior([5])[0, 0], [0.6625, 0.2375, 0.1])
    # Without the P'(f3) weighting the raw counts decide: (2/3, 1/3, 0).
    flat = BayesPredictor(smoothing=0.0, attention_weighting=False).fit(tiny)
    np.testing.assert_allclose(flat.posterior([5])[0, 0], [2 / 3, 1 / 3, 0.0])


def test_unseen_tokens_back_off_to_the_layer_marginal(tiny: Trace) -> None:
    for lam in (0.0, 1.0, 10.0):
        pred = BayesPredictor(smoothing=lam, backoff="layer").fit(tiny)
        post = pred.posterior([9, 2**21])  # unseen, and beyond the table's token field
        np.testing.assert_allclose(post[0], [MARG, MARG])


def test_position_backoff_for_unseen_tokens(tiny: Trace) -> None:
    pred = BayesPredictor(backoff="position", backoff_smoothing=2.0).fit(tiny)
    post = pred.posterior([9, 9, 9], positions=[0, 1, 7])[0]
    # Position 0 saw e0 twice: (2 * (1, 0, 0) + 2 * marg) / 4; position 1 saw e2 twice.
    np.testing.assert_allclose(post[0], (np.array([2, 0, 0]) + 2 * MARG) / 4)
    np.testing.assert_allclose(post[1], (np.array([0, 0, 2]) + 2 * MARG) / 4)
    np.testing.assert_allclose(post[2], MARG)  # position never profiled
    # Seen tokens are unaffected when lam_tok = 0.
    np.testing.assert_allclose(pred.posterior([5])[0, 0], [0.75, 0.25, 0.0])


def test_expected_and_map_counts(tiny: Trace) -> None:
    pred = BayesPredictor(smoothing=1.0, backoff="layer").fit(tiny)
    np.testing.assert_allclose(pred.predict_counts([[5, 9]])[0], [1.0625, 0.4375, 0.5])
    # MAP: token 5 -> e0; token 9 -> marginal arg-max, tie e0/e2 goes to the lower id.
    map_pred = BayesPredictor(counts="map", backoff="layer").fit(tiny)
    np.testing.assert_array_equal(map_pred.predict_counts([[5, 5, 9]])[0], [3, 0, 0])
    np.testing.assert_array_equal(pred.predict_topk([5, 7], 2)[0], [[0, 1], [2, 0]])


def test_position_mode_conditions_and_backs_off(tiny: Trace) -> None:
    pred = BayesPredictor(mode="position", smoothing=1.0, position_smoothing=1.0,
                          backoff="layer").fit(tiny)
    token_post = np.array([0.6625, 0.2375, 0.1])
    post = pred.posterior([5, 5, 5], positions=[2, 1, 0])[0]
    # Position 2 saw token 5 once, at e1: (1 * (0, 1, 0) + 1 * token_post) / 2.
    np.testing.assert_allclose(post[0], (np.array([0, 1, 0]) + token_post) / 2)
    # Position 1 never saw token 5: the token posterior exactly.
    np.testing.assert_allclose(post[1], token_post)
    # Position 0 saw it twice at e0: (2 * (1, 0, 0) + token_post) / 3.
    np.testing.assert_allclose(post[2], (np.array([2, 0, 0]) + token_post) / 3)
    # Unseen token at a seen position: the marginal (via the token back-off).
    np.testing.assert_allclose(pred.posterior([9], positions=[0])[0, 0], MARG)
    with pytest.raises(DataError, match="positions"):
        pred.posterior([5, 5], positions=[0])


def test_position_mode_wins_when_routing_depends_on_position() -> None:
    kw = {"position_effect": True, "noise": 0.05, "moe_layers": (0, 1)}
    train = synthetic_trace(300, seed=0, **kw)
    test = TraceArrays.from_trace(synthetic_trace(40, seed=1, request_prefix="t", **kw))
    real = test.counts_LE()
    err = {
        mode: np.abs(BayesPredictor(mode=mode).fit(train).predict_counts(test.requests())
                     - real).mean()
        for mode in ("token", "position")
    }
    assert err["position"] < 0.7 * err["token"]


def test_auto_mode_picks_position_only_where_it_helps(tmp_path: Path) -> None:
    # Routing depends on position parity in MoE layer 1 only.
    kw = {"position_effect": [1], "noise": 0.05, "moe_layers": (0, 1)}
    train = synthetic_trace(300, seed=0, **kw)
    pred = BayesPredictor(mode="auto").fit(train)
    assert pred.layer_modes == ("token", "position")
    assert BayesPredictor.load(pred.save(tmp_path / "auto.npz")).layer_modes == pred.layer_modes
    tokens = [3, 3, 3, 3]
    both = pred.posterior(tokens)
    np.testing.assert_allclose(both[0], BayesPredictor().fit(train).posterior(tokens)[0])
    np.testing.assert_allclose(both[1],
                               BayesPredictor(mode="position").fit(train).posterior(tokens)[1])


def test_expected_inclusion_probability_never_exceeds_one() -> None:
    # K * post(i) is the chance that i is among the token's K experts.
    train = synthetic_trace(60, top_k=2, num_experts=4, seed=3)
    pred = BayesPredictor(mode="position").fit(train)
    post = pred.posterior(list(range(60)))
    assert (2 * post <= 1 + 1e-9).all()
    np.testing.assert_allclose(post.sum(axis=-1), 1.0)


def test_table_get_set_add_and_iteration(tiny: Trace) -> None:
    pred = BayesPredictor(smoothing=0.0).fit(tiny)
    table = pred.table
    assert isinstance(table, CountTable)
    assert len(table) == 3  # (5,0,5,e0)=2, (5,2,7,e1)=1, (7,1,5,e2)=2
    assert table.get((4, 5, 0, 5, 0)) == 2.0
    assert table.get(TableKey(4, 5, 1, 5, 0)) == 0.0
    assert list(table.keys()) == [(4, 5, 0, 5, 0), (4, 5, 2, 7, 1), (4, 7, 1, 5, 2)]
    assert dict(table.items())[TableKey(4, 7, 1, 5, 2)] == 2.0
    assert table.add((4, 5, 2, 7, 1), 2.5) == 3.5
    table.set((4, 9, 0, -1, 2), 4.0)  # a brand-new key, attention not recorded
    assert (4, 9, 0, -1, 2) in table and table.get((4, 9, 0, -1, 2)) == 4.0
    table.set((4, 5, 0, 5, 0), 0.0)  # removes the key
    assert (4, 5, 0, 5, 0) not in table
    assert len(table) == 3


def test_table_edits_change_predictions(tiny: Trace, tmp_path: Path) -> None:
    pred = BayesPredictor(smoothing=1.0, backoff="layer").fit(tiny)
    before = pred.posterior([5])[0, 0].copy()
    pred.table.set((4, 5, 0, 5, 0), 0.0)  # drop the two e0 observations of token 5
    # Token 5 now: q = (0, 1, 0), m = 1; marginal e1 1, e2 2 -> (0, 1/3, 2/3).
    after = pred.posterior([5])[0, 0]
    np.testing.assert_allclose(after, [0.0, 2 / 3, 1 / 3])
    assert not np.allclose(before, after)
    # Edits survive save/load.
    loaded = BayesPredictor.load(pred.save(tmp_path / "edited.npz"))
    np.testing.assert_allclose(loaded.posterior([5])[0, 0], after)
    # A key for a token never profiled makes that token predictable.
    pred.table.set((4, 11, 0, 5, 2), 3.0)
    assert pred.predict_topk([11], 1)[0, 0, 0] == 2


def test_table_rejects_bad_keys(tiny: Trace) -> None:
    table = BayesPredictor().fit(tiny).table
    assert table is not None
    with pytest.raises(DataError, match="not an MoE layer"):
        table.get((3, 5, 0, 5, 0))
    with pytest.raises(DataError, match="expert 3 does not exist"):
        table.set((4, 5, 0, 5, 3), 1.0)
    with pytest.raises(DataError, match=">= 0"):
        table.set((4, 5, 0, 5, 0), -1.0)
    with pytest.raises(DataError, match="would become"):
        table.add((4, 5, 0, 5, 0), -5.0)
    with pytest.raises(DataError, match="position id out of range"):
        table.set((4, 5, 1 << 20, 5, 0), 1.0)


def test_context_packing_round_trips() -> None:
    rng = np.random.default_rng(0)
    cols = (rng.integers(0, 100, 50), rng.integers(0, 1 << 19, 50),
            rng.integers(0, 1 << 15, 50), rng.integers(-1, 1 << 19, 50))
    for got, want in zip(unpack_context(pack_context(*cols)), cols, strict=True):
        np.testing.assert_array_equal(got, want)


def test_trace_without_attention_ids_weights_uniformly(tiny: Trace) -> None:
    ta = TraceArrays.from_trace(tiny)
    no_att = build_trace(["A", "A", "A", "B", "B"], tiny.column("layer"), ta.pos_N, ta.tok_N,
                         np.full(5, -1), ta.ids_NK, [3], [4])
    pred = BayesPredictor(smoothing=0.0).fit(no_att)
    np.testing.assert_allclose(pred.posterior([5])[0, 0], [2 / 3, 1 / 3, 0.0])


def test_bad_parameters() -> None:
    with pytest.raises(DataError):
        BayesPredictor(mode="attention")  # type: ignore[arg-type]
    with pytest.raises(DataError):
        BayesPredictor(smoothing=-1)
