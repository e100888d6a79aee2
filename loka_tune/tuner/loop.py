"""The study loop: a probe-pruned Optuna search for the fastest precision config under a loss budget.

One study, end to end (see ``docs/design.md``)::

    StudyConfig ──> baseline: bf16 short runs on 2-3 seeds, each with its noise twins (the same
                    run from perturbed initial weights: the paired noise floor of relative log loss)
                    + the Probe's online statistics during the first one
                ──> space: sites x roles x candidates, pruned by the ProbeReport (unsafe / slow);
                    by default whole-site recipes on top of those, priced (seconds saved per step)
                ──> enqueued starts (unless ``[trials] enqueue_starts = false``): bf16 under each
                    Mods set, then, under the fastest feasible of those, the named recipes
                    (tensorwise / rowwise on torchao's size-filter sites, torchao's own, the
                    Dispatch plan): :mod:`loka_tune.tuner.starts`; then, in the recipe space, the
                    additive model's frontier under the budget, refitted after each trial
                    (:mod:`loka_tune.tuner.proposals`)
                ──> Optuna ask/tell (TPE with constraints, objective: step time)
                    trial -> PrecisionConfig -> fresh model (same init) -> apply -> paired short run
                          -> relative log loss vs the baseline, step time (measured or modeled)
                ──> answer: the fastest feasible trial (``best_trial`` / ``export_best``)

Scale-out: every worker runs :func:`run_study` on the same storage (``sqlite:///`` on one
machine, ``postgresql://`` across machines). The first one computes the baseline and the
space and stores them in the study's user attributes; the others (and every resume) reuse
them. Heartbeats mark a killed worker's trial failed and re-queue it; a configuration is
evaluated once (trials carry their config key, and the key of the configuration as it trains
where that differs: :func:`~loka_tune.tuner.runkey.run_key`; a trial that trains as an earlier one
copies its result).

Interruption: Ctrl-C (SIGINT) or SIGTERM during a trial fails that trial (reason "interrupted"),
re-queues its configuration (ahead of the trials that waited behind it), ends its MLflow run and
the study's as KILLED and re-raises ``KeyboardInterrupt`` (``loka-tune`` exits 130); the next run
resumes without waiting on it, and explores as the uninterrupted study would: the sampler's
draws for a trial are seeded by its position (:mod:`loka_tune.tuner._sampler`).

Budget: ``n_trials`` counts distinct configurations evaluated; a cache copy is told (the
sampler learns it) and recorded, but not counted, and a sampler that proposes only evaluated
configurations :data:`MAX_COPIES_IN_A_ROW` times in a row ends the study.

Trial numbers are Optuna's, from 0, everywhere (progress lines, leaderboard, MLflow, export).
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from loka_tune.config import PrecisionConfig
from loka_tune.errors import StudyError
from loka_tune.space.encode import config_from_params, distributions
from loka_tune.tuner._workers import (
    Heartbeat,
    copies_in_a_row,
    fail_stale,
    find_duplicate,
    keep_queue_order,
    n_counted,
    requeue_attrs,
    sigterm_as_interrupt,
    wait_for,
)
from loka_tune.tuner.build import resolve_device
from loka_tune.tuner.log import log
from loka_tune.tuner.optuna_setup import make_storage, open_study, set_constraint
from loka_tune.tuner.prepare import StudyContext, prepare_study
from loka_tune.tuner.proposals import enqueue_proposals
from loka_tune.tuner.results import STATES_DONE, TrialRecord, best_trial, noise_note
from loka_tune.tuner.runkey import run_key
from loka_tune.tuner.starts import enqueue_recipe_starts
from loka_tune.tuner.study import StudyConfig
from loka_tune.tuner.tracking import Tracker
from loka_tune.tuner.trial import BASELINE_RUN, evaluate_config

__all__ = ["run_study"]

# A sampler that proposes only configurations already evaluated, this many times in a row, has
# run out of new ones (a small space, or TPE sure of its answer): the study stops there, since
# cache copies do not count toward n_trials. Cheap (a copy is a lookup, no training), and rare
# in a space with room: 1 copy in 12 trials in issue 19's studies.
MAX_COPIES_IN_A_ROW = 20


def run_study(cfg: StudyConfig, *, device: str | None = None, storage_url: str | None = None,
              n_trials: int | None = None, timeout_s: float | None = None, force: bool = False,
              tracking: bool | None = None, worker_id: str | None = None, worker_index: int = 0,
              progress: bool = True, on_change: str = "stop", confirm: bool | None = None) -> Any:
    """Run (or join, or resume) the study: prepare it, then ask/evaluate/tell until the trial
    budget is spent, then (``confirm``; default: worker 0 when ``[confirm] enabled``) confirm
    the best configs (:mod:`loka_tune.tuner.confirm`). Returns the Optuna study. Safe to run in
    several processes at once. ``on_change``: what to do when the stored study has other
    settings (:func:`open_study`). Ctrl-C / SIGTERM fail the running trial (re-queued) and end
    its MLflow run and the study's as KILLED; an error ends the study's as FAILED."""
    if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
        raise StudyError(f"timeout_s must be a number of seconds > 0, got {timeout_s=}")
    if n_trials is not None and n_trials < 0:
        raise StudyError(f"n_trials must be >= 0 (0: prepare only), got {n_trials=}")
    dev = resolve_device(device or cfg.training.device)
    storage = make_storage(cfg, storage_url)
    study = open_study(cfg, storage, on_change=on_change)
    n_total = n_trials if n_trials is not None else cfg.trials.n_trials
    timeout = timeout_s if timeout_s is not None else cfg.trials.timeout_s
    tracker = None
    if tracking is not False and cfg.tracking.enabled is not False:
        tracker = Tracker.for_study(cfg, study, required=(cfg.tracking.enabled is True or tracking is True),
                                    attach=False)  # prepare_study attaches its run: none for a failed preparation
    if cfg.regime.compiled(dev, cfg.training.compile):
        # inductor's on-disk graph cache beside the study: every compiled run (and worker, and
        # resume) of this model reuses what an earlier one compiled (unless the user chose a dir)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cfg.output_dir / "inductor_cache"))
    with sigterm_as_interrupt():
        try:
            ctx = prepare_study(cfg, study, device=dev, force=force, tracker=tracker, on_change=on_change)
            _trials(ctx, study, storage, tracker, n_total=n_total, timeout=timeout, worker_id=worker_id,
                    progress=progress)
            if confirm if confirm is not None else (worker_index == 0 and cfg.confirm.enabled):
                from loka_tune.tuner.confirm import confirm_best

                confirm_best(ctx)
        except BaseException as e:
            if tracker is not None:
                tracker.interrupted("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
            raise
    if tracker is not None:
        tracker.finish(ctx)
    return study


def _trials(ctx: StudyContext, study: Any, storage: Any, tracker: Tracker | None, *, n_total: int | None,
            timeout: float | None, worker_id: str | None, progress: bool) -> None:
    """Ask, evaluate and tell trials until ``n_total`` count (or ``timeout`` seconds pass)."""
    import optuna

    cfg = ctx.cfg
    dists = distributions(ctx.space)
    budget = cfg.objective.budget_pct
    t_start = time.time()
    worker = worker_id or f"{platform.node()}:{os.getpid()}"
    n_configs = math.prod(len(d.choices) for d in dists.values())  # at most this many distinct ones
    if n_total is not None and n_total > n_configs:
        log(f"[loka-tune] the space has {n_configs} configuration(s): the study stops after evaluating them"
             f" (n_trials {n_total})")
        n_total = n_configs
    while True:
        if timeout is not None and time.time() - t_start > timeout:
            break
        fail_stale(study, grace_s=cfg.storage.grace_s)
        trials = study.get_trials(deepcopy=False)
        done, running = n_counted(trials)
        if copies_in_a_row(trials) >= MAX_COPIES_IN_A_ROW:
            log(f"[loka-tune] the sampler proposed only evaluated configurations in the last {MAX_COPIES_IN_A_ROW}"
                 f" trials: the space looks exhausted after {done} distinct ones; stopping")
            break
        if n_total is not None and done + running >= n_total:
            if done >= n_total:
                break
            # others are finishing the last trials; a dead one's trial will be re-queued
            time.sleep(min(cfg.storage.heartbeat_s, 2.0))
            continue
        if enqueue_recipe_starts(study):  # the bf16 + Mods starts run elsewhere: the recipes wait for them
            time.sleep(min(cfg.storage.heartbeat_s, 2.0))
            continue
        if enqueue_proposals(study, ctx.space, budget_pct=budget, base_s=ctx.baseline.step_time_s,
                             unmeasured_error=cfg.probe.max_error, noise_pct=ctx.baseline.noise_floor_pct):
            # the first proposals wait for the recipe starts (they calibrate the model)
            time.sleep(min(cfg.storage.heartbeat_s, 2.0))
            continue
        with warnings.catch_warnings():  # heartbeats are recorded by Heartbeat below, not by optimize()
            warnings.filterwarnings("ignore", message="Heartbeat of storage")
            trial = study.ask(fixed_distributions=dists)
        try:
            # the first beat is recorded on entering (see fail_stale for the gap before it)
            with Heartbeat(storage, trial._trial_id, cfg.storage.heartbeat_s):
                end = _one_trial(ctx, study, trial, worker, budget)
        except KeyboardInterrupt:
            _tell_interrupted(ctx, study, trial, tracker)
            raise
        except optuna.exceptions.UpdateFinishedTrialError:
            # another worker saw this trial's heartbeat go stale (this process was stalled for
            # longer than [storage] grace_s), failed it and re-queued its configuration: drop
            # our copy and go on with the next trial.
            log(f"trial {trial.number}: taken over by another worker after a stale heartbeat"
                 f" (raise [storage] grace_s above {cfg.storage.grace_s}s if this machine stalls); skipped")
            continue
        if tracker is not None:
            seeded = trial.user_attrs.get("seeded")  # an enqueued start's label: the run's tag 'seeded'
            tracker.log_trial(trial.number, end.params, end.config, {**end.attrs, "seeded": seeded} if seeded
                              else end.attrs, end.state, ctx, step_losses=end.step_losses)
        if progress:
            log(_progress_line(ctx, trial.number, n_total, end.attrs, end.state))


@dataclass(frozen=True)
class _TrialEnd:
    """What one trial came to: its state as told, the attributes its end wrote, its parameters and config."""

    state: str  # "COMPLETE", "PRUNED" or "FAIL"
    attrs: Mapping[str, Any]
    params: Mapping[str, Any]
    config: PrecisionConfig
    step_losses: tuple[float, ...] = ()  # the evaluated run's training loss per step (none for a cache copy)


def _one_trial(ctx: StudyContext, study: Any, trial: Any, worker: str, budget: float) -> _TrialEnd:
    """Evaluate (or copy from an earlier trial of the same config) one asked trial and tell the study."""
    from optuna.trial import TrialState

    grace = ctx.cfg.storage.grace_s
    t0 = time.perf_counter()
    params = dict(trial.params)
    config = config_from_params(ctx.space, params)
    written, key = config.key(), run_key(ctx, config)  # key: as it trains (fp8_chain's chained tensorwise variants: one)
    start = TrialRecord(config_key=written, run_key=None if key == written else key, config=json.loads(config.to_json()),
                        budget_pct=budget, worker=worker, speed_source=ctx.speed)
    for k, v in start.start_attrs().items():
        trial.set_user_attr(k, v)
    dup = find_duplicate(study, key, trial.number)
    if dup is not None and dup.state == TrialState.RUNNING:
        dup = wait_for(study, dup.number, poll_s=1.0, limit_s=max(60.0, 4 * grace + 600), grace_s=grace)
    if dup is not None:
        state, attrs = _tell_copy(study, trial, dup, budget, wall_s=time.perf_counter() - t0)
        return _TrialEnd(state, attrs, params, config)
    state, attrs, losses = _tell_evaluated(ctx, study, trial, config, budget)
    return _TrialEnd(state, attrs, params, config, losses)


def _tell_interrupted(ctx: StudyContext, study: Any, trial: Any, tracker: Tracker | None) -> None:
    """A trial stopped by Ctrl-C / SIGTERM: FAIL it (not counted: no ``fail_reason``), queue its
    configuration again for the next run, ahead of the trials that were waiting behind it, and
    end its MLflow run as KILLED. Best effort: nothing here may hide the interrupt."""
    from optuna.trial import TrialState

    params = dict(trial.params)
    attrs = {"status": "failed", "reason": "interrupted (Ctrl-C or SIGTERM); re-queued"}
    done: dict[str, Any] = {}  # the steps already recorded: a retry does not repeat them
    error: Exception | None = None
    for attempt in range(INTERRUPT_ATTEMPTS):
        try:
            if "again" not in done:
                frozen = study._storage.get_trial(trial._trial_id)
                if frozen.state.is_finished():  # the interrupt came after the trial was told
                    log(f"[loka-tune] trial {trial.number}: interrupted after it was recorded ({frozen.state.name})")
                    return
                done["again"] = requeue_attrs(frozen)  # the frozen trial: its system attrs
            if "attrs" not in done:
                for k, v in attrs.items():
                    trial.set_user_attr(k, v)
                done["attrs"] = True
            if "tell" not in done:
                study.tell(trial, state=TrialState.FAIL)
                done["tell"] = True
            if "enqueue" not in done:
                study.enqueue_trial(params, user_attrs=done["again"])
                done["enqueue"] = True
            keep_queue_order(study)  # it runs first on resuming, as it would have without the stop
            break
        except Exception as e:  # noqa: BLE001 - the interrupt may have broken the storage's session mid-write
            error = e
            reset_storage_sessions(study._storage)
            time.sleep(0.2 * (attempt + 1))
    else:
        log(f"[loka-tune] trial {trial.number}: interrupted; could not record it after {INTERRUPT_ATTEMPTS}"
            f" attempts ({error})")
        return
    log(f"[loka-tune] trial {trial.number}: interrupted; marked failed, its configuration re-queued")
    if tracker is not None:
        try:
            tracker.log_trial(trial.number, params, config_from_params(ctx.space, params), attrs, "FAIL", ctx,
                              run_status="KILLED")
        except Exception as e:  # noqa: BLE001 - report and let the interrupt through
            log(f"[loka-tune] trial {trial.number}: interrupted; its MLflow run could not be ended ({e})")


INTERRUPT_ATTEMPTS = 3  # tries to record an interrupted trial (a fresh storage session each)


def reset_storage_sessions(storage: Any) -> None:
    """Drop the database sessions and pooled connections of ``storage`` (and of the storages it
    wraps): a Ctrl-C that lands inside a commit can leave them mid-transaction, and every later
    write on them then fails. The next call opens fresh ones. Best effort."""
    for _ in range(4):
        if storage is None:
            return
        try:
            sess = getattr(storage, "scoped_session", None)
            if sess is not None:
                sess.remove()
            engine = getattr(storage, "engine", None)
            if engine is not None:
                engine.dispose()
        except Exception:  # noqa: BLE001, S110 - nothing to reset, or nothing left to save
            pass
        storage = getattr(storage, "_backend", None)


def _tell_copy(study: Any, trial: Any, dup: Any, budget: float, *, wall_s: float) -> tuple[str, dict[str, Any]]:
    """The earlier trial ``dup``'s result (and its budget and speed source) as this trial's: a cache
    hit, whose ``wall_s`` is its own (the lookup's), not the earlier run's."""
    from optuna.trial import TrialState

    earlier = TrialRecord.of(dup)
    attrs = {"budget_pct": earlier.budget_pct, "speed_source": earlier.speed_source,
             **replace(earlier, cache_hit=True, cached_from=dup.number, wall_s=wall_s).result_attrs()}
    for k, v in attrs.items():
        trial.set_user_attr(k, v)
    set_constraint(trial, attrs["rel_logloss_pct"], budget)
    if dup.state == TrialState.COMPLETE:
        study.tell(trial, dup.value)
    else:
        study.tell(trial, state=dup.state)
    return dup.state.name, attrs


def _tell_evaluated(ctx: StudyContext, study: Any, trial: Any, config: PrecisionConfig,
                    budget: float) -> tuple[str, dict[str, Any], tuple[float, ...]]:
    """Evaluate ``config`` (the pruner watching its loss windows) and tell the study."""
    from optuna.trial import TrialState

    def report(step: int, rel: float) -> bool:
        trial.report(rel if math.isfinite(rel) else 1e9, step)  # a non-finite gap: hopeless
        prune: bool = trial.should_prune()
        return prune

    outcome = evaluate_config(ctx, config, report=report)
    record = TrialRecord(**outcome.attrs(), feasible=outcome.feasible(budget), cache_hit=False,
                         fail_reason=outcome.reason if outcome.status == "failed" else None)
    attrs = record.result_attrs()
    for k, v in attrs.items():
        trial.set_user_attr(k, v)
    set_constraint(trial, record.rel_logloss_pct, budget)
    if outcome.status == "ok":
        study.tell(trial, outcome.step_time_s)
        return "COMPLETE", attrs, outcome.step_losses
    state = TrialState.PRUNED if outcome.status == "pruned" else TrialState.FAIL
    study.tell(trial, state=state)
    return state.name, attrs, outcome.step_losses


def _progress_line(ctx: StudyContext, number: int, n_total: int | None, attrs: Mapping[str, Any],
                   state: str) -> str:
    """``trial <Optuna number, from 0> (<counted>/<n_trials> done)``: the trial number is the one the
    leaderboard, MLflow and the export show; the count is of the trials that count toward
    ``n_trials`` (a re-queued trial of a dead or interrupted run takes a new number)."""
    trials = ctx.study.get_trials(deepcopy=False)
    done = [t for t in trials if t.state.name in STATES_DONE]
    feasible = sum(1 for t in done if TrialRecord.of(t).feasible)
    b = best_trial(ctx.study, raise_if_none=False)
    best_s = f"{TrialRecord.of(b).speedup:.3f}x" if b is not None else "-"
    r = TrialRecord.from_attrs(attrs)
    rel, sp = r.rel_logloss_pct, r.speedup
    tag = " (cache)" if r.cache_hit else " (the baseline's run)" if (r.reason or "").startswith(BASELINE_RUN) else ""
    vs_mods = f" ({r.speedup_vs_mods:.3f}x vs bf16+Mods)" if r.speedup_vs_mods is not None else ""
    noise = noise_note(rel, ctx.baseline.noise_floor_pct)
    what = (f"rel.LL {rel:+.4f}%{noise}  speed-up {sp:.3f}x{vs_mods}"
            if state == "COMPLETE" and rel is not None and sp is not None
            else f"{state.lower()}: {r.fail_reason or r.reason or ''}")
    counted = n_counted(trials)[0]
    of_total = f" ({counted}/{n_total} done)" if n_total else f" ({counted} done)"
    return (f"[loka-tune] trial {number}{of_total}  {what}{tag}  | best {best_s} ({ctx.speed})"
            f"  feasible {feasible}/{len(done)}")
