"""The tuner: a study file in, the fastest feasible precision config out.

    load_study("study.toml") -> StudyConfig -> run_study(cfg) -> Optuna study -> export_best(study, "best.json")

One module per job: ``study`` (the study file's schema; ``sections`` holds its tables),
``build`` (data source, model, trainer config, the study's training run), ``log`` (progress
lines), ``baseline`` (bf16 reference runs, their noise twins, the paired noise floor),
``optuna_setup`` (storage, sampler, pruner; ``_sampler``: TPE seeded per trial position),
``prepare`` (baseline + probe + pruned space), ``starts`` (the enqueued first trials: bf16
under each Mods set, then the named recipes under the best), ``trial`` (one configuration's evaluation), ``loop`` (ask/evaluate/tell,
several workers; ``_workers`` holds heartbeats and duplicates), ``results`` (trial records,
feasibility, "within noise", best trial, leaderboard, export), ``plots`` (speed vs loss, the
choice map) and ``tracking`` (MLflow; both read results).

The names below are imported lazily, so ``import loka_tune.tuner`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loka_tune._lazy import lazy_module

if TYPE_CHECKING:  # the real objects behind the lazy names, for type checkers; never run
    from loka_tune.tuner.baseline import Baseline as Baseline
    from loka_tune.tuner.loop import run_study as run_study
    from loka_tune.tuner.optuna_setup import open_study as open_study
    from loka_tune.tuner.prepare import StudyContext as StudyContext
    from loka_tune.tuner.prepare import prepare_study as prepare_study
    from loka_tune.tuner.results import TrialRecord as TrialRecord
    from loka_tune.tuner.results import best_trial as best_trial
    from loka_tune.tuner.results import export_best as export_best
    from loka_tune.tuner.results import leaderboard as leaderboard
    from loka_tune.tuner.study import StudyConfig as StudyConfig
    from loka_tune.tuner.study import load_study as load_study
    from loka_tune.tuner.study import parse_study as parse_study
    from loka_tune.tuner.trial import TrialOutcome as TrialOutcome
    from loka_tune.tuner.trial import evaluate_config as evaluate_config

# public name -> module that defines it
_LAZY = {
    # the study file
    "StudyConfig": "loka_tune.tuner.study",
    "load_study": "loka_tune.tuner.study",
    "parse_study": "loka_tune.tuner.study",
    # the verbs
    "run_study": "loka_tune.tuner.loop",
    "best_trial": "loka_tune.tuner.results",
    "leaderboard": "loka_tune.tuner.results",
    "export_best": "loka_tune.tuner.results",
    # the pieces a custom loop or benchmark reuses
    "open_study": "loka_tune.tuner.optuna_setup",
    "prepare_study": "loka_tune.tuner.prepare",
    "evaluate_config": "loka_tune.tuner.trial",
    "TrialRecord": "loka_tune.tuner.results",
    "TrialOutcome": "loka_tune.tuner.trial",
    "Baseline": "loka_tune.tuner.baseline",
    "StudyContext": "loka_tune.tuner.prepare",
}

__all__ = list(_LAZY)


__getattr__, __dir__ = lazy_module(__name__, _LAZY)
