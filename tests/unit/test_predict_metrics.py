"""Metrics against hand-computed values, and the evaluation harness on fabricated traces."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from moefleet.errors import DataError, UnknownNameError
from moefleet.predict import (
    PredictorContext,
    RandomEmbedding,
    Request,
    abs_diff_per_expert,
    abs_diff_per_layer,
    evaluate,
    js_divergence_LE,
    make_predictors,
    plot_results,
    results_table,
    topk_hit_rate,
)
from moefleet.predict.harness import make_batches, parse_names
from moefleet.predict.synthetic import synthetic_trace


def test_abs_diff_with_padding_mask() -> None:
    pred = np.array([[10.0, 0.0, 5.0], [1.0, 2.0, 0.0]])
    real = np.array([[8.0, 1.0, 5.0], [2.0, 2.0, 0.0]])
    mask = np.array([[True, True, True], [True, True, False]])
    # |2| + |1| + 0 + |1| + 0 over 5 real experts.
    assert abs_diff_per_expert(pred, real, mask) == pytest.approx(4 / 5)
    np.testing.assert_allclose(abs_diff_per_layer(pred, real, mask), [1.0, 0.5])
    with pytest.raises(DataError):
        abs_diff_per_expert(pred, real[:1])


def test_js_divergence_hand_values() -> None:
    # p = (1, 0), q = (0.5, 0.5): m = (0.75, 0.25);
    # KL(p||m) = log2(4/3); KL(q||m) = 0.5 log2(2/3) + 0.5 log2(2).
    want = 0.5 * math.log2(4 / 3) + 0.5 * (0.5 * math.log2(2 / 3) + 0.5)
    js = js_divergence_LE(np.array([[4.0, 0.0], [1.0, 0.0], [3.0, 3.0]]),
                          np.array([[1.0, 1.0], [0.0, 7.0], [1.0, 1.0]]))
    np.testing.assert_allclose(js, [want, 1.0, 0.0], atol=1e-12)
    assert math.isnan(js_divergence_LE(np.zeros((1, 2)), np.ones((1, 2)))[0])


def test_topk_hit_rate_hand_values() -> None:
    pred = np.array([[0, 1], [2, 3], [1, 0]])
    real = np.array([[1, 0], [3, 1], [2, 3]])
    assert topk_hit_rate(pred, real) == pytest.approx((2 + 1 + 0) / 6)
    assert topk_hit_rate(pred[:, :1], real) == pytest.approx((1 + 0 + 0) / 6)
    with pytest.raises(DataError):
        topk_hit_rate(pred[:2], real)


def test_batches_are_whole_requests() -> None:
    reqs = [Request(str(i), tuple(range(n))) for i, n in enumerate([4, 4, 3, 9, 2, 1])]
    batches = make_batches(reqs, 8)
    assert [[r.request_id for r in b] for b in batches] == [["0", "1"], ["2", "3"]]
    # The short tail (3 tokens < 8 / 2) is dropped; one short batch alone is kept.
    assert len(make_batches(reqs[:1], 100)) == 1
    with pytest.raises(DataError):
        make_batches(reqs, 0)


def test_parse_names_errors() -> None:
    assert parse_names("bayes, lina,bayes") == ["bayes", "lina"]
    with pytest.raises(UnknownNameError, match="did you mean 'bayes'"):
        parse_names("bayse")
    with pytest.raises(UnknownNameError):
        parse_names(" , ")
    with pytest.raises(DataError, match="needs token embeddings"):
        make_predictors("sps")


def test_evaluate_ranks_predictors_sensibly(tmp_path: Path) -> None:
    train = synthetic_trace(150, seed=0, noise=0.1)
    test = synthetic_trace(40, seed=1, request_prefix="t", noise=0.1)
    preds = make_predictors("bayes,lina,dop,ef,sps", PredictorContext(RandomEmbedding(8, 0)))
    res = evaluate(preds, train, test, batch_tokens=300)
    r = res["predictors"]
    assert res["reference"] == "lina" and r["lina"]["ratio"] == 1.0
    # Routing is a function of the token here: expected counts beat MAP and averages.
    assert r["bayes"]["abs_diff"] < r["lina"]["abs_diff"]
    assert r["bayes"]["abs_diff"] < r["dop"]["abs_diff"] < r["ef"]["abs_diff"]
    assert r["bayes"]["hit_rate"] > 0.8 and r["ef"]["hit_rate"] is None
    assert r["bayes"]["batches"] == len(r["bayes"]["batch_tokens"]) >= 2
    assert all(t >= 150 for t in r["bayes"]["batch_tokens"])
    assert len(r["bayes"]["abs_diff_per_layer"]) == 2 and 0 <= r["sps"]["js"] <= 1
    # Already fitted: train_trace=None scores without refitting.
    again = evaluate(preds, None, test, batch_tokens=300)
    assert again["predictors"]["bayes"]["abs_diff"] == r["bayes"]["abs_diff"]
    assert again["predictors"]["bayes"]["fit_s"] is None
    table = results_table({"syn": res})
    assert table.row_count == 5
    png = plot_results({"syn": res, "again": again}, tmp_path / "chart.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_evaluate_rejects_mismatched_models() -> None:
    train = synthetic_trace(10, moe_layers=(0, 1), seed=0)
    test = synthetic_trace(5, moe_layers=(0, 1, 2), seed=1)
    with pytest.raises(DataError, match="different models"):
        evaluate(make_predictors("dop"), train, test)
