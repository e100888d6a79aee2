"""The confirmation stage: the search's best few configs, run again before one is exported.

A trial is one short run on one seed; its speed-up and its loss carry that run's noise, and the
search picks the luckiest of many. So after the search the best ``[confirm] n_best`` feasible
configs (fastest first, one per config) are run again in the study's ``[regime]`` on every
confirmation seed (at least two), each seed paired with bf16 on the same seed (its eval log
loss: the baseline's run where it has that seed) and, for speed, with bf16 + the same Mods
(measured: a timing run in the regime beside each config run; modeled: the cost model). The
confirmed best is the fastest whose *mean* relative log loss over the seeds is within the
budget; :func:`~loka_tune.tuner.results.export_best` exports it, with the claimed and the
confirmed speed-ups and the loss's mean and spread in its provenance.

A trial already ran its config on one seed, the pairing seed ``training.seeds[0]``, in the
regime. Where a confirmation seed is that seed, the trial's own run stands for it, instead of
running it again: when the trial's record says (``run``: seed, steps, regime, device) that it
trained exactly as the confirmation's run on that seed would, with the same speed source.
That seed's row is then built from the trial's stored numbers, marked ``"reused": "trial N"``:
its step time; for speed, the bf16 + same Mods reference timed for the trial's run (its
``mods_step_time_s``: the study's one timing per Mods set, or the baseline without Mods, or
the cost model); its eval log loss against bf16's on the same seed. Only the other seeds
train. A trial recorded without ``run`` (an older study) is run again on every seed, except on
a CPU with modeled speed, where runs are deterministic and its own run stands for the pairing
seed as before.

The result is stored in the study's user attribute ``loka.confirmation`` (and inductor's cache
counts of the trials' and the confirmation's compiled runs in ``loka.compile_cache``:
:func:`~loka_tune.tuner.results.compile_cache_summary`); running the stage again with the same
candidates and seeds reuses it. Each run is kept as it finishes (``loka.confirmation_runs``, by
the config as it trains, the run's seed, steps and regime, and the speed source; a bf16 run on a
seed the baseline has not, too): a confirmation cut short (Ctrl-C, a time limit) that runs again
takes the runs it finished, marked ``"kept"``, and trains only the rest.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from typing import Any

from loka_tune.config import PrecisionConfig
from loka_tune.errors import BackendError, UnsupportedChoiceError
from loka_tune.objectives.speed import measure_forward_seconds
from loka_tune.tuner.baseline import modeled_seconds, time_reference
from loka_tune.tuner.build import first_batch, make_model, resolve_device, train_config
from loka_tune.tuner.log import log
from loka_tune.tuner.parallel import train_in_study
from loka_tune.tuner.prepare import StudyContext
from loka_tune.tuner.results import (
    ATTR_COMPILE_CACHE,
    ATTR_CONFIRM,
    ATTR_CONFIRM_RUNS,
    TrialRecord,
    compile_cache_summary,
    noise_note,
    within_budget,
)
from loka_tune.tuner.trial import reference_seconds, run_cache_counts, run_description

__all__ = ["confirm_best", "confirmation_candidates"]


def confirmation_candidates(study: Any, n_best: int) -> list[Any]:
    """The ``n_best`` fastest feasible completed trials, one per configuration as it trains (the
    first trial of each: :attr:`TrialRecord.trains_as`)."""
    from optuna.trial import TrialState

    ok = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
          if TrialRecord.of(t).feasible and t.value is not None]
    ok.sort(key=lambda t: (t.value, TrialRecord.of(t).rel_logloss_pct or 0.0, t.number))
    seen: set[str | None] = set()
    out = []
    for t in ok:
        key = TrialRecord.of(t).trains_as  # one per model trained: under fp8_chain, tensorwise variants are one
        if key in seen:
            continue
        seen.add(key)
        out.append(t)
        if len(out) == n_best:
            break
    return out


def confirm_best(ctx: StudyContext, *, n_best: int | None = None,
                 seeds: tuple[int, ...] | None = None) -> dict[str, Any] | None:
    """Run the confirmation stage on a prepared study (see the module docstring); returns what
    it stored (None when the study has no feasible trial)."""
    cfg, study = ctx.cfg, ctx.study
    n_best = n_best or cfg.confirm.n_best
    seeds = tuple(seeds or cfg.confirm.seeds_for(tuple(cfg.training.seeds)))
    cands = confirmation_candidates(study, n_best)
    if not cands:
        return None
    numbers = [t.number for t in cands]
    prior = study.user_attrs.get(ATTR_CONFIRM)
    if prior and prior.get("trials") == numbers and prior.get("seeds") == list(seeds):
        _store_compile_cache(study)
        return dict(prior)
    t0 = time.perf_counter()
    log(f"[loka-tune] confirming the best {len(cands)} configs (trials {numbers}) on seeds {list(seeds)},"
         f" paired with bf16 + the same Mods ...")
    rows = [_confirm_one(ctx, t, seeds) for t in cands]
    budget = cfg.objective.budget_pct
    feasible = [r for r in rows if r["feasible"]]
    chosen = min(feasible, key=lambda r: (r["step_time_s"], r["rel_logloss_pct"], r["trial"])) if feasible else None
    tcfg = train_config(cfg, device=ctx.device)
    result = {"trials": numbers, "seeds": list(seeds), "budget_pct": budget, "speed_source": ctx.speed,
              "regime": cfg.regime.describe(tcfg), "rows": rows,
              "chosen": None if chosen is None else chosen["trial"], "wall_s": time.perf_counter() - t0}
    study.set_user_attr(ATTR_CONFIRM, result)
    _store_compile_cache(study)
    what = ("none within the budget" if chosen is None else
            f"trial {chosen['trial']}: {chosen['speedup_vs_mods']:.3f}x vs bf16 + same Mods (claimed"
            f" {chosen['claimed_speedup_vs_mods']:.3f}x), rel. LL {chosen['rel_logloss_pct']:+.4f}%"
            f" (sd {chosen['rel_logloss_sd_pct'] or 0:.4f} over the seeds)"
            + noise_note(chosen['rel_logloss_pct'], ctx.baseline.noise_floor_pct))
    log(f"[loka-tune] confirmed: {what} ({result['wall_s']:.0f}s)")
    return result


def _store_compile_cache(study: Any) -> None:
    summary = compile_cache_summary(study)
    if summary is not None:
        study.set_user_attr(ATTR_COMPILE_CACHE, summary)


def _bf16_logloss(ctx: StudyContext, seed: int) -> float:
    """bf16's eval log loss on ``seed``: the baseline's run, else one bf16 run in the regime (cached)."""
    bl = ctx.baseline
    if seed in bl.seeds:
        return float(bl.eval_logloss[bl.seeds.index(seed)])
    key = f"bf16-logloss.{seed}"
    if key not in ctx.references:
        kept_key = _run_key(ctx, "bf16", seed)
        kept = _kept(ctx, kept_key)
        if kept is None:
            model = make_model(ctx.cfg, ctx.source, seed=seed)
            from loka_tune.applier import apply

            apply(model, PrecisionConfig())
            res = train_in_study(model, ctx.source, train_config(ctx.cfg, seed, device=ctx.device), seed=seed,
                                 config=PrecisionConfig())
            kept = _keep(ctx, kept_key, {"eval_logloss": float(res.eval_logloss)})
        ctx.references[key] = float(kept["eval_logloss"])
    return ctx.references[key]


def _run_key(ctx: StudyContext, what: str | None, seed: int) -> str:
    """A confirmation run's key among the kept ones: what trained (a config as it trains, or
    ``"bf16"``), on which seed, how (:func:`run_description`), with which speed source."""
    run = run_description(ctx.cfg, train_config(ctx.cfg, seed, device=ctx.device))
    return json.dumps([what, run, ctx.speed], sort_keys=True, default=str)


def _kept(ctx: StudyContext, key: str) -> dict[str, Any] | None:
    kept = (ctx.study.user_attrs.get(ATTR_CONFIRM_RUNS) or {}).get(key)
    return None if kept is None else dict(kept)


def _keep(ctx: StudyContext, key: str, row: dict[str, Any]) -> dict[str, Any]:
    """Store a finished run's row among the kept ones; returns it."""
    kept = dict(ctx.study.user_attrs.get(ATTR_CONFIRM_RUNS) or {})
    kept[key] = row
    ctx.study.set_user_attr(ATTR_CONFIRM_RUNS, kept)
    return row


def _kept_or_run(ctx: StudyContext, trial: Any, r: TrialRecord, config: PrecisionConfig, seed: int) -> dict[str, Any]:
    """Trial ``trial``'s confirmation run on ``seed``: kept from a confirmation that did not
    finish, else run now (:func:`_run_seed`) and kept."""
    key = _run_key(ctx, r.trains_as, seed)
    kept = _kept(ctx, key)
    if kept is not None:
        log(f"[loka-tune] confirm: trial {trial.number} on seed {seed}: the run an earlier confirmation finished")
        return {**kept, "kept": "an earlier confirmation"}
    return _keep(ctx, key, _run_seed(ctx, config, seed))


def _run_seed(ctx: StudyContext, config: PrecisionConfig, seed: int) -> dict[str, Any]:
    """One confirmation run of ``config`` on ``seed`` (init and data order), with its references."""
    from loka_tune.applier import apply
    from loka_tune.objectives.metrics import relative_log_loss

    cfg = ctx.cfg
    model = make_model(cfg, ctx.source, seed=seed).to(resolve_device(ctx.device))
    tcfg = train_config(cfg, seed, device=ctx.device)
    try:
        apply(model, config)
        res = train_in_study(model, ctx.source, tcfg, seed=seed, config=config)
    except (UnsupportedChoiceError, BackendError) as e:
        return {"seed": seed, "status": "failed", "reason": f"unsupported: {e}"}
    cache = run_cache_counts(tcfg)  # this run's, before the reference's run compiles
    if res.status != "ok":
        return {"seed": seed, "status": res.status, "reason": f"{res.status} at step {res.nonfinite_step}"}
    if ctx.speed == "modeled":
        on_cpu = resolve_device(ctx.device) == "cpu"
        batch = ctx.batch if on_cpu else first_batch(ctx.source, cfg, ctx.device, max_rows=64)
        t, ref = modeled_seconds(model, batch, cfg, ctx.baseline), reference_seconds(ctx, config.mods)
    elif cfg.objective.kind == "inference":  # a measured forward pass (the reference: bf16 + Mods' own)
        t = measure_forward_seconds(model, first_batch(ctx.source, cfg, ctx.device), autocast=cfg.training.autocast)
        ref = reference_seconds(ctx, config.mods)
    else:  # paired: bf16 + the same Mods timed on the same seed, right beside the config's run
        t, ref = float(res.step_time_s), time_reference(cfg, ctx.source, ctx.device, config.mods, seed=seed)
    rel = relative_log_loss(res.eval_logloss, _bf16_logloss(ctx, seed)) * 100.0
    out = {"seed": seed, "status": "ok", "rel_logloss_pct": float(rel), "eval_logloss": float(res.eval_logloss),
           "step_time_s": float(t), "ref_step_time_s": float(ref), "measured_step_time_s": float(res.step_time_s)}
    return out if cache is None else {**out, "compile_cache": cache}


def _same_run(ctx: StudyContext, r: TrialRecord, seed: int) -> bool:
    """Whether the trial's own run is the confirmation's run on ``seed`` (see the module
    docstring): its record says it trained so; for a record without ``run`` (an older study),
    only on a CPU with modeled speed, where runs are deterministic, on the pairing seed."""
    if r.run is None:
        return ctx.speed == "modeled" and resolve_device(ctx.device) == "cpu" and seed == ctx.cfg.training.seeds[0]
    want = run_description(ctx.cfg, train_config(ctx.cfg, seed, device=ctx.device))
    return dict(r.run) == want and r.speed_source == ctx.speed


def _reused_run(ctx: StudyContext, trial: Any, r: TrialRecord, config: PrecisionConfig, seed: int) -> dict[str, Any] | None:
    """The trial's own run as its confirmation run on ``seed``, where it is that run (see
    :func:`_same_run`): its step time, the reference timed for it, its eval log loss against
    bf16's on ``seed``. Else None: the seed is run."""
    from loka_tune.objectives.metrics import relative_log_loss

    if trial.value is None or r.eval_logloss is None or not _same_run(ctx, r, seed):
        return None
    ref = r.mods_step_time_s if r.mods_step_time_s is not None else reference_seconds(ctx, config.mods)
    rel = relative_log_loss(r.eval_logloss, _bf16_logloss(ctx, seed)) * 100.0
    source = r.cached_from if r.cache_hit and r.cached_from is not None else trial.number
    log(f"[loka-tune] confirm: trial {source}'s own run stands for seed {seed}")
    return {"seed": seed, "status": "ok", "rel_logloss_pct": float(rel), "eval_logloss": float(r.eval_logloss),
            "step_time_s": float(trial.value), "ref_step_time_s": float(ref),
            "measured_step_time_s": r.measured_step_time_s, "reused": f"trial {source}"}


def _confirm_one(ctx: StudyContext, trial: Any, seeds: tuple[int, ...]) -> dict[str, Any]:
    r = TrialRecord.of(trial)
    config = PrecisionConfig.from_dict(r.config)
    runs = [_reused_run(ctx, trial, r, config, s) or _kept_or_run(ctx, trial, r, config, s) for s in seeds]
    ok = [x for x in runs if x["status"] == "ok"]
    row: dict[str, Any] = {"trial": trial.number, "config_key": r.config_key, "mods": config.mods.short_str(),
                           "claimed_speedup_vs_mods": r.speedup_vs_mods, "claimed_speedup": r.speedup,
                           "claimed_rel_logloss_pct": r.rel_logloss_pct, "runs": runs}
    if len(ok) < len(runs):
        bad = next(x for x in runs if x["status"] != "ok")
        row.update(feasible=False, reason=f"seed {bad['seed']}: {bad['reason']}", step_time_s=None,
                   rel_logloss_pct=None, rel_logloss_sd_pct=None, speedup_vs_mods=None, speedup=None)
        return row
    rels = [x["rel_logloss_pct"] for x in ok]
    t = statistics.median(x["step_time_s"] for x in ok)
    ref = statistics.median(x["ref_step_time_s"] for x in ok)
    mean = statistics.fmean(rels)
    row.update(step_time_s=t, ref_step_time_s=ref, speedup_vs_mods=ref / t,
               speedup=ctx.baseline.step_time_s / t, rel_logloss_pct=mean,
               rel_logloss_sd_pct=statistics.stdev(rels) if len(rels) > 1 else None,
               feasible=within_budget(mean, ctx.cfg.objective.budget_pct))
    log(f"[loka-tune]   trial {trial.number}: {row['speedup_vs_mods']:.3f}x vs bf16 + same Mods (claimed"
         f" {r.speedup_vs_mods or math.nan:.3f}x), rel. LL {mean:+.4f}% over seeds {list(seeds)}"
         f"{noise_note(mean, ctx.baseline.noise_floor_pct)} ({'feasible' if row['feasible'] else 'over budget'})")
    return row
