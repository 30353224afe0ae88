"""Similar Prompts Searching (Remoe §IV-B) and its brute-force and VarED variants.

Shape legend: P training prompts, Q requests, L MoE layers, E experts (padded), K top-k,
T tokens of a request, D embedding size.

Soft cosine similarity (Remoe eq. 11). Stack the two prompts' L2-normalised token
embeddings as the rows of Z, C = Z Z^T, and let V1, V2 mark which rows belong to which
prompt. Then V1^T C V2 = s1 . s2 and Vj^T C Vj = |sj|^2 with sj = the sum of prompt j's
unit token embeddings, so

    SCS(1, 2) = s1 . s2 / (|s1| |s2| + sigma)

is the cosine of the summed unit embeddings. We keep u_j = s_j / max(|s_j|, sigma) per
prompt and use SCS = u1 . u2 (sigma only guards the empty prompt, as in the paper), so
similarities against all prompts are one matrix-vector product.

Methods (``method``):
- ``tree`` (SPS): clustering tree on cosine distance (:mod:`moefleet.predict.tree`),
  top-alpha retrieval from the reached leaf, siblings fill in. A query multiplies only
  the medoids on its walk and the prompts of the slices it reads
  (:class:`~moefleet.predict.tree.TreeIndex`), O(fanout x depth + beta) dot products;
- ``bf``: the top-alpha most similar prompts of all (Remoe's BF baseline): one
  matrix-vector product over all P prompts and an O(P) selection per query;
- ``vared``: the tree is clustered on squared Euclidean distance between the prompts'
  activation distributions (Remoe's VarED); the walk and the retrieval still use SCS,
  since a new prompt's activations are what we predict.

Prediction for request r with neighbours N(r): weights w = softmax(SCS / temperature) over
N(r) (temperature 1 = the paper's plain softmax); dist_LE(r) = sum_j w_j A_j, where A_j is
prompt j's activation distribution (slot counts / (T_j K): each row sums to 1); the
request's counts are dist_LE(r) * T_r * K and a batch's counts are the sum over requests.

Defaults: alpha = 15 and beta = 150 are Remoe's. Two choices are ours, both made without
the test split (``cluster``, ``fanout``):
- splits update cluster *centroids* (spherical k-means) and the walk compares the query
  with each child's centroid; ``cluster="medoid"`` is the paper's k-medoids, where one
  prompt stands for its cluster. The medoid is a noisy stand-in: on a 4-topic synthetic
  trace its leaves mixed topics and SPS's JS divergence was 1.8-2.1x BF's (3 seeds);
  centroid splits (best of 3 seedings) gave 0.93-0.98x (8 seeds);
- fanout 2 (the paper's tree is "multi-fork" without a number). A query near a split
  boundary loses the neighbours on the far side, and binary splits cut fewer of them.
In 5-fold cross-validation inside the ShareGPT train split on tiny-moe-lm (mean of 3
seeds; SPS's JS over BF's): medoid 1.084 at fanout 4, 1.059 at 2; centroid 1.065 at 4,
1.044 at 2.
"""

from __future__ import annotations

from typing import Any, Literal, Self

import numpy as np

from moefleet.errors import DataError
from moefleet.predict._trace import TraceArrays
from moefleet.predict.base import ExpertPredictor, ModelShape, Request, register_kind
from moefleet.predict.embed import EmbeddingSource, resolve_embedding
from moefleet.predict.tree import (
    ClusterTree,
    Metric,
    TreeIndex,
    Update,
    build_tree,
    top_alpha,
)
from moefleet.traces.schema import Trace

Method = Literal["tree", "bf", "vared"]
SIGMA = 1e-8


@register_kind
class SPSPredictor(ExpertPredictor):
    """Prompt-level prediction from the activations of similar profiled prompts."""

    kind = "sps"

    def __init__(self, embed: EmbeddingSource | None = None, method: Method = "tree",
                 alpha: int = 15, beta: int = 150, fanout: int = 2,
                 temperature: float = 1.0, seed: int = 0,
                 cluster: Update = "centroid") -> None:
        super().__init__()
        if method not in ("tree", "bf", "vared"):
            raise DataError(f"unknown SPS method {method!r}", "use tree, bf or vared")
        if cluster not in ("centroid", "medoid"):
            raise DataError(f"unknown SPS cluster update {cluster!r}",
                            "use centroid (default) or medoid (Remoe's k-medoids)")
        if alpha < 1 or beta < 1 or fanout < 2 or not temperature > 0:
            raise DataError(
                f"bad SPS parameters alpha={alpha}, beta={beta}, fanout={fanout}, "
                f"temperature={temperature}",
                "need alpha >= 1, beta >= 1, fanout >= 2, temperature > 0 "
                "(Remoe: alpha=15, beta=150)",
            )
        self._embed = embed
        self._embed_name = embed.name if embed is not None else ""
        self.method: Method = method
        self.alpha, self.beta, self.fanout = alpha, beta, fanout
        self.temperature, self.seed = float(temperature), seed
        self.cluster: Update = cluster
        self.U_PD = np.zeros((0, 0), np.float32)
        self.A_PLE = np.zeros((0, 0, 0))
        self.tree: ClusterTree | None = None
        self._index: TreeIndex | None = None  # derived from tree + U_PD on first query

    @property
    def embed(self) -> EmbeddingSource:
        """The embedding source; rebuilt from its saved name on first use after load."""
        if self._embed is None:
            if not self._embed_name:
                raise DataError("SPSPredictor has no embedding source",
                                "pass embed=..., e.g. adapter_embedding(adapter)")
            self._embed = resolve_embedding(self._embed_name)
        return self._embed

    def prompt_vector(self, token_ids: tuple[int, ...] | list[int]) -> np.ndarray:
        """u_D: the normalised sum of the prompt's unit token embeddings (zero if empty)."""
        emb_TD = np.asarray(self.embed(list(token_ids)), np.float64)
        if emb_TD.shape[0] == 0:
            return np.zeros(emb_TD.shape[1] if emb_TD.ndim == 2 else self.U_PD.shape[1])
        norms = np.linalg.norm(emb_TD, axis=1, keepdims=True)
        s_D = (emb_TD / np.maximum(norms, SIGMA)).sum(axis=0)
        return s_D / max(float(np.linalg.norm(s_D)), SIGMA)

    def _fit(self, trace: Trace) -> None:
        assert self.shape is not None
        ta = TraceArrays.from_trace(trace, self.shape)
        reqs = ta.requests()
        U_PD = np.stack([self.prompt_vector(r.token_ids) for r in reqs])
        tokens_P = np.array([r.num_tokens for r in reqs], np.float64)
        A_PLE = ta.request_counts() / (tokens_P * self.shape.top_k)[:, None, None]
        self._fit_arrays(U_PD, A_PLE)

    def fit_prompts(self, shape: ModelShape, U_PD: np.ndarray, A_PLE: np.ndarray,
                    model: str = "") -> Self:
        """Fit from what ``fit`` derives from a trace: the prompts' vectors ``U_PD``
        (unit rows from :meth:`prompt_vector`, or zero) and activation distributions
        ``A_PLE`` (each existing layer row sums to 1). For callers that hold these
        already (benchmarks, prompts whose routing was recorded elsewhere)."""
        U_PD, A_PLE = np.asarray(U_PD), np.asarray(A_PLE, np.float64)
        if U_PD.ndim != 2 or U_PD.shape[0] == 0 or A_PLE.shape != (
                U_PD.shape[0], shape.num_moe_layers, shape.max_experts):
            raise DataError(f"need U_PD (P, D) and A_PLE (P, {shape.num_moe_layers}, "
                            f"{shape.max_experts}) with P >= 1; got {U_PD.shape} and "
                            f"{A_PLE.shape}", "pass one row per profiled prompt")
        self.shape, self.model = shape, model
        self._fit_arrays(U_PD, A_PLE)
        return self

    def _fit_arrays(self, U_PD: np.ndarray, A_PLE: np.ndarray) -> None:
        self.U_PD = np.ascontiguousarray(U_PD, np.float32)
        self.A_PLE = A_PLE
        self.tree, self._index = None, None
        if self.method != "bf":
            feats = (self.U_PD.astype(np.float64) if self.method == "tree"
                     else self.A_PLE.reshape(A_PLE.shape[0], -1))
            metric: Metric = "cosine" if self.method == "tree" else "sqeuclidean"
            self.tree = build_tree(feats, self.beta, self.fanout, metric, self.seed,
                                   update=self.cluster)

    def neighbours(self, u_D: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(prompt indices, their SCS), most similar first, of a query vector.

        ``bf`` scores every prompt; ``tree``/``vared`` walk the tree and score only what
        the walk reads. Similarities are float32 dot products in both, so the two agree
        on the prompts they both return.
        """
        if u_D.shape[0] != self.U_PD.shape[1]:
            raise DataError(f"query embedding has size {u_D.shape[0]}, the profiled "
                            f"prompts {self.U_PD.shape[1]}",
                            "use the embedding source the predictor was fitted with")
        u32 = np.asarray(u_D, np.float32)
        alpha = min(self.alpha, self.U_PD.shape[0])
        if self.tree is None:
            sim_P = self.U_PD @ u32
            idx = top_alpha(sim_P, alpha)
            return idx, sim_P[idx].astype(np.float64)
        if self._index is None:
            self._index = TreeIndex.build(self.tree, self.U_PD, self.cluster)
        idx, sim = self._index.search(u32, alpha)
        return idx, sim.astype(np.float64)

    def predict_distribution(self, requests: list[Request]) -> np.ndarray:
        """dist_QLE: each request's predicted activation distribution (rows sum to 1)."""
        self._require_fitted()
        out = np.zeros((len(requests), *self.A_PLE.shape[1:]))
        for q, req in enumerate(requests):
            idx, sim = self.neighbours(self.prompt_vector(req.token_ids))
            z = sim / self.temperature
            w = np.exp(z - z.max())
            out[q] = np.tensordot(w / w.sum(), self.A_PLE[idx], axes=1)
        return out

    def _predict_counts(self, requests: list[Request]) -> np.ndarray:
        assert self.shape is not None
        tokens_Q = np.array([r.num_tokens for r in requests], np.float64)
        dist_QLE = self.predict_distribution(requests)
        return np.tensordot(tokens_Q * self.shape.top_k, dist_QLE, axes=1)

    def _state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        arrays: dict[str, np.ndarray] = {"U": self.U_PD, "A": self.A_PLE}
        if self.tree is not None:
            arrays.update(self.tree.to_arrays())
        params = {"method": self.method, "alpha": self.alpha, "beta": self.beta,
                  "fanout": self.fanout, "temperature": self.temperature, "seed": self.seed,
                  "cluster": self.cluster, "embed": self._embed_name}
        return arrays, params

    @classmethod
    def _from_state(cls, shape: ModelShape, arrays: dict[str, np.ndarray],
                    params: dict[str, Any]) -> Self:
        params = dict(params)
        params.setdefault("cluster", "medoid")  # files from before the option: medoids
        name = params.pop("embed")
        obj = cls(**params)
        obj._embed_name = name
        obj.U_PD = np.ascontiguousarray(arrays["U"], np.float32)
        obj.A_PLE = arrays["A"]
        if any(k.startswith("tree_") for k in arrays):
            obj.tree = ClusterTree.from_arrays(arrays)
        return obj

    @classmethod
    def load(cls, path: Any, embed: EmbeddingSource | None = None) -> Self:
        """Load; ``embed`` replaces the source named in the file (needed for custom ones)."""
        obj = super().load(path)
        if embed is not None:
            obj._embed = embed
        return obj
