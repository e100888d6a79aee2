"""One trial: a fresh model, the trial's precision config applied, the paired short run, the speed.

:func:`evaluate_config` is the objective; what it gives is a :class:`TrialOutcome`. Failures a
config can cause (unsupported choice, non-finite loss, out of memory) are outcomes, not errors.
A trial runs on the pairing seed ``training.seeds[0]`` (init and data order: the baseline's
first run); a completed one records how (``run``: :func:`run_description`), so that the
confirmation can take it as that seed's run, and a compiled one its graphs' cache counts
(``compile_cache``: inductor's FX graph cache and AOTAutograd's).

Two runs a trial would repeat are not run again (training objective): plain bf16 without Mods
(the "all-bf16" start) on the pairing seed is the baseline's own run of that seed, the same
config, seed, data order and regime, so the trial takes the baseline's numbers
(:data:`BASELINE_RUN`); and a plain bf16 trial under Mods, with measured speed, is the timing
run of its Mods set's reference (:func:`reference_seconds`), so its own step time becomes that
reference rather than a second run timing the same thing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from loka_tune.config import ModsConfig, PrecisionConfig, SitePrecision
from loka_tune.errors import BackendError, UnsupportedChoiceError
from loka_tune.objectives.speed import measure_forward_seconds
from loka_tune.tuner.baseline import modeled_seconds, time_reference
from loka_tune.tuner.build import first_batch, resolve_device, train_config, trial_model
from loka_tune.tuner.parallel import train_in_study
from loka_tune.tuner.prepare import StudyContext
from loka_tune.tuner.results import ATTR_REFERENCE, within_budget
from loka_tune.tuner.study import StudyConfig

if TYPE_CHECKING:
    from loka_tune.objectives.trainer import TrainConfig

__all__ = ["BASELINE_RUN", "TrialOutcome", "evaluate_config", "reference_seconds", "run_description", "run_cache_counts",
           "plain_bf16"]

#: an "ok" trial's ``reason`` when it took the bf16 baseline's own run (the rest says which seed)
BASELINE_RUN = "the bf16 baseline's run"


@dataclass
class TrialOutcome:
    """What evaluating one configuration gave."""

    status: str  # "ok", "pruned", "failed"
    rel_logloss_pct: float = math.nan
    step_time_s: float = math.nan
    speedup: float = math.nan
    eval_logloss: float = math.nan
    eval_ne: float = math.nan
    eval_auc: float = math.nan
    measured_step_time_s: float = math.nan
    mods_step_time_s: float = math.nan
    speedup_vs_mods: float = math.nan
    reason: str = ""
    steps_run: int = 0
    wall_s: float = 0.0
    step_losses: tuple[float, ...] = field(default=(), repr=False)  # the run's training loss per step (MLflow)
    run: dict[str, Any] | None = None  # how the completed run trained (run_description)
    compile_cache: dict[str, int] | None = None  # a compiled run's cache counts (compile_cache_counts)

    def feasible(self, budget_pct: float) -> bool:
        """A completed ("ok") run within the loss budget (:func:`~loka_tune.tuner.results.within_budget`)."""
        return self.status == "ok" and within_budget(self.rel_logloss_pct, budget_pct)

    def attrs(self) -> dict[str, Any]:
        """As trial attributes: non-finite floats become None; ``run`` and ``compile_cache`` only when set."""
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()
                if k != "step_losses" and not (k in ("run", "compile_cache") and v is None)}


def run_description(cfg: StudyConfig, tcfg: TrainConfig) -> dict[str, Any]:
    """What makes two runs of one config the same run: the seed (init and data order), the
    steps and the regime (:meth:`~loka_tune.tuner.regime.RegimeSection.describe`, and
    ``nproc``); everything else comes from the study's settings, which its trials share."""
    return {"seed": tcfg.seed, "steps": tcfg.steps, **cfg.regime.describe(tcfg), "nproc": cfg.regime.nproc}


def run_cache_counts(tcfg: TrainConfig) -> dict[str, int] | None:
    """The compile cache counts of the run that just ended, if it was compiled (else None)."""
    if not tcfg.compile:
        return None
    from loka_tune.objectives.compiled import compile_cache_counts

    return compile_cache_counts()


def reference_seconds(ctx: StudyContext, mods: ModsConfig) -> float:
    """Step (or forward) seconds of bf16 with ``mods``, in the objective's terms: the reference
    of a trial's ``speedup_vs_mods``, so FP8 is never credited with the Mods' gain.

    No Mods: the baseline's. Modeled: the cost model on a bf16 + Mods model. Measured: one
    timing run in the study's regime per Mods set, shared by every trial (and worker) through
    the study's user attribute ``loka.reference.<mods>``.
    """
    bl = ctx.baseline
    if mods == ModsConfig():
        return float(bl.step_time_s)
    known = _known_reference(ctx, mods)
    if known is not None:
        return known
    cfg = ctx.cfg
    if ctx.speed == "modeled" or cfg.objective.kind == "inference":
        model, _ = trial_model(cfg, ctx.source, PrecisionConfig(mods=mods), device=ctx.device)
        if ctx.speed == "modeled":
            on_cpu = resolve_device(ctx.device) == "cpu"
            batch = ctx.batch if on_cpu else first_batch(ctx.source, cfg, ctx.device, max_rows=64)
            t = modeled_seconds(model, batch, cfg, bl)
        else:
            t = measure_forward_seconds(model, first_batch(ctx.source, cfg, ctx.device),
                                        autocast=cfg.training.autocast)
    else:
        t = time_reference(cfg, ctx.source, ctx.device, mods)
    return _keep_reference(ctx, mods, float(t))


def _known_reference(ctx: StudyContext, mods: ModsConfig) -> float | None:
    """A Mods set's reference seconds already had: this process's, else the study's stored one."""
    key = ATTR_REFERENCE + mods.short_str()
    if key in ctx.references:
        return ctx.references[key]
    stored = ctx.study.user_attrs.get(key) if ctx.study is not None else None
    if stored is None:
        return None
    ctx.references[key] = float(stored)
    return float(stored)


def _keep_reference(ctx: StudyContext, mods: ModsConfig, t: float) -> float:
    """Keep ``t`` as a Mods set's reference seconds (in this process; on the study too, unless modeled)."""
    key = ATTR_REFERENCE + mods.short_str()
    ctx.references[key] = t
    if ctx.study is not None and ctx.speed != "modeled":  # modeled is cheap and deterministic: not stored
        ctx.study.set_user_attr(key, t)
    return t


def plain_bf16(config: PrecisionConfig) -> bool:
    """Whether ``config`` runs every GEMM as the bf16 baseline does (plain bf16, no backend of its
    own), whatever its Mods: :func:`~loka_tune.applier.apply` then changes no Linear's precision."""
    plain = SitePrecision()
    return config.default == plain and all(rule.precision == plain for rule in config.sites)


def _baseline_outcome(ctx: StudyContext, t0: float) -> TrialOutcome:
    """The "all-bf16" trial (plain bf16, no Mods) of a training objective: the baseline's run of the
    pairing seed is this trial's run (same config, seed, data order and regime: in both H200 studies
    of 2026-12-04, B = 8192 and 32768, the compiled re-run that this replaces ended at the baseline's
    eval log loss to every bit, and took 9.8 s and 19.6 s), so its numbers are taken instead of
    training it again. Speed is the baseline's in the objective's terms, as
    :func:`reference_seconds` takes it for no Mods."""
    cfg, bl = ctx.cfg, ctx.baseline
    tcfg = train_config(cfg, device=ctx.device)
    t = float(bl.step_time_s)
    return TrialOutcome("ok", rel_logloss_pct=0.0, step_time_s=t, speedup=1.0, mods_step_time_s=t,
                        speedup_vs_mods=1.0, eval_logloss=float(bl.logloss), eval_ne=float(bl.eval_ne),
                        eval_auc=float(bl.eval_auc), measured_step_time_s=float(bl.measured_step_time_s),
                        reason=f"{BASELINE_RUN} (seed {bl.seeds[0]}: the same config, seed, data order and regime)",
                        steps_run=int(tcfg.steps), wall_s=time.perf_counter() - t0,
                        run=run_description(cfg, tcfg))


def evaluate_config(ctx: StudyContext, config: PrecisionConfig, *,
                    report: Callable[[int, float], bool] | None = None) -> TrialOutcome:
    """Build a fresh model, apply ``config``, run the paired short run and measure speed.

    ``report(step, rel_window_loss_pct) -> bool`` is called at each loss window; True prunes.
    Failures a config can cause (unsupported choice, non-finite loss, out of memory) come back
    as ``status="failed"`` with the reason; other errors propagate.
    """
    from loka_tune.objectives.metrics import relative_log_loss

    cfg, bl = ctx.cfg, ctx.baseline
    t0 = time.perf_counter()
    training = cfg.objective.kind != "inference"
    if training and config.mods == ModsConfig() and plain_bf16(config) and bl.seeds[:1] == tuple(cfg.training.seeds[:1]):
        return _baseline_outcome(ctx, t0)
    try:
        model, _summary = trial_model(cfg, ctx.source, config, device=ctx.device)
    except (UnsupportedChoiceError, BackendError) as e:
        return TrialOutcome("failed", reason=f"unsupported: {e}", wall_s=time.perf_counter() - t0)
    modeled = None
    if ctx.speed == "modeled":
        on_cpu = resolve_device(ctx.device) == "cpu"
        batch = ctx.batch if on_cpu else first_batch(ctx.source, cfg, ctx.device, max_rows=64)
        modeled = modeled_seconds(model, batch, cfg, bl)
    base_curve = dict(zip(bl.window_steps, bl.window_losses))

    def on_step(step: int, window_loss: float) -> bool:
        base = base_curve.get(step)
        if base is None or report is None:
            return False
        rel = (window_loss - base) / base * 100.0 if math.isfinite(window_loss) else math.inf
        return bool(report(step, rel))

    tcfg = train_config(cfg, device=ctx.device)  # the pairing seed, training.seeds[0]
    try:
        res = train_in_study(model, ctx.source, tcfg, seed=None, config=config, on_step=on_step)
    except (UnsupportedChoiceError, BackendError) as e:
        return TrialOutcome("failed", reason=f"unsupported: {e}", wall_s=time.perf_counter() - t0)
    except torch.cuda.OutOfMemoryError as e:  # a config may need more memory (e.g. fp32 copies)
        del model
        torch.cuda.empty_cache()
        return TrialOutcome("failed", reason=f"out of memory: {str(e).splitlines()[0]}",
                            wall_s=time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    cache = run_cache_counts(tcfg)  # read now: the reference's run below compiles too
    if res.status == "nonfinite":
        return TrialOutcome("failed", reason=f"non-finite loss at step {res.nonfinite_step}",
                            steps_run=res.steps_run, wall_s=wall, step_losses=tuple(res.step_losses),
                            compile_cache=cache)
    if res.status == "pruned":
        last = res.loss_curve[-1] if res.loss_curve else math.nan
        base = base_curve.get(res.curve_steps[-1]) if res.curve_steps else None
        rel = (last - base) / base * 100 if base else math.nan
        return TrialOutcome("pruned", rel_logloss_pct=rel, steps_run=res.steps_run, wall_s=wall,
                            reason="windowed loss hopeless vs the baseline", step_losses=tuple(res.step_losses),
                            compile_cache=cache)
    if modeled is not None:
        t = modeled
    elif cfg.objective.kind == "inference":
        t = measure_forward_seconds(model, first_batch(ctx.source, cfg, ctx.device), autocast=cfg.training.autocast)
    else:
        t = float(res.step_time_s)
    rel = relative_log_loss(res.eval_logloss, bl.logloss) * 100.0
    if training and modeled is None and config.mods != ModsConfig() and plain_bf16(config):
        if _known_reference(ctx, config.mods) is None:  # this run is its Mods set's bf16 reference
            _keep_reference(ctx, config.mods, t)
    ref = reference_seconds(ctx, config.mods)
    return TrialOutcome("ok", rel_logloss_pct=float(rel), step_time_s=float(t), speedup=float(bl.step_time_s / t),
                        mods_step_time_s=ref, speedup_vs_mods=float(ref / t),
                        eval_logloss=float(res.eval_logloss), eval_ne=float(res.eval_ne),
                        eval_auc=float(res.eval_auc), measured_step_time_s=float(res.step_time_s),
                        steps_run=res.steps_run, wall_s=wall, step_losses=tuple(res.step_losses),
                        run=run_description(cfg, tcfg), compile_cache=cache)
