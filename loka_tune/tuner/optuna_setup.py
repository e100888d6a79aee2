"""The study's Optuna objects: the RDB storage with heartbeats, the constrained TPE sampler, the
pruner, and the study itself (created by the first worker, loaded by the others).

The loss constraint reaches the sampler through ``Trial.set_constraint`` (Optuna >= 5) or,
before that, a ``constraints_func`` reading the trial's record; both use
:func:`loka_tune.tuner.results.constraint`. Optuna is imported inside the functions.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from loka_tune.errors import StudyError
from loka_tune.tuner.log import log
from loka_tune.tuner.results import ATTR_BASELINE, ATTR_SPACE, ATTR_STUDY, TrialRecord, constraint
from loka_tune.tuner.storage import check_storage_url, open_rdb
from loka_tune.tuner.study import StudyConfig, settings_changes, settings_of

__all__ = ["make_storage", "load_storage", "make_sampler", "make_pruner", "open_study", "set_constraint",
           "check_settings"]

CONSTRAINT_NAME = "rel_logloss_minus_budget_pct"
ATTR_SETTINGS = "loka.settings"  # study user attr: the settings its baseline and space were made with


def _retry_db(fn: Callable[[], Any], tries: int = 8) -> Any:
    """Retry ``fn`` while workers race to create the same tables / study ("already exists", locks)."""
    for i in range(tries):
        try:
            return fn()
        except Exception as e:  # sqlalchemy IntegrityError / OperationalError / optuna DuplicatedStudyError
            msg = str(e).lower()
            if i == tries - 1 or not any(w in msg for w in ("already exists", "duplicate", "locked", "unique")):
                raise
            time.sleep(0.2 * (i + 1))
    raise AssertionError("unreachable")


def make_storage(cfg: StudyConfig, url: str | None = None) -> Any:
    """The Optuna RDB storage with heartbeats; a dead worker's trial is failed and re-queued.
    ``url`` (``--storage``) overrides the study's ``[storage] url``. A bad or unreachable
    storage is a one-line :class:`StudyError` / :class:`ConfigError` (:mod:`loka_tune.tuner.storage`)."""
    url = url or cfg.storage.url
    check_storage_url(url, option="storage.url" if url == cfg.storage.url else "--storage", own_dir=cfg.output_dir)
    return open_rdb(url, lambda real, kw: _retry_db(lambda: _make_storage(cfg, real, kw)))


def _make_storage(cfg: StudyConfig, url: str, engine_kwargs: dict[str, Any]) -> Any:
    import optuna

    retry_cb = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.simplefilter("ignore", FutureWarning)
        if retry_cb is not None:  # optuna >= 4.9
            return optuna.storages.RDBStorage(
                url, engine_kwargs=engine_kwargs, heartbeat_interval=cfg.storage.heartbeat_s,
                grace_period=cfg.storage.grace_s,
                heartbeat_stale_trial_callback=retry_cb(max_retry=cfg.storage.max_retry))
        return optuna.storages.RDBStorage(
            url, engine_kwargs=engine_kwargs, heartbeat_interval=cfg.storage.heartbeat_s,
            grace_period=cfg.storage.grace_s,
            failed_trial_callback=optuna.storages.RetryFailedTrialCallback(max_retry=cfg.storage.max_retry))


def load_storage(url: str) -> Any:
    """The Optuna RDB storage at ``url`` for reading a stored study (export, report; no
    heartbeats), its failures to open as one line."""
    import optuna

    def make(real: str, kw: dict[str, Any]) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return optuna.storages.RDBStorage(real, engine_kwargs=kw)

    check_storage_url(url, option="--storage")
    return open_rdb(url, make)


@functools.cache
def _has_set_constraint() -> bool:
    import optuna

    return hasattr(optuna.trial.Trial, "set_constraint")


def set_constraint(trial: Any, rel_pct: float | None, budget: float) -> None:
    """Record the trial's loss constraint for the sampler (Optuna >= 5; older ones read
    :func:`_constraints` instead)."""
    if _has_set_constraint():
        trial.set_constraint(CONSTRAINT_NAME, constraint(rel_pct, budget))


def _constraints(frozen: Any) -> Sequence[float]:
    """The sampler's ``constraints_func`` before Optuna 5: the constraint from the trial's record."""
    return (TrialRecord.of(frozen).constraint,)


def make_pruner(cfg: StudyConfig) -> Any:
    """The Optuna pruner of ``trials.pruner``.

    "hopeless": prune a trial whose latest windowed training loss is ``hopeless_factor`` x the
    budget above the baseline's at the same step (the intermediate values are that relative gap,
    in percent; the loop reports a non-finite one as 1e9): Optuna's ThresholdPruner.
    """
    import optuna

    if cfg.trials.pruner == "none":
        return optuna.pruners.NopPruner()
    if cfg.trials.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=cfg.trials.prune_warmup_steps)
    return optuna.pruners.ThresholdPruner(upper=cfg.trials.hopeless_factor * cfg.objective.budget_pct,
                                          n_warmup_steps=cfg.trials.prune_warmup_steps)


def make_sampler(cfg: StudyConfig) -> Any:
    """TPE with the loss constraint, its draws for each trial seeded by ``study.seed`` and the
    trial's position (:mod:`loka_tune.tuner._sampler`): a resumed study, and every worker of a
    shared one, draws at each position what one uninterrupted process would."""
    import optuna

    from loka_tune.tuner._sampler import TrialSeededSampler

    kw: dict[str, Any] = {}
    if not _has_set_constraint():  # optuna < 5: the sampler reads the constraint through constraints_func
        kw["constraints_func"] = _constraints

    def tpe(seed: int) -> Any:
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=cfg.trials.n_startup_trials,
                                          multivariate=True, constant_liar=True, **kw)

    return TrialSeededSampler(cfg.study.seed, tpe)


ON_CHANGE = ("stop", "fresh", "resume")


def open_study(cfg: StudyConfig, storage: Any | None = None, *, study_name: str | None = None,
               on_change: str = "stop") -> Any:
    """Create or load the study (TPE with the loss constraint, the study's pruner).

    A prepared study remembers the settings its baseline and space were made with
    (:meth:`StudyConfig.settings`, stored by :func:`~loka_tune.tuner.prepare.prepare_study`); when
    the study file's differ, ``on_change`` decides: "stop" raises :class:`StudyError` listing the
    changes, "resume" goes on with the stored baseline, space and trials (and says so), "fresh"
    deletes the stored study (trials, baseline, space) and starts over, changed or not, and the
    baseline runs kept from a preparation that did not finish (:mod:`~loka_tune.tuner.baseline_runs`).
    A study whose preparation never finished (it failed, or was interrupted) holds nothing made
    from its settings, so they bind nothing: the next run prepares it with the study file's (and
    reuses those kept runs where their settings are its own, but for its budget).
    """
    import optuna

    if on_change not in ON_CHANGE:
        raise ValueError(f"on_change must be one of {ON_CHANGE}, got {on_change=}")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = storage or make_storage(cfg)
    name = study_name or cfg.name
    if on_change == "fresh" and name in {s.study_name for s in optuna.get_all_study_summaries(storage)}:
        optuna.delete_study(study_name=name, storage=storage)
        log(f"[loka-tune] study {name!r}: deleted its stored trials, baseline and space (--fresh)")
    if on_change == "fresh":
        from loka_tune.tuner.baseline_runs import drop_runs, runs_file

        if drop_runs(cfg):
            log(f"[loka-tune] study {name!r}: deleted the baseline runs kept from an unfinished preparation,"
                f" {runs_file(cfg)} (--fresh)")
    sampler = make_sampler(cfg)
    study = _retry_db(lambda: optuna.create_study(storage=storage, study_name=name, direction="minimize",
                                                  sampler=sampler, pruner=make_pruner(cfg), load_if_exists=True))
    check_settings(study, cfg, on_change)
    return study


def check_settings(study: Any, cfg: StudyConfig, on_change: str = "stop") -> None:
    """Compare the settings a prepared study was made with with ``cfg``'s (see :func:`open_study`);
    a study with no baseline, space or trial yet has nothing to compare."""
    attrs = study.user_attrs
    if ATTR_BASELINE not in attrs and ATTR_SPACE not in attrs and not study.get_trials(deepcopy=False):
        return  # new, or its preparation failed: nothing stored was made from any settings
    stored = attrs.get(ATTR_SETTINGS)
    if stored is None and ATTR_STUDY in attrs:  # a study stored before settings were: its summary has them
        stored = settings_of(attrs[ATTR_STUDY])
    new = cfg.settings()
    changes = [] if stored is None else settings_changes(stored, new)
    if not changes:
        if attrs.get(ATTR_SETTINGS) is None:  # an older study's: stored from now on
            study.set_user_attr(ATTR_SETTINGS, new)
        return
    shown = "; ".join(changes[:6]) + (f"; and {len(changes) - 6} more" if len(changes) > 6 else "")
    if on_change == "resume":
        log(f"[loka-tune] study {study.study_name!r}: resuming despite changed settings ({shown}): its stored"
             " baseline, space and trials are from the old ones")
        return
    raise StudyError(
        f"study {study.study_name!r} is stored with other settings than the study file's ({shown}); its baseline,"
        f" space and {len(study.trials)} trial(s) belong to the old ones. Run again with --fresh to start over"
        " (deletes the stored study), with --resume-anyway to go on with the stored one, or give the edited"
        " study another [study] name")
