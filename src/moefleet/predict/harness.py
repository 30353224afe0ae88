"""Fit predictors on one trace, score them on another: numbers, a table and a chart.

Shape legend: L MoE layers, E experts (padded), K top-k, T tokens of a request.

Scoring (``evaluate``):
- the test requests are grouped, in order, into batches of whole requests holding at
  least ``batch_tokens`` tokens each (a final short batch is kept only if it has at least
  half of ``batch_tokens`` or is the only one); per batch the predictor's ``counts_LE``
  is compared with the real counts: ``abs_diff`` = mean over batches of the mean per-expert
  absolute difference (ODS/BO Fig. 10), ``abs_diff_rel`` = that over the mean real count
  per expert;
- ``js``: mean over requests and layers of the JS divergence (base 2) between each
  request's predicted and real activation distributions (Remoe Fig. 8);
- ``hit_rate``: top-K hit rate over all test tokens, or None for predictors without
  per-token prediction;
- ``ratio``: ``abs_diff`` over the reference predictor's (``lina`` by default).
"""

from __future__ import annotations

import difflib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moefleet.errors import DataError, UnknownNameError
from moefleet.predict._trace import TraceArrays
from moefleet.predict.base import ExpertPredictor, ModelShape, Request, check_same_model
from moefleet.predict.baselines import DOPPredictor, EFPredictor, LinaPredictor
from moefleet.predict.bayes import BayesPredictor
from moefleet.predict.embed import EmbeddingSource
from moefleet.predict.metrics import (
    abs_diff_per_expert,
    abs_diff_per_layer,
    js_divergence_LE,
    topk_hit_rate,
)
from moefleet.predict.sps import SPSPredictor
from moefleet.traces.schema import Trace


@dataclass(frozen=True)
class PredictorContext:
    """What factories may need: an embedding source (SPS family) and a seed."""

    embed: EmbeddingSource | None = None
    seed: int = 0


def _need_embed(ctx: PredictorContext, name: str) -> EmbeddingSource:
    if ctx.embed is None:
        raise DataError(f"predictor {name!r} needs token embeddings",
                        "pass --model (its input embeddings are used) or --embed random")
    return ctx.embed


# name -> (description, factory)
PREDICTORS: dict[str, tuple[str, Callable[[PredictorContext], ExpertPredictor]]] = {
    "bayes": ("Bayesian token features (ODS/BO eq. 1: P'(f3)-weighted), expected counts",
              lambda c: BayesPredictor()),
    "bayes-pos": ("bayes conditioned on the known position, back-off to bayes",
                  lambda c: BayesPredictor(mode="position")),
    "bayes-flat": ("bayes without the P'(f3) weighting (token-id statistics, expected)",
                   lambda c: BayesPredictor(attention_weighting=False)),
    "bayes-pos-flat": ("bayes-pos without the P'(f3) weighting",
                       lambda c: BayesPredictor(mode="position", attention_weighting=False)),
    "bayes-auto": ("bayes with token or position mode chosen per layer on held-out data",
                   lambda c: BayesPredictor(mode="auto")),
    "bayes-map": ("bayes, counts of each token's MAP top-K (ODS/BO eq. 2)",
                  lambda c: BayesPredictor(counts="map")),
    "bayes-pos-map": ("bayes-pos, counts of each token's MAP top-K",
                      lambda c: BayesPredictor(mode="position", counts="map")),
    "lina": ("token-id-only MAP top-K, back-off to layer popularity",
             lambda c: LinaPredictor()),
    "dop": ("historical per-layer distribution", lambda c: DOPPredictor()),
    "ef": ("equal frequency", lambda c: EFPredictor()),
    "sps": ("Similar Prompts Searching (clustering tree)",
            lambda c: SPSPredictor(_need_embed(c, "sps"), "tree", seed=c.seed)),
    "bf": ("SPS with brute-force neighbour search",
           lambda c: SPSPredictor(_need_embed(c, "bf"), "bf", seed=c.seed)),
    "vared": ("SPS tree clustered on Euclidean distance of activations",
              lambda c: SPSPredictor(_need_embed(c, "vared"), "vared", seed=c.seed)),
}
EMBEDDING_PREDICTORS = frozenset({"sps", "bf", "vared"})


def parse_names(names: str | Sequence[str]) -> list[str]:
    """Split ``"a,b"``, check every name, keep order, drop duplicates."""
    items = names.split(",") if isinstance(names, str) else list(names)
    out: list[str] = []
    for raw in items:
        name = raw.strip().lower()
        if not name:
            continue
        if name not in PREDICTORS:
            close = difflib.get_close_matches(name, list(PREDICTORS), n=1)
            guess = f"did you mean {close[0]!r}? " if close else ""
            raise UnknownNameError(f"unknown predictor {raw.strip()!r}",
                                   f"{guess}known: {', '.join(PREDICTORS)}")
        if name not in out:
            out.append(name)
    if not out:
        raise UnknownNameError("no predictors given", f"pick from: {', '.join(PREDICTORS)}")
    return out


def make_predictors(names: str | Sequence[str], ctx: PredictorContext | None = None,
                    ) -> dict[str, ExpertPredictor]:
    ctx = ctx or PredictorContext()
    return {n: PREDICTORS[n][1](ctx) for n in parse_names(names)}


def make_batches(requests: Sequence[Request], batch_tokens: int) -> list[list[Request]]:
    """Whole requests, in order, grouped as described in the module doc."""
    if batch_tokens <= 0:
        raise DataError(f"batch_tokens must be positive, got {batch_tokens}",
                        "use e.g. 10240 (ODS/BO)")
    out: list[list[Request]] = []
    cur: list[Request] = []
    n = 0
    for req in requests:
        cur.append(req)
        n += req.num_tokens
        if n >= batch_tokens:
            out.append(cur)
            cur, n = [], 0
    if cur and (not out or 2 * n >= batch_tokens):
        out.append(cur)
    return out




def score(pred: ExpertPredictor, ta: TraceArrays, batch_tokens: int) -> dict[str, Any]:
    """All metrics of one fitted predictor on one test trace (see module doc)."""
    shape = ta.shape
    mask = shape.mask_LE()
    reqs = ta.requests()
    real_PLE = ta.request_counts()
    index = {r.request_id: p for p, r in enumerate(reqs)}
    t0 = time.perf_counter()
    diffs, layer_diffs, real_means, batch_sizes = [], [], [], []
    for batch in make_batches(reqs, batch_tokens):
        real = real_PLE[[index[r.request_id] for r in batch]].sum(axis=0)
        pred_LE = pred.predict_counts(batch)
        diffs.append(abs_diff_per_expert(pred_LE, real, mask))
        layer_diffs.append(abs_diff_per_layer(pred_LE, real, mask))
        real_means.append(float(real[mask].mean()))
        batch_sizes.append(sum(r.num_tokens for r in batch))
    predict_s = time.perf_counter() - t0
    js = np.array([js_divergence_LE(pred.predict_counts([r]), real_PLE[p])
                   for p, r in enumerate(reqs)])
    hit: float | None
    try:
        pred_ids = [pred.predict_topk(list(r.token_ids), shape.top_k) for r in reqs]
        real_ids = ta.request_expert_ids()
        hit = topk_hit_rate(np.concatenate(pred_ids, axis=1), np.concatenate(real_ids, axis=1))
    except NotImplementedError:
        hit = None
    abs_diff = float(np.mean(diffs))
    return {
        "abs_diff": abs_diff,
        "abs_diff_rel": abs_diff / float(np.mean(real_means)),
        "abs_diff_per_layer": np.mean(layer_diffs, axis=0).tolist(),
        "js": float(np.nanmean(js)),
        "js_per_layer": np.nanmean(js, axis=0).tolist(),
        "hit_rate": hit,
        "batches": len(diffs),
        "batch_tokens": batch_sizes,
        "predict_s": predict_s,
    }


def evaluate(predictors: Mapping[str, ExpertPredictor], train_trace: Trace | None,
             test_trace: Trace, *, batch_tokens: int = 10240, reference: str = "lina",
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Fit each predictor on ``train_trace`` (skip with None: already fitted) and score
    it on ``test_trace``. Returns a JSON-able dict (see module doc for the metrics)."""
    if test_trace.table.num_rows == 0:
        raise DataError("the test trace is empty", "profile more test prompts")
    test = TraceArrays.from_trace(test_trace)
    out: dict[str, Any] = {
        "batch_tokens": batch_tokens,
        "model": test_trace.meta.get("model", ""),
        "top_k": test.shape.top_k,
        "test": {"dataset": test_trace.meta.get("dataset", ""), "tokens": test_trace.num_tokens,
                 "requests": test.num_requests},
        "predictors": {},
    }
    if train_trace is not None:
        check_same_model("the train and test traces",
                         str(train_trace.meta.get("model") or ""),
                         ModelShape.from_trace(train_trace),
                         str(test_trace.meta.get("model") or ""), test.shape)
        out["train"] = {"dataset": train_trace.meta.get("dataset", ""),
                        "tokens": train_trace.num_tokens,
                        "requests": int(train_trace.meta.get("num_requests", 0))}
    for name, pred in predictors.items():
        if progress:
            progress(name)
        fit_s = None
        if train_trace is not None:
            t0 = time.perf_counter()
            pred.fit(train_trace)
            fit_s = time.perf_counter() - t0
        else:
            pred.check_trace(test_trace)  # fitted elsewhere: it must be this model's
        out["predictors"][name] = {**score(pred, test, batch_tokens), "fit_s": fit_s}
    res = out["predictors"]
    if reference in res and res[reference]["abs_diff"] > 0:
        for r in res.values():
            r["ratio"] = r["abs_diff"] / res[reference]["abs_diff"]
        out["reference"] = reference
    return out


def results_table(results: Mapping[str, Mapping[str, Any]], title: str = "") -> Any:
    """A rich Table of ``{test name: evaluate(...) result}``."""
    from moefleet.report.tables import Col, fit_table, sig3

    # Names fold onto more lines and numbers stay whole on narrow terminals; the fit
    # time goes first, then the top-K hit rate (the JSON keeps both).
    cols = [Col("test", numeric=False), Col("predictor", numeric=False),
            Col("abs diff (tokens)"), Col("ratio vs lina"), Col("rel"), Col("JS"),
            Col("top-K hit", drop=1), Col("fit (s)", drop=2)]
    rows = [[test, name, sig3(r["abs_diff"]), sig3(r.get("ratio")), sig3(r["abs_diff_rel"]),
             sig3(r["js"]), sig3(r["hit_rate"]), sig3(r["fit_s"])]
            for test, res in results.items() for name, r in res["predictors"].items()]
    return fit_table(title or None, cols, rows)


def plot_results(results: Mapping[str, Mapping[str, Any]], path: str | Path,
                 title: str = "") -> Path:
    """Grouped bars: abs diff per expert and JS divergence per predictor and test set."""
    from moefleet.report.figures import pyplot, save_png

    plt = pyplot()


    tests = list(results)
    names = list(dict.fromkeys(n for r in results.values() for n in r["predictors"]))
    fig, axes = plt.subplots(2, 1, figsize=(min(16.0, max(6.0, 0.8 * len(names))), 7))
    width = 0.8 / max(1, len(tests))
    x = np.arange(len(names))
    for ax, metric, label in ((axes[0], "abs_diff", "avg |pred - real| tokens per expert"),
                              (axes[1], "js", "JS divergence (base 2)")):
        for i, test in enumerate(tests):
            vals = [results[test]["predictors"].get(n, {}).get(metric, np.nan) for n in names]
            ax.bar(x + i * width - 0.4 + width / 2, vals, width, label=test)
        ax.set_xticks(x, names, rotation=30, ha="right")
        ax.set_ylabel(label, fontsize="small")
        ax.set_yscale("log")  # equal-frequency bars are often 10x the rest
    axes[0].legend(fontsize="small")
    if title:
        fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    return save_png(fig, path, dpi=120)
