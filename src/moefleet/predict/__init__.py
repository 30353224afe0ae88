"""Expert-popularity predictors: how many tokens each expert will get.

    from moefleet.predict import BayesPredictor, evaluate
    pred = BayesPredictor().fit(train_trace)          # a routing trace (moefleet.traces)
    counts_LE = pred.predict_counts([[464, 3290, 318], [40, 1101]])
    pred.table.add((layer, token, position, attention, expert), 5)   # BO edits

Implementations: :class:`BayesPredictor` (ODS/BO token features), :class:`LinaPredictor`,
:class:`DOPPredictor`, :class:`EFPredictor` (baselines), :class:`SPSPredictor` (Remoe
Similar Prompts Searching; also its BF and VarED variants). All follow
:class:`ExpertPredictor`; :func:`load_predictor` reads any saved one.
"""

from moefleet.predict.base import (
    ExpertPredictor,
    ModelShape,
    Request,
    as_requests,
    load_predictor,
)
from moefleet.predict.baselines import DOPPredictor, EFPredictor, LinaPredictor
from moefleet.predict.bayes import BayesPredictor
from moefleet.predict.embed import (
    EmbeddingSource,
    FunctionEmbedding,
    MatrixEmbedding,
    MiniLMEmbedding,
    RandomEmbedding,
    adapter_embedding,
    make_embedding,
    resolve_embedding,
)
from moefleet.predict.harness import (
    PREDICTORS,
    PredictorContext,
    evaluate,
    make_predictors,
    plot_results,
    results_table,
)
from moefleet.predict.metrics import (
    abs_diff_per_expert,
    abs_diff_per_layer,
    js_divergence_LE,
    topk_hit_rate,
)
from moefleet.predict.sps import SPSPredictor
from moefleet.predict.table import CountTable, TableKey

__all__ = [
    "PREDICTORS",
    "BayesPredictor",
    "CountTable",
    "DOPPredictor",
    "EFPredictor",
    "EmbeddingSource",
    "ExpertPredictor",
    "FunctionEmbedding",
    "LinaPredictor",
    "MatrixEmbedding",
    "MiniLMEmbedding",
    "ModelShape",
    "PredictorContext",
    "RandomEmbedding",
    "Request",
    "SPSPredictor",
    "TableKey",
    "abs_diff_per_expert",
    "abs_diff_per_layer",
    "adapter_embedding",
    "as_requests",
    "evaluate",
    "js_divergence_LE",
    "load_predictor",
    "make_embedding",
    "make_predictors",
    "plot_results",
    "resolve_embedding",
    "results_table",
    "topk_hit_rate",
]
