"""Objectives of a tuning trial: the deterministic short-run trainer and quality metrics.

- :func:`train` / :class:`TrainConfig` / :class:`TrainResult`: a paired, seeded short run
  (loss curve, held-out log loss / NE / AUC, step time, examples/s);
- :func:`evaluate`: held-out metrics of a model on a data source's eval split;
- metrics: :func:`log_loss`, :func:`normalized_entropy`, :func:`auc`,
  :func:`relative_log_loss` (a fraction; x100 for percent).
"""

from __future__ import annotations

from loka_tune.objectives.metrics import (
    auc,
    binary_entropy,
    log_loss,
    normalized_entropy,
    relative_log_loss,
)
from loka_tune.objectives.trainer import (
    SPARSE_OPTIMIZERS,
    RowwiseAdagrad,
    TrainConfig,
    TrainResult,
    build_optimizers,
    evaluate,
    split_parameters,
    train,
)

__all__ = [
    "TrainConfig",
    "TrainResult",
    "train",
    "evaluate",
    "RowwiseAdagrad",
    "SPARSE_OPTIMIZERS",
    "build_optimizers",
    "split_parameters",
    "log_loss",
    "binary_entropy",
    "normalized_entropy",
    "auc",
    "relative_log_loss",
]
