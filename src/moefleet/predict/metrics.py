"""Accuracy metrics for expert-popularity predictions.

Shape legend: L MoE layers, E experts (padded), N tokens, K top-k.

- :func:`abs_diff_per_expert` -- ODS/BO Fig. 10: the mean over (layer, expert) of
  |predicted - real| token counts for one batch (padded experts excluded).
- :func:`js_divergence_LE` -- Remoe Fig. 8: Jensen-Shannon divergence, base 2 (so in
  [0, 1]), between the per-layer activation distributions (counts normalised per layer).
- :func:`topk_hit_rate` -- fraction of the real top-K expert slots that the predicted
  top-k contains, averaged over tokens (and layers, when given 3-d arrays).
"""

from __future__ import annotations

import numpy as np

from moefleet.errors import DataError


def _mask(shape: tuple[int, ...], mask_LE: np.ndarray | None) -> np.ndarray:
    return np.ones(shape, bool) if mask_LE is None else np.asarray(mask_LE, bool)


def abs_diff_per_expert(pred_LE: np.ndarray, real_LE: np.ndarray,
                        mask_LE: np.ndarray | None = None) -> float:
    """Mean |pred - real| over the existing (layer, expert) pairs."""
    pred_LE, real_LE = np.asarray(pred_LE, float), np.asarray(real_LE, float)
    if pred_LE.shape != real_LE.shape:
        raise DataError(f"predicted counts have shape {pred_LE.shape}, real {real_LE.shape}",
                        "predict for the same model the real counts come from")
    m = _mask(real_LE.shape, mask_LE)
    return float(np.abs(pred_LE - real_LE)[m].mean())


def abs_diff_per_layer(pred_LE: np.ndarray, real_LE: np.ndarray,
                       mask_LE: np.ndarray | None = None) -> np.ndarray:
    """(L,) mean |pred - real| over each layer's experts."""
    m = _mask(np.shape(real_LE), mask_LE)
    diff = np.abs(np.asarray(pred_LE, float) - np.asarray(real_LE, float)) * m
    return diff.sum(axis=1) / m.sum(axis=1)


def _normalise(x_LE: np.ndarray) -> np.ndarray:
    x_LE = np.clip(np.asarray(x_LE, float), 0.0, None)
    tot = x_LE.sum(axis=-1, keepdims=True)
    return x_LE / np.where(tot > 0, tot, 1.0)


def _kl2(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    # 0 log 0 = 0; where p > 0 the mixture q = (p + r) / 2 > 0 too.
    ratio = np.where(p > 0, p / np.where(q > 0, q, 1.0), 1.0)
    return (p * np.log2(ratio)).sum(axis=-1)


def js_divergence_LE(pred_LE: np.ndarray, real_LE: np.ndarray) -> np.ndarray:
    """(L,) JS divergence (base 2) between per-layer distributions of two count arrays.

    Each row is normalised to sum 1 first; a row that is all zero on either side gives
    NaN (nothing to compare), which callers drop with ``np.nanmean``.
    """
    p, q = _normalise(pred_LE), _normalise(real_LE)
    m = 0.5 * (p + q)
    js = 0.5 * _kl2(p, m) + 0.5 * _kl2(q, m)
    empty = (np.asarray(pred_LE).sum(-1) <= 0) | (np.asarray(real_LE).sum(-1) <= 0)
    return np.where(empty, np.nan, np.clip(js, 0.0, 1.0))


def topk_hit_rate(pred_ids: np.ndarray, real_ids: np.ndarray) -> float:
    """Mean over tokens of |pred top-k  intersect  real top-K| / K.

    Shapes (..., k) and (..., K) with the same leading dims; ids within a row are
    distinct (as routers and top-k predictions produce them).
    """
    pred_ids, real_ids = np.asarray(pred_ids), np.asarray(real_ids)
    if pred_ids.shape[:-1] != real_ids.shape[:-1]:
        raise DataError(f"predicted ids {pred_ids.shape} and real ids {real_ids.shape} "
                        "cover different tokens", "predict for the same tokens")
    if real_ids.size == 0:
        return float("nan")
    hits = (pred_ids[..., :, None] == real_ids[..., None, :]).any(axis=-2)
    return float(hits.sum(axis=-1).mean() / real_ids.shape[-1])
