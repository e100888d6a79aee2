"""Quality metrics of CTR models: log loss, normalized entropy, AUC, relative log loss.

Every metric is computed in float64 on the CPU, whatever the dtype and device of its inputs
(a bf16 CUDA tensor, a float32 numpy array, a list of floats), so that two runs compared at
the 0.02% level are not compared through float32 rounding.

Undefined values are ``nan``, not errors: NE when every label is the same (the entropy of
the click rate is 0), AUC when only one class is present. Malformed inputs (empty, mismatched
lengths, labels outside [0, 1]) raise :class:`~loka_tune.errors.DataError`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from loka_tune.errors import DataError

__all__ = [
    "log_loss",
    "binary_entropy",
    "normalized_entropy",
    "auc",
    "relative_log_loss",
]

# Probabilities are clipped to [_EPS, 1 - _EPS] so that a confident wrong probability costs
# -log(1e-15) ~ 34.5 nats instead of inf (the usual convention, e.g. sklearn's log_loss).
_EPS = 1e-15


def _as_f64(x: Any, what: str) -> np.ndarray:
    """``x`` (torch tensor, numpy array or sequence) as a flat float64 numpy array."""
    try:
        import torch

        if isinstance(x, torch.Tensor):
            return x.detach().to(device="cpu", dtype=torch.float64).reshape(-1).numpy()
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
    arr = np.asarray(x, dtype=np.float64).reshape(-1)
    return arr


def _pair(labels: Any, values: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
    y = _as_f64(labels, "labels")
    v = _as_f64(values, what)
    if y.size == 0:
        raise DataError("labels are empty: a metric needs at least one example")
    if y.shape != v.shape:
        raise DataError(
            f"labels and {what} differ in length: {y.size} vs {v.size}; pass one {what[:-1]} per label"
        )
    if not np.all((y >= 0.0) & (y <= 1.0)):
        bad = y[~((y >= 0.0) & (y <= 1.0))][0]
        raise DataError(f"labels must lie in [0, 1] (clicks are 0 or 1), got {bad!r}")
    return y, v


def log_loss(labels: Any, probs_or_logits: Any, from_logits: bool = True) -> float:
    """Mean binary cross-entropy (nats) of ``labels`` under the predictions, in float64.

    With ``from_logits=True`` (the default) the predictions are logits ``z`` and the loss is
    the numerically stable ``max(z, 0) - z*y + log1p(exp(-|z|))``, exact for any finite ``z``.
    With ``from_logits=False`` they are probabilities, clipped to ``[1e-15, 1 - 1e-15]``.
    Non-finite predictions give a non-finite (nan or inf) loss.
    """
    y, v = _pair(labels, probs_or_logits, "logits" if from_logits else "probs")
    if from_logits:
        losses = np.maximum(v, 0.0) - v * y + np.log1p(np.exp(-np.abs(v)))
    else:
        if np.any((v < 0.0) | (v > 1.0)):
            bad = v[(v < 0.0) | (v > 1.0)][0]
            raise DataError(
                f"probabilities must lie in [0, 1], got {bad!r}: pass from_logits=True for logits"
            )
        p = np.clip(v, _EPS, 1.0 - _EPS)
        losses = -(y * np.log(p) + (1.0 - y) * np.log1p(-p))
    return float(np.mean(losses))


def binary_entropy(p: float) -> float:
    """``-(p log p + (1-p) log(1-p))`` in nats; 0 at ``p`` in {0, 1}."""
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise DataError(f"a click rate must lie in [0, 1], got {p!r}")
    if p in (0.0, 1.0):
        return 0.0
    return -(p * math.log(p) + (1.0 - p) * math.log1p(-p))


def normalized_entropy(labels: Any, logits: Any, from_logits: bool = True) -> float:
    """Normalized entropy: log loss divided by the entropy of the mean click rate of ``labels``.

    NE < 1 means the model beats always predicting the average click rate. ``nan`` when all
    labels are equal (that entropy is 0).
    """
    y, _ = _pair(labels, logits, "logits" if from_logits else "probs")
    h = binary_entropy(float(np.mean(y)))
    ll = log_loss(labels, logits, from_logits=from_logits)
    return ll / h if h > 0.0 else math.nan


def auc(labels: Any, scores: Any) -> float:
    """Area under the ROC curve, rank based (Mann-Whitney U), ties counted as one half.

    ``scores`` are any monotone function of the click probability (logits or probabilities).
    Labels must be 0 or 1. ``nan`` when only one class is present or a score is nan.
    """
    y, s = _pair(labels, scores, "scores")
    if not np.all((y == 0.0) | (y == 1.0)):
        bad = y[~((y == 0.0) | (y == 1.0))][0]
        raise DataError(f"AUC needs labels that are exactly 0 or 1, got {bad!r}")
    n_pos = float(np.sum(y))
    n_neg = float(y.size) - n_pos
    if n_pos == 0.0 or n_neg == 0.0 or np.isnan(s).any():
        return math.nan
    ranks = _average_ranks(s)  # (n,) float64, 1-based, ties averaged
    u = float(np.sum(ranks[y == 1.0])) - n_pos * (n_pos + 1.0) / 2.0
    return u / (n_pos * n_neg)


def _average_ranks(s: np.ndarray) -> np.ndarray:
    """1-based ranks of ``s`` with tied values sharing their mean rank (scipy's "average")."""
    order = np.argsort(s, kind="stable")
    _, first, counts = np.unique(s[order], return_index=True, return_counts=True)
    ranks = np.empty(s.size, dtype=np.float64)
    ranks[order] = np.repeat(first + (counts + 1) / 2.0, counts)  # group start + mean offset
    return ranks


def relative_log_loss(candidate: float, baseline: float) -> float:
    """``(candidate - baseline) / baseline`` as a fraction (multiply by 100 for percent).

    The field quotes it in percent: 0.0002 here is the "0.02% already counts" of LoKA. On the
    same evaluation data it equals the relative NE. Positive = the candidate is worse.
    """
    c, b = float(candidate), float(baseline)
    if not math.isfinite(b) or b <= 0.0:
        raise DataError(f"the baseline log loss must be finite and > 0, got {b!r}")
    return (c - b) / b
