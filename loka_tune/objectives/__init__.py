"""Objectives of a tuning trial: the deterministic short-run trainer and quality metrics.

- :func:`train` / :class:`TrainConfig` / :class:`TrainResult`: a paired, seeded short run
  (loss curve, held-out log loss / NE / AUC, step time, examples/s);
- :func:`evaluate`: held-out metrics of a model on a data source's eval split;
- metrics: :func:`log_loss`, :func:`normalized_entropy`, :func:`auc`,
  :func:`relative_log_loss` (a fraction; x100 for percent).
"""

from __future__ import annotations

from loka_tune.objectives.metrics import auc, log_loss, normalized_entropy, relative_log_loss
from loka_tune.objectives.trainer import TrainConfig, TrainResult, evaluate, train

# what a user calls; the other names imported above are importable but internal (they may change)
__all__ = [
    "TrainConfig",
    "TrainResult",
    "train",
    "evaluate",
    "log_loss",
    "normalized_entropy",
    "auc",
    "relative_log_loss",
]
