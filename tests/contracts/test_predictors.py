"""Contract of ExpertPredictor, checked for every implementation and mode.

Traces are fabricated (moefleet.predict.synthetic) with layers of different expert
counts (4 and 6), so padding is exercised too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from moefleet.errors import DataError, MoefleetError
from moefleet.predict import (
    BayesPredictor,
    DOPPredictor,
    EFPredictor,
    ExpertPredictor,
    LinaPredictor,
    RandomEmbedding,
    Request,
    SPSPredictor,
    load_predictor,
)
from moefleet.predict._trace import TraceArrays
from moefleet.predict.synthetic import synthetic_trace
from moefleet.traces.schema import Trace

FACTORIES: dict[str, Callable[[], ExpertPredictor]] = {
    "bayes": lambda: BayesPredictor(),
    "bayes-pos": lambda: BayesPredictor(mode="position", smoothing=0.5),
    "bayes-map": lambda: BayesPredictor(counts="map"),
    "bayes-auto": lambda: BayesPredictor(mode="auto", holdout=0.25),
    "bayes-noatt": lambda: BayesPredictor(attention_weighting=False, smoothing=0.0),
    "lina": LinaPredictor,
    "dop": DOPPredictor,
    "ef": EFPredictor,
    "sps": lambda: SPSPredictor(RandomEmbedding(16, 3), "tree", alpha=4, beta=6, seed=1),
    "bf": lambda: SPSPredictor(RandomEmbedding(16, 3), "bf", alpha=4),
    "vared": lambda: SPSPredictor(RandomEmbedding(16, 3), "vared", alpha=4, beta=6, seed=1),
}
NAMES = list(FACTORIES)


@pytest.fixture(scope="module")
def train() -> Trace:
    return synthetic_trace(40, moe_layers=(1, 3), num_experts=(4, 6), top_k=2, seed=0)


@pytest.fixture(scope="module")
def requests() -> list[Request]:
    test = synthetic_trace(6, moe_layers=(1, 3), num_experts=(4, 6), top_k=2, seed=7,
                           request_prefix="test")
    reqs = TraceArrays.from_trace(test).requests()
    # A request with token ids the profile never saw, and an empty one.
    return [*reqs, Request("unseen", (10_000, 10_001, 3)), Request("empty", ())]


@pytest.fixture(scope="module")
def fitted(train: Trace) -> dict[str, ExpertPredictor]:
    return {name: make().fit(train) for name, make in FACTORIES.items()}


@pytest.mark.parametrize("name", NAMES)
def test_counts_shape_nonnegative_and_sum(name: str, fitted, requests) -> None:
    pred = fitted[name]
    counts = pred.predict_counts(requests)
    assert counts.shape == (2, 6)
    assert np.isfinite(counts).all() and (counts >= 0).all()
    assert (counts[0, 4:] == 0).all(), "padded experts of the 4-expert layer must stay 0"
    tokens = sum(r.num_tokens for r in requests)
    np.testing.assert_allclose(counts.sum(axis=1), 2 * tokens, rtol=1e-9)


@pytest.mark.parametrize("name", NAMES)
def test_plain_token_lists_and_empty_batch(name: str, fitted) -> None:
    pred = fitted[name]
    counts = pred.predict_counts([[1, 2, 3], [4]])
    np.testing.assert_allclose(counts.sum(axis=1), 2 * 4, rtol=1e-9)
    assert (pred.predict_counts([]) == 0).all()


@pytest.mark.parametrize("name", NAMES)
def test_deterministic(name: str, fitted, train, requests) -> None:
    again = FACTORIES[name]().fit(train)
    first = fitted[name].predict_counts(requests)
    np.testing.assert_array_equal(first, fitted[name].predict_counts(requests))
    np.testing.assert_array_equal(first, again.predict_counts(requests))


@pytest.mark.parametrize("name", NAMES)
def test_save_load_round_trip(name: str, fitted, requests, tmp_path: Path) -> None:
    pred = fitted[name]
    path = pred.save(tmp_path / f"{name}.npz")
    for loaded in (type(pred).load(path), load_predictor(path)):
        assert type(loaded) is type(pred)
        assert loaded.shape == pred.shape
        np.testing.assert_array_equal(loaded.predict_counts(requests),
                                      pred.predict_counts(requests))
    # No pickled objects inside: numpy must read it with pickling disabled.
    with np.load(path, allow_pickle=False) as npz:
        assert all(npz[k].dtype != object for k in npz.files)


@pytest.mark.parametrize("name", NAMES)
def test_topk_or_clear_refusal(name: str, fitted) -> None:
    pred = fitted[name]
    tokens = [1, 2, 3, 99_999]
    try:
        ids = pred.predict_topk(tokens, 2)
    except NotImplementedError as err:
        assert "top-k" in str(err)
        return
    assert ids.shape == (2, 4, 2)
    assert (ids[0] < 4).all() and (ids[1] < 6).all() and (ids >= 0).all()
    assert (ids[..., 0] != ids[..., 1]).all(), "top-k ids of a token are distinct"
    with pytest.raises(DataError):
        pred.predict_topk(tokens, 5)  # more than the 4 experts of the first layer


@pytest.mark.parametrize("name", NAMES)
def test_fit_on_empty_trace_is_an_error(name: str, train: Trace) -> None:
    empty = Trace(train.table.slice(0, 0), train.meta)
    with pytest.raises(DataError, match="empty trace"):
        FACTORIES[name]().fit(empty)


@pytest.mark.parametrize("name", NAMES)
def test_unfitted_and_bad_input(name: str, fitted) -> None:
    with pytest.raises(MoefleetError, match="not fitted"):
        FACTORIES[name]().predict_counts([[1, 2]])
    with pytest.raises(DataError, match="non-negative"):
        fitted[name].predict_counts([[1, -2]])


def test_load_rejects_other_kind_and_garbage(fitted, tmp_path: Path) -> None:
    path = fitted["lina"].save(tmp_path / "lina.npz")
    with pytest.raises(DataError, match="holds a 'lina' predictor"):
        BayesPredictor.load(path)
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(DataError):
        load_predictor(bad)
    with pytest.raises(DataError, match="does not exist"):
        load_predictor(tmp_path / "missing.npz")


# ---- bad input: another model, another format version, unseen tokens ---------------------


def _other(train: Trace, **change: object) -> Trace:
    """A trace shaped like ``train`` but for another model (``change`` says how)."""
    kw: dict = {"moe_layers": (1, 3), "num_experts": (4, 6), "top_k": 2, "seed": 3}
    model = change.pop("model", None)
    kw.update(change)
    trace = synthetic_trace(5, **kw)
    return Trace(trace.table, {**trace.meta, "model": model}) if model else trace


@pytest.mark.parametrize(
    ("change", "both_values"),
    [
        ({"num_experts": (4, 8)}, "experts per layer [4, 6] vs [4, 8]"),
        ({"top_k": 1}, "top-k 2 vs 1"),
        ({"moe_layers": (1, 2)}, "MoE layers [1, 3] vs [1, 2]"),
        ({"model": "tiny-moe-lm"}, "model 'synthetic' vs 'tiny-moe-lm'"),
    ],
)
def test_trace_of_another_model_is_refused_naming_both_values(
    change: dict, both_values: str, fitted, train: Trace
) -> None:
    from moefleet.predict import evaluate

    other = _other(train, **change)
    for name in NAMES:
        with pytest.raises(DataError, match="different models") as err:
            fitted[name].check_trace(other)
        assert both_values in str(err.value)
    # The harness checks a pre-fitted predictor the same way before scoring it.
    with pytest.raises(DataError, match=both_values.replace("[", r"\[")):
        evaluate({"dop": fitted["dop"]}, None, other)
    fitted["dop"].check_trace(train)  # its own model passes


def test_load_refuses_another_format_version_naming_both(fitted, tmp_path: Path) -> None:
    import json

    from moefleet.predict.base import FORMAT_VERSION

    path = fitted["bayes"].save(tmp_path / "bayes.npz")
    with np.load(path, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    meta = json.loads(str(arrays["__meta__"]))
    assert meta["format"] == FORMAT_VERSION and meta["model"] == "synthetic"
    for version, hint in ((FORMAT_VERSION + 1, "upgrade"), (FORMAT_VERSION - 1, "refit")):
        bad = tmp_path / f"v{version}.npz"
        np.savez(bad, **{**arrays, "__meta__": np.array(json.dumps({**meta, "format": version}))})
        for load in (load_predictor, BayesPredictor.load):
            with pytest.raises(DataError) as err:
                load(bad)
            text = str(err.value) + str(err.value.hint)
            assert f"format v{version}" in text and f"v{FORMAT_VERSION} only" in text
            assert hint in text
    assert BayesPredictor.load(path).model == "synthetic"  # the model name round-trips


@pytest.mark.parametrize("name", NAMES)
def test_batch_of_only_unseen_tokens_backs_off(name: str, fitted) -> None:
    pred = fitted[name]
    # Never profiled, beyond every packed id field, and a repeat: counts, not a crash.
    batch = [[10**6, 2**40, 10**6], [123_457]]
    counts = pred.predict_counts(batch)
    assert np.isfinite(counts).all() and (counts >= 0).all()
    np.testing.assert_allclose(counts.sum(axis=1), 2 * 4, rtol=1e-9)
