"""The study's sampler: TPE whose random draws for a trial are seeded by the trial's position.

A plain ``TPESampler(seed=s)`` draws from one generator per process: a study resumed after an
interruption starts a new process whose generator repeats the first run's first draws, so the
resumed study proposes configurations it has already evaluated (cache copies) and explores,
and answers, differently than the same study run without a stop. Here every trial gets a fresh
TPE whose generator is seeded by the study's seed and the trial's *position*: its number less
the trials that an uninterrupted study would not have (failed by an interruption or a dead
worker and re-queued, :func:`~loka_tune.tuner._workers.trial_position`). TPE is otherwise a function
of the study's trials, so a resumed study draws what the uninterrupted one drew at each
position. (The queue's order is kept by :func:`~loka_tune.tuner._workers.keep_queue_order`:
TPE reads its history in trial order.)

Imported by :func:`~loka_tune.tuner.optuna_setup.make_sampler` only: it imports Optuna.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import optuna
from optuna.samplers import BaseSampler

from loka_tune.tuner._workers import trial_position

__all__ = ["TrialSeededSampler", "trial_seed"]


def trial_seed(seed: int, position: int) -> int:
    """The generator seed of the trial at ``position`` of a study seeded ``seed`` (a 32-bit int)."""
    return int(np.random.SeedSequence([seed, position]).generate_state(1)[0])


class TrialSeededSampler(BaseSampler):
    """Delegates to ``make(trial_seed(seed, position))``, a new sampler for every trial (see the module)."""

    def __init__(self, seed: int, make: Callable[[int], BaseSampler]) -> None:
        self.seed = seed
        self._make = make
        self._current = self._build(trial_seed(seed, 0))

    def _build(self, seed: int) -> BaseSampler:
        with warnings.catch_warnings():  # TPE's multivariate / constant_liar are experimental in some versions
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return self._make(seed)

    def before_trial(self, study: Any, trial: Any) -> None:
        trials = study.get_trials(deepcopy=False)
        self._current = self._build(trial_seed(self.seed, trial_position(trials, trial.number)))
        self._current.before_trial(study, trial)

    def infer_relative_search_space(self, study: Any, trial: Any) -> dict[str, Any]:
        return self._current.infer_relative_search_space(study, trial)

    def sample_relative(self, study: Any, trial: Any, search_space: dict[str, Any]) -> dict[str, Any]:
        return self._current.sample_relative(study, trial, search_space)

    def sample_independent(self, study: Any, trial: Any, param_name: str, param_distribution: Any) -> Any:
        return self._current.sample_independent(study, trial, param_name, param_distribution)

    def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
        self._current.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._current.reseed_rng()
