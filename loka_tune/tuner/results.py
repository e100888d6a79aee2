"""What a study leaves behind and the answers read from it: the trial records, feasibility,
the best trial, the leaderboard and the exported config.

A trial's record lives in its Optuna user attributes (a flat JSON dict); :class:`TrialRecord`
is its typed form. The loop writes it; this module, ``loka-tune report``/``export`` and MLflow
tracking read it. Feasibility is one rule, :func:`within_budget`: a known, finite relative log
loss <= the budget (:func:`constraint` is the same rule as the number Optuna's sampler reads,
feasible when <= 0); every module that decides feasibility calls one of them.
"Within noise" is another, :func:`within_noise`: |relative log loss| <= the baseline's noise
floor, a result neither better nor worse than bf16 (read from the stored baseline, never stored
per trial).
"""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from loka_tune.config import ModsConfig, PrecisionConfig
from loka_tune.errors import LokaError, StudyError

__all__ = ["ATTR_BASELINE", "ATTR_SPACE", "ATTR_STUDY", "ATTR_REFERENCE", "ATTR_CONFIRM", "ATTR_CONFIRM_RUNS", "ATTR_PREPARE_S",
           "ATTR_PREPARE_PHASES", "ATTR_PREPARE_REUSED", "ATTR_COMPILE_CACHE", "STATES_DONE",
           "TrialRecord", "constraint", "within_budget", "within_noise", "noise_floor", "noise_note", "best_trial", "confirmation",
           "exported_trial", "leaderboard", "export_best", "compile_cache_totals", "compile_cache_summary",
           "study_summary"]

ATTR_BASELINE = "loka.baseline"  # study user attr: the Baseline JSON
ATTR_SPACE = "loka.space"  # study user attr: the SearchSpace JSON
ATTR_STUDY = "loka.study"  # study user attr: the StudyConfig summary
ATTR_REFERENCE = "loka.reference."  # study user attrs: + Mods short_str -> measured bf16 + Mods step seconds
ATTR_PREPARE_S = "loka.prepare_s"  # study user attr: seconds the preparation took (baselines, probe, space)
ATTR_PREPARE_PHASES = "loka.prepare_phases"  # study user attr: {part: seconds} of that preparation
#: study user attr: {"seconds", "saved"} of the baseline runs that preparation reused from one that did not finish
ATTR_PREPARE_REUSED = "loka.prepare_reused"
ATTR_CONFIRM = "loka.confirmation"  # study user attr: the confirmation stage's result (tuner.confirm)
#: study user attr: each confirmation run (and bf16 run on a seed the baseline has not) as it finishes,
#: by what ran, on which seed, how (tuner.confirm): a confirmation cut short goes on from there
ATTR_CONFIRM_RUNS = "loka.confirmation_runs"
ATTR_COMPILE_CACHE = "loka.compile_cache"  # study user attr: inductor's cache over the compiled runs (compile_cache_summary)
STATES_DONE = ("COMPLETE", "PRUNED", "FAIL")
INFEASIBLE = 1e9  # the constraint of an unknown (or non-finite) loss: Optuna wants a finite number


def constraint(rel_logloss_pct: float | None, budget_pct: float | None) -> float:
    """The loss constraint of a trial, as Optuna's sampler reads it: relative log loss - budget
    (feasible when <= 0, :func:`within_budget`); an unknown (None) or non-finite loss, or an
    unknown budget, is infeasible (:data:`INFEASIBLE`)."""
    if budget_pct is None or rel_logloss_pct is None or not math.isfinite(rel_logloss_pct):
        return INFEASIBLE
    return float(rel_logloss_pct) - float(budget_pct)


def within_budget(rel_logloss_pct: float | None, budget_pct: float | None) -> bool:
    """The feasibility rule: whether a relative log loss (percent, vs bf16) is within the loss
    budget (percent), ``rel <= budget`` (exactly at the budget is feasible). An unknown (None) or
    non-finite loss (NaN, +-inf: a diverged or unmeasured run) and an unknown budget are not.

    The same rule as ``constraint(rel, budget) <= 0`` (:func:`constraint`), and used wherever
    feasibility is decided: a trial's outcome (:meth:`~loka_tune.tuner.trial.TrialOutcome.feasible`,
    stored as its record's ``feasible``), a confirmation row (applied to the mean relative log loss
    over its seeds, once every seed has run; :mod:`loka_tune.tuner.confirm`) and ``loka-tune
    export``'s "NOT feasible" note. No noise margin: the budget itself must sit above the noise
    floor (:func:`~loka_tune.tuner.baseline.check_budget`).

    >>> within_budget(0.5, 0.5), within_budget(0.51, 0.5), within_budget(-0.2, 0.5)
    (True, False, True)
    >>> within_budget(None, 0.5), within_budget(float("nan"), 0.5), within_budget(0.1, None)
    (False, False, False)
    """
    return constraint(rel_logloss_pct, budget_pct) <= 0.0


def within_noise(rel_logloss_pct: float | None, noise_floor_pct: float | None) -> bool | None:
    """Whether a relative log loss (percent) lies within the noise floor, ``|rel| <= floor``: such a
    result cannot be told from bf16's own (neither better nor worse). None when either is unknown."""
    if rel_logloss_pct is None or noise_floor_pct is None:
        return None
    rel, floor = float(rel_logloss_pct), float(noise_floor_pct)
    if not (math.isfinite(rel) and math.isfinite(floor)):
        return None
    return abs(rel) <= floor


def noise_note(rel_logloss_pct: float | None, noise_floor_pct: float | None) -> str:
    """``" (within noise +-F%)"`` for a result within the noise floor, else ``""``: the label
    the trial lines, ``tune``'s summary and ``report`` put beside a relative log loss."""
    if within_noise(rel_logloss_pct, noise_floor_pct):
        return f" (within noise +-{float(noise_floor_pct or 0):.3g}%)"
    return ""


def noise_floor(study: Any) -> float | None:
    """The stored baseline's noise floor (percent), or None before the study is prepared."""
    v = (study.user_attrs.get(ATTR_BASELINE) or {}).get("noise_floor_pct")
    return None if v is None else float(v)


# the record's keys written when a trial starts; other workers find a running duplicate by its trains_as
_START_KEYS = ("config_key", "config", "budget_pct", "worker", "speed_source")
_START_OPTIONAL = ("run_key",)  # written at the start where set
# keys present only when set (their presence means something: failed by the config, a cache copy, enqueued)
_OPTIONAL_KEYS = ("fail_reason", "cached_from", "seeded", "run", "compile_cache")


@dataclass(frozen=True)
class TrialRecord:
    """One trial's user attributes, typed; None where an attribute is absent, or a float was not
    measured (or not finite).

    Written when the trial starts: ``config_key``, ``config`` (the PrecisionConfig's dict),
    ``budget_pct``, ``worker``, ``speed_source``, and ``run_key`` where the configuration trains
    as another written one would (:func:`~loka_tune.tuner.runkey.run_key`: under the ``fp8_chain``
    Mod a chained site's tensorwise variants; :attr:`trains_as` is the key trials are told apart
    by); ``seeded`` by the enqueued starts (their labels:
    "all-bf16", "bf16+mods:nobias", "tensorwise@filter", "dispatch", ...; see
    :mod:`loka_tune.tuner.starts`). Written when it ends: what evaluating it gave
    (``status`` "ok" / "pruned" / "failed", the metrics, ``reason``, ``steps_run``, ``wall_s``),
    ``feasible``, ``cache_hit`` (copied from ``cached_from``, an earlier trial of the same
    config) and, for a trial its config failed, ``fail_reason``. A completed run also records
    ``run``, how it trained (its seed, steps and regime: :func:`~loka_tune.tuner.trial.run_description`;
    the confirmation takes it for that seed's run), and a compiled one ``compile_cache``,
    inductor's cache counts of its compile (:func:`~loka_tune.objectives.compiled.compile_cache_counts`);
    a cache copy carries its source's.
    """

    config_key: str | None = None
    run_key: str | None = None
    config: Mapping[str, Any] = field(default_factory=dict)
    budget_pct: float | None = None
    worker: str | None = None
    speed_source: str | None = None
    seeded: str | None = None
    status: str | None = None
    rel_logloss_pct: float | None = None
    step_time_s: float | None = None
    speedup: float | None = None
    eval_logloss: float | None = None
    eval_ne: float | None = None
    eval_auc: float | None = None
    measured_step_time_s: float | None = None
    mods_step_time_s: float | None = None
    speedup_vs_mods: float | None = None
    reason: str | None = None
    steps_run: int | None = None
    wall_s: float | None = None
    feasible: bool = False
    cache_hit: bool = False
    fail_reason: str | None = None
    cached_from: int | None = None
    run: Mapping[str, Any] | None = None
    compile_cache: Mapping[str, int] | None = None

    @classmethod
    def of(cls, trial: Any) -> TrialRecord:
        """The record of an Optuna (frozen) trial."""
        return cls.from_attrs(trial.user_attrs)

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, Any]) -> TrialRecord:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in attrs.items() if k in known})

    def start_attrs(self) -> dict[str, Any]:
        """The attributes written when the trial starts."""
        return {k: getattr(self, k) for k in _START_KEYS + _START_OPTIONAL
                if k in _START_KEYS or getattr(self, k) is not None}

    @property
    def trains_as(self) -> str | None:
        """The key of the configuration as it trains: ``run_key`` where set, else ``config_key``
        (two trials of one ``trains_as`` train the same model: the later copies the earlier)."""
        return self.run_key or self.config_key

    def result_attrs(self) -> dict[str, Any]:
        """The attributes written when it ends (what its evaluation, or the copied one, gave)."""
        skip = set(_START_KEYS) | set(_START_OPTIONAL) | {"seeded"}
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in skip and not (f.name in _OPTIONAL_KEYS and getattr(self, f.name) is None)}

    @property
    def counts(self) -> bool:
        """A FAIL that counts as a finished trial: its config failed (the trial of a dead worker
        is failed without a reason, re-queued and not counted)."""
        return self.fail_reason is not None

    @property
    def constraint(self) -> float:
        return constraint(self.rel_logloss_pct, self.budget_pct)


def best_trial(study: Any, *, raise_if_none: bool = True) -> Any:
    """The fastest feasible completed trial (the study's answer)."""
    from optuna.trial import TrialState

    ok = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
          if TrialRecord.of(t).feasible and t.value is not None]
    if not ok:
        if raise_if_none:
            raise StudyError(f"study {study.study_name!r} has no feasible trial yet: run more trials, raise"
                             " objective.budget_pct, or look at `loka-tune report` for the closest ones")
        return None
    # ties (same modeled time) go to the lower relative log loss, then the earlier trial
    return min(ok, key=lambda t: (t.value, TrialRecord.of(t).rel_logloss_pct or 0.0, t.number))


def confirmation(study: Any) -> dict[str, Any] | None:
    """The confirmation stage's stored result (:mod:`loka_tune.tuner.confirm`), or None."""
    c = study.user_attrs.get(ATTR_CONFIRM)
    return dict(c) if c else None


def exported_trial(study: Any, *, unconfirmed: bool = False) -> Any:
    """The trial ``export_best`` exports: the confirmed best when the study was confirmed (a
    :class:`StudyError` when no candidate held up, unless ``unconfirmed``), else the best trial."""
    c = confirmation(study)
    if c is None or unconfirmed:
        return best_trial(study)
    if c.get("chosen") is None:
        raise StudyError(f"study {study.study_name!r}: none of the confirmed configs (trials {c.get('trials')}) kept"
                         f" its mean relative log loss within the budget on seeds {c.get('seeds')}; run more"
                         " trials, raise objective.budget_pct, or export the unconfirmed best (--unconfirmed)")
    return next(t for t in study.get_trials(deepcopy=False) if t.number == c["chosen"])


def leaderboard(study: Any, *, limit: int | None = None) -> list[dict[str, Any]]:
    """Finished trials, feasible ones first by step time, then the rest by relative log loss;
    ``exported`` marks the trial ``export_best`` would write, ``within_noise`` a completed
    trial whose relative log loss is within the baseline's noise floor (:func:`within_noise`)."""
    try:
        exported = exported_trial(study).number
    except StudyError:
        exported = None
    floor = noise_floor(study)
    rows = []
    for t in study.get_trials(deepcopy=False):
        if t.state.name not in STATES_DONE:
            continue
        r = TrialRecord.of(t)
        n_fp8 = sum(1 for s in (r.config.get("sites") or {}).values() for v in s.values() if not v.startswith("bf16"))
        rows.append({"trial": t.number, "state": t.state.name, "feasible": bool(r.feasible),
                     "step_time_s": t.value, "speedup": r.speedup, "speedup_vs_mods": r.speedup_vs_mods,
                     "rel_logloss_pct": r.rel_logloss_pct, "exported": t.number == exported,
                     "within_noise": within_noise(r.rel_logloss_pct, floor) if t.state.name == "COMPLETE" else None,
                     "eval_ne": r.eval_ne, "eval_auc": r.eval_auc, "cache_hit": bool(r.cache_hit),
                     "fp8_gemms": n_fp8, "mods": (r.config.get("mods") and _mods_str(r.config["mods"])) or "none",
                     "reason": r.fail_reason or "", "seeded": "" if r.seeded is None else r.seeded,
                     "cached_from": r.cached_from})

    def order(r: dict[str, Any]) -> tuple[int, float]:
        if r["feasible"]:
            return (0, r["step_time_s"])
        rel = r["rel_logloss_pct"]
        return (1 if r["state"] == "COMPLETE" else 2, rel if rel is not None else math.inf)

    rows.sort(key=order)
    return rows[:limit] if limit else rows


def _mods_str(d: Mapping[str, Any]) -> str:
    try:
        return ModsConfig.from_dict(d).short_str()
    except LokaError:
        return "?"


_CACHE_KEYS = ("hits", "misses", "bypass", "aot_hits", "aot_misses", "aot_bypass")


def compile_cache_totals(counts: list[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The sum of compiled runs' ``compile_cache`` counts, with ``runs`` (how many) and
    ``hit_rate`` = hits / (hits + misses + bypass) of inductor's FX graph cache (None when it
    was never asked); None for no run."""
    if not counts:
        return None
    tot = {k: sum(int(c.get(k) or 0) for c in counts) for k in _CACHE_KEYS}
    asked = tot["hits"] + tot["misses"] + tot["bypass"]
    return {"runs": len(counts), **tot, "hit_rate": tot["hits"] / asked if asked else None}


def compile_cache_summary(study: Any) -> dict[str, Any] | None:
    """Inductor's cache over the study's compiled trial runs (the trials' ``compile_cache``,
    cache copies left out: they ran nothing): :func:`compile_cache_totals`, plus
    ``confirmation``, the same over the confirmation's runs (None when it ran none compiled).
    None when no trial compiled. The confirmation stage stores it as ``loka.compile_cache``."""
    trials = [TrialRecord.of(t) for t in study.get_trials(deepcopy=False) if t.state.name in STATES_DONE]
    out = compile_cache_totals([r.compile_cache for r in trials if r.compile_cache and not r.cache_hit])
    if out is None:
        return None
    runs = [x["compile_cache"] for row in (confirmation(study) or {}).get("rows", []) for x in row.get("runs", [])
            if x.get("compile_cache")]
    return {**out, "confirmation": compile_cache_totals(runs)}


def study_summary(study: Any) -> dict[str, Any]:
    attrs = study.user_attrs
    return {"baseline": attrs.get(ATTR_BASELINE), "study": attrs.get(ATTR_STUDY)}


def chosen_trial(study: Any, number: int) -> Any:
    """Trial ``number`` of the study, if it completed (feasible or not); :class:`StudyError` otherwise."""
    trials = study.get_trials(deepcopy=False)
    t = next((t for t in trials if t.number == number), None)
    if t is None:
        if not trials:
            raise StudyError(f"study {study.study_name!r} has no trial {number}: it has no trials yet; run"
                             " `loka-tune tune` first")
        raise StudyError(f"study {study.study_name!r} has no trial {number} (trials 0 to"
                         f" {max(t.number for t in trials)}); see `loka-tune report` for their numbers")
    if t.state.name != "COMPLETE" or not TrialRecord.of(t).config:
        raise StudyError(f"trial {number} of {study.study_name!r} is {t.state.name}, not COMPLETE: only a completed"
                         " trial has measured metrics to export; choose another (`loka-tune report`)")
    return t


def export_best(study: Any, out: str | Path | None = None, *, trial: int | None = None,
                unconfirmed: bool = False) -> PrecisionConfig:
    """The study's answer as a PrecisionConfig with its provenance (written to ``out`` if given):
    the confirmed best when the study ran its confirmation stage, else the best feasible trial
    (see :func:`exported_trial`); with ``trial``, that completed trial's instead (provenance
    ``trial_chosen``: true). The provenance records the trial's claimed speed-ups (vs bf16 and
    vs bf16 with the same Mods), the confirmed ones and the confirmed relative log loss with its
    spread over the confirmation seeds (None where not confirmed)."""
    import optuna
    import torch

    from loka_tune.version import __version__

    t = exported_trial(study, unconfirmed=unconfirmed) if trial is None else chosen_trial(study, trial)
    r = TrialRecord.of(t)
    config = PrecisionConfig.from_dict(r.config)
    bl = study.user_attrs.get(ATTR_BASELINE) or {}
    st = study.user_attrs.get(ATTR_STUDY) or {}
    objective, training = st.get("objective") or {}, st.get("training") or {}
    prov = {
        "study": study.study_name,
        "trial": t.number,
        "step_time_s": t.value,
        "speedup": r.speedup,
        "speed_source": r.speed_source,
        "rel_logloss_pct": r.rel_logloss_pct,
        "budget_pct": r.budget_pct,
        "eval_logloss": r.eval_logloss,
        "eval_ne": r.eval_ne,
        "eval_auc": r.eval_auc,
        "baseline_logloss": (bl.get("eval_logloss") or [None])[0],
        "baseline_step_time_s": bl.get("step_time_s"),
        "noise_floor_pct": bl.get("noise_floor_pct"),
        "within_noise": within_noise(r.rel_logloss_pct, bl.get("noise_floor_pct")),
        "device": bl.get("device"),
        "cost_device": objective.get("cost_device"),
        "cost_batch_size": objective.get("cost_batch_size") or training.get("batch_size"),
        "model": st.get("model"),
        "data": (st.get("data") or {}).get("source"),
        "data_params": (st.get("data") or {}).get("params"),  # with model + data: `train --config` rebuilds it
        "objective": objective.get("kind"),
        "regime": st.get("regime"),
        # the short runs' schedule and rates: `train --config` trains as the study did unless told otherwise
        "training": _recorded_training(training, st.get("regime") or {}),
        **_confirmed_provenance(study, t.number, r),
        "versions": {"loka_tune": __version__, "torch": torch.__version__, "optuna": optuna.__version__,
                     "python": platform.python_version()},
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if trial is not None:
        prov["trial_chosen"] = True
    config = config.with_provenance(**prov)
    if out is not None:
        config.save(out)
    return config


RECORDED_TRAINING = ("steps", "batch_size", "lr_dense", "lr_sparse", "lr_warmup_steps", "lr_cooldown_steps",
                     "sparse_optimizer")


def _recorded_training(training: dict[str, Any], regime: dict[str, Any]) -> dict[str, Any] | None:
    """The study's schedule and rates as its runs trained (a ``[regime] batch_size`` is the
    batch they ran at), for ``train --config``; None for a study stored without them."""
    rec = {k: training[k] for k in RECORDED_TRAINING if training.get(k) is not None}
    if regime.get("batch_size"):
        rec["batch_size"] = regime["batch_size"]
    return rec or None


def _confirmed_provenance(study: Any, number: int, r: TrialRecord) -> dict[str, Any]:
    """The claimed and confirmed speed-ups and loss of trial ``number`` (confirmed: None if it was not)."""
    c = confirmation(study) or {}
    row = next((x for x in c.get("rows", []) if x.get("trial") == number), None)
    out: dict[str, Any] = {"claimed_speedup": r.speedup_vs_mods, "claimed_speedup_vs_bf16": r.speedup,
                           "confirmed": row is not None and bool(row.get("feasible"))}
    keys = {"confirmed_speedup": "speedup_vs_mods", "confirmed_speedup_vs_bf16": "speedup",
            "confirmed_step_time_s": "step_time_s", "confirmed_rel_logloss_pct": "rel_logloss_pct",
            "confirmed_rel_logloss_sd_pct": "rel_logloss_sd_pct"}
    out.update({k: (row or {}).get(v) for k, v in keys.items()})
    floor = (study.user_attrs.get(ATTR_BASELINE) or {}).get("noise_floor_pct")
    out["confirmed_within_noise"] = within_noise(out["confirmed_rel_logloss_pct"], floor) if row is not None else None
    out["confirmed_seeds"] = c.get("seeds") if row is not None else None
    out["confirmed_regime"] = c.get("regime") if row is not None else None
    return out
