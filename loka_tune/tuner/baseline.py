"""The bf16 baseline: the reference every trial pairs with, and its noise floor.

bf16 short runs on every ``training.seeds`` (the Probe watching the first) give the baseline's
quality and the seed-to-seed noise floor of relative log loss; :func:`price_baseline` states
its speed in the objective's terms (measured, or modeled GEMMs + a non-GEMM remainder).
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from torch import nn

from loka_tune.config import ModsConfig, PrecisionConfig
from loka_tune.errors import StudyError
from loka_tune.objectives.speed import measure_forward_seconds, modeled_gemm_seconds
from loka_tune.tuner.build import _first_batch, _log, _train, make_model, train_config
from loka_tune.tuner.study import StudyConfig

__all__ = ["Baseline", "run_baseline", "check_budget", "price_baseline", "modeled_seconds", "time_reference"]

REFERENCE_TIMED_STEPS = 50  # timed steps of a bf16 (+ Mods) reference run: a median of 50 is stable to ~1%


@dataclass(frozen=True)
class Baseline:
    """What the bf16 baseline runs measured: the reference of every trial.

    ``eval_logloss[i]`` is seed ``seeds[i]``'s; trials pair with ``seeds[0]``.
    ``noise_floor_pct``: the largest |relative log loss| between another seed and seeds[0].
    ``window_losses``: seeds[0]'s training loss curve (the pruner compares against it).
    ``step_time_s``: the objective's bf16 value (measured, or modeled GEMMs + remainder).
    """

    seeds: tuple[int, ...]
    eval_logloss: tuple[float, ...]
    eval_ne: float
    eval_auc: float
    window_losses: tuple[float, ...]
    window_steps: tuple[int, ...]
    noise_floor_pct: float
    step_time_s: float
    speed_source: str
    measured_step_time_s: float
    gemm_bf16_s: float = 0.0
    remainder_s: float = 0.0
    device: str = "cpu"

    @property
    def logloss(self) -> float:
        return self.eval_logloss[0]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Baseline:
        d = dict(d)
        for k in ("seeds", "eval_logloss", "window_losses", "window_steps"):
            d[k] = tuple(d[k])
        return cls(**d)


def _say_progress(label: str, total: int) -> Callable[[int, float], None]:
    """A progress callback printing a line at every quarter of the run (no silent minutes)."""
    marks = sorted({max(1, round(total * q / 4)) for q in (1, 2, 3)})
    t0 = time.perf_counter()

    def say(step: int, loss: float) -> None:  # called every log_every steps
        if marks and step >= marks[0] and step < total:
            while marks and step >= marks[0]:
                marks.pop(0)
            _log(f"[loka-tune]   {label}: step {step}/{total}, train loss {loss:.4f}"
                 f" ({time.perf_counter() - t0:.0f}s)")

    return say


def run_baseline(cfg: StudyConfig, source: Any, device: str, *, force: bool = False,
                 probe_out: Path | None = None,
                 on_run: Callable[[int, Any], None] | None = None) -> tuple[Baseline, Any, nn.Module]:
    """bf16 short runs on every seed (the Probe watching the first); returns the baseline,
    the probe's statistics (or None) and the first seed's trained model. ``on_run(seed,
    result)`` sees each run's :class:`~loka_tune.objectives.trainer.TrainResult` (its per-step
    losses go to MLflow).

    Every run is in the study's ``[regime]`` except the probed one, which runs eagerly when the
    regime compiles or captures CUDA graphs (the probe's hooks, installed for its collection
    steps only, would re-guard a compiled model and never fire in a replayed graph); the bf16
    step time is then the median of the other seeds' (or of one extra timed run in the regime).
    """
    from loka_tune.applier import apply
    from loka_tune.objectives.metrics import relative_log_loss

    bf16 = PrecisionConfig()
    results, regime_times = [], []
    stats = None
    first_model: nn.Module | None = None
    for i, seed in enumerate(cfg.training.seeds):
        model = make_model(cfg, source, seed=seed)
        apply(model, bf16)
        tcfg = train_config(cfg, seed, device=device)
        t0 = time.perf_counter()
        probed = i == 0 and cfg.probe.enabled
        what = f"probe every {cfg.probe.every} steps, " if probed else ""
        _log(f"[loka-tune] baseline seed {seed} (bf16, {what}{_regime_str(tcfg)}): {tcfg.steps} steps ...")
        say = _say_progress(f"baseline seed {seed}", tcfg.steps)
        if probed:
            from loka_tune.probe import Probe

            eager = replace(tcfg, compile=False, cuda_graphs=False)
            with Probe(model, every=cfg.probe.every, step_on="manual") as probe:
                res = _train(model, source, eager, seed=seed, config=bf16, after_step=lambda _n: probe.step(),
                             progress=say)
            stats = probe.stats
            if probe_out is not None:
                stats.save(probe_out)
            if eager == tcfg:
                regime_times.append(float(res.step_time_s))
        else:
            res = _train(model, source, tcfg, seed=seed, config=bf16, progress=say)
            regime_times.append(float(res.step_time_s))
        if i == 0:
            first_model = model
        if res.status != "ok":
            raise StudyError(f"the bf16 baseline (seed {seed}) did not finish: status {res.status!r}"
                             f" (non-finite step {res.nonfinite_step}); lower training.lr_dense/lr_sparse")
        _log(f"[loka-tune] baseline seed {seed}: eval log loss {res.eval_logloss:.5f}, NE {res.eval_ne:.4f},"
             f" AUC {res.eval_auc:.4f} ({time.perf_counter() - t0:.1f}s)")
        results.append(res)
        if on_run is not None:
            on_run(seed, res)
    if not regime_times:  # one seed, probed outside the regime: time bf16 in it
        regime_times.append(time_reference(cfg, source, device, ModsConfig()))
    lls = tuple(float(r.eval_logloss) for r in results)
    floor = max([abs(relative_log_loss(ll, lls[0])) * 100 for ll in lls[1:]], default=0.0)
    r0 = results[0]
    step_s = float(statistics.median(regime_times))
    bl = Baseline(seeds=tuple(cfg.training.seeds), eval_logloss=lls, eval_ne=float(r0.eval_ne),
                  eval_auc=float(r0.eval_auc), window_losses=tuple(float(x) for x in r0.loss_curve),
                  window_steps=tuple(int(s) for s in r0.curve_steps), noise_floor_pct=float(floor),
                  step_time_s=step_s, speed_source="measured",
                  measured_step_time_s=step_s, device=str(r0.device))
    assert first_model is not None
    return bl, stats, first_model


def _regime_str(tcfg: Any) -> str:
    return (f"{'compiled' if tcfg.compile else 'eager'}{' + CUDA graphs' if tcfg.cuda_graphs else ''},"
            f" batch {tcfg.batch_size}")


def time_reference(cfg: StudyConfig, source: Any, device: str, mods: ModsConfig, *, seed: int | None = None) -> float:
    """Measured step seconds of bf16 with ``mods`` in the study's regime: a run of the warm-up
    plus up to :data:`REFERENCE_TIMED_STEPS` timed steps (its loss is not needed)."""
    from loka_tune.applier import apply

    model = make_model(cfg, source, seed=seed)
    config = PrecisionConfig(mods=mods)
    apply(model, config)
    tcfg = train_config(cfg, seed, device=device)
    steps = min(tcfg.steps, tcfg.warmup_steps + REFERENCE_TIMED_STEPS)
    tcfg = replace(tcfg, steps=steps, window=min(tcfg.window, steps), eval_batches=1)
    res = _train(model, source, tcfg, seed=seed, config=config)
    return float(res.step_time_s)


def check_budget(cfg: StudyConfig, baseline: Baseline, *, force: bool) -> None:
    """Refuse (unless ``force``) a budget below the seed-to-seed noise floor."""
    b, floor = cfg.objective.budget_pct, baseline.noise_floor_pct
    if len(baseline.seeds) < 2:
        warnings.warn("one baseline seed: the noise floor is unknown; give training.seeds = [0, 1, 2]",
                      stacklevel=2)
        return
    if b < floor:
        msg = (f"objective.budget_pct = {b}% is below the noise floor {floor:.4g}% (relative log loss between"
               f" bf16 baseline seeds {list(baseline.seeds)}): trials cannot be told apart from noise."
               " Raise the budget, lengthen the runs (training.steps / eval_batches), or pass --force")
        if not force:
            raise StudyError(msg)
        warnings.warn(msg + " (forced)", stacklevel=2)


def price_baseline(cfg: StudyConfig, baseline: Baseline, source: Any, batch: Any, *, speed: str,
                   device: str) -> Baseline:
    """The baseline's step time in the objective's terms: modeled (the bf16 GEMMs from the cost
    model + ``objective.non_gemm_fraction`` of the step for the rest), a measured forward pass
    (the inference objective), or as the training run measured it."""
    from loka_tune.applier import apply

    if speed == "modeled":
        bf16_model = make_model(cfg, source)
        apply(bf16_model, PrecisionConfig())
        gemm = modeled_gemm_seconds(bf16_model, batch, batch_size=cfg.batch_size,
                                    cost_batch_size=cfg.cost_batch_size, device=cfg.objective.cost_device,
                                    kind=cfg.objective.kind)
        f = cfg.objective.non_gemm_fraction
        remainder = gemm * f / (1.0 - f)
        return replace(baseline, speed_source="modeled", gemm_bf16_s=gemm, remainder_s=remainder,
                       step_time_s=gemm + remainder)
    if cfg.objective.kind == "inference":
        m = make_model(cfg, source).to(device)
        apply(m, PrecisionConfig())
        t = measure_forward_seconds(m, _first_batch(source, cfg, device), autocast=cfg.training.autocast)
        return replace(baseline, step_time_s=t)
    return baseline


def modeled_seconds(model: nn.Module, batch: Any, cfg: StudyConfig, baseline: Baseline) -> float:
    """Modeled step (or forward) seconds: GEMMs from the cost model + the baseline's non-GEMM remainder."""
    g = modeled_gemm_seconds(model, batch, batch_size=cfg.batch_size,
                             cost_batch_size=cfg.cost_batch_size, device=cfg.objective.cost_device,
                             kind=cfg.objective.kind)
    return g + baseline.remainder_s
