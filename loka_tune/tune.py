"""Compatibility: the study loop now lives in the :mod:`loka_tune.tuner` package, one module per
job (kept for a release; new code imports from there). ``HopelessPruner`` is gone: the
"hopeless" pruner is Optuna's ``ThresholdPruner`` (:func:`loka_tune.tuner.optuna_setup.make_pruner`).
"""

from __future__ import annotations

from loka_tune.objectives.speed import measure_forward_seconds, modeled_gemm_seconds
from loka_tune.space.candidates import SearchSpace
from loka_tune.tuner.baseline import Baseline, check_budget, modeled_seconds, run_baseline
from loka_tune.tuner.build import (
    import_function,
    make_model,
    make_source,
    resolve_device,
    speed_source,
    train_config,
    trial_model,
)
from loka_tune.tuner.loop import run_study
from loka_tune.tuner.optuna_setup import make_pruner, make_storage, open_study
from loka_tune.tuner.prepare import StudyContext, no_fp8_reason, prepare_study
from loka_tune.tuner.results import (
    ATTR_BASELINE,
    ATTR_SPACE,
    ATTR_STUDY,
    STATES_DONE,
    best_trial,
    export_best,
    leaderboard,
    study_summary,
)
from loka_tune.tuner.study import StudyConfig
from loka_tune.tuner.trial import TrialOutcome, evaluate_config

__all__ = [
    "Baseline",
    "TrialOutcome",
    "StudyContext",
    "run_study",
    "prepare_study",
    "open_study",
    "make_storage",
    "make_source",
    "make_model",
    "trial_model",
    "modeled_seconds",
    "evaluate_config",
    "best_trial",
    "leaderboard",
    "export_best",
    "import_function",
    # also importable from here, as before the split
    "ATTR_BASELINE",
    "ATTR_SPACE",
    "ATTR_STUDY",
    "STATES_DONE",
    "SearchSpace",
    "StudyConfig",
    "check_budget",
    "make_pruner",
    "measure_forward_seconds",
    "modeled_gemm_seconds",
    "no_fp8_reason",
    "resolve_device",
    "run_baseline",
    "speed_source",
    "study_summary",
    "train_config",
]
