"""The study loop: a probe-pruned Optuna search for the fastest precision config under a loss budget.

One study, end to end (see ``docs/design.md``)::

    StudyConfig ──> baseline: bf16 short runs on 2-3 seeds (the noise floor of relative log loss)
                    + the Probe's online statistics during the first one
                ──> space: sites x roles x candidates, pruned by the ProbeReport (unsafe / slow)
                ──> enqueued: all-bf16, the Dispatch plan, all-FP8 at the fastest safe choices
                    (unless ``[trials] enqueue_starts = false``)
                ──> Optuna ask/tell (TPE with constraints, objective: step time)
                    trial -> PrecisionConfig -> fresh model (same init) -> apply -> paired short run
                          -> relative log loss vs the baseline, step time (measured or modeled)
                ──> answer: the fastest feasible trial (``best_trial`` / ``export_best``)

Scale-out: every worker runs :func:`run_study` on the same storage (``sqlite:///`` on one
machine, ``postgresql://`` across machines). The first one computes the baseline and the
space and stores them in the study's user attributes; the others (and every resume) reuse
them. Heartbeats mark a killed worker's trial failed and re-queue it; a configuration is
evaluated once (trials carry their config key; a repeated key copies the earlier result).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from loka_tune.config import BF16, ROLES, GemmChoice, GemmRole, PrecisionConfig
from loka_tune.errors import BackendError, ConfigError, LokaError, StudyError, UnsupportedChoiceError
from loka_tune.space.candidates import (
    BF16_ID,
    SearchSpace,
    SiteChoices,
    build_space,
    enumerate_candidates,
    prune_by_probe,
)
from loka_tune.space.encode import (
    config_from_params,
    distributions,
    mods_dims,
    params_from_config,
    params_picking,
)
from loka_tune.space.sites import Site, discover_sites
from loka_tune.study import StudyConfig

__all__ = [
    "Baseline",
    "TrialOutcome",
    "StudyContext",
    "HopelessPruner",
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
]

ATTR_BASELINE = "loka.baseline"  # study user attr: the Baseline JSON
ATTR_SPACE = "loka.space"  # study user attr: the SearchSpace JSON
ATTR_STUDY = "loka.study"  # study user attr: the StudyConfig summary
STATES_DONE = ("COMPLETE", "PRUNED", "FAIL")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# building blocks: data, model, trainer config


def import_function(spec: str, *, key: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function, with errors naming ``key`` and the fix."""
    mod_name, _, fn_name = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"cannot import module {mod_name!r} of {spec!r} ({e}); is it on PYTHONPATH?",
                          key=key) from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"module {mod_name!r} has no function {fn_name!r} (from {spec!r})", key=key)
    return fn


def make_source(cfg: StudyConfig) -> Any:
    """The study's data source (``[data]``)."""
    from loka_tune.data import parse_data_spec

    src = parse_data_spec(cfg.data.source, **dict(cfg.data.params))
    for attr in ("num_dense", "cardinalities", "batches"):
        if not hasattr(src, attr):
            raise ConfigError(f"the data source {cfg.data.source!r} has no {attr!r}: a data source has"
                              " num_dense, cardinalities and batches(split, batch_size, seed, device)",
                              key="data.source")
    return src


def make_model(cfg: StudyConfig, source: Any, *, seed: int | None = None) -> nn.Module:
    """A fresh model of the study, initialized under ``seed`` (default: the training seed)."""
    torch.manual_seed(cfg.training.seed if seed is None else seed)
    kw = dict(num_dense=int(source.num_dense), cardinalities=list(source.cardinalities))
    if cfg.model.is_function:
        fn = import_function(cfg.model.name, key="model.name")
        model = fn(**kw, **dict(cfg.model.overrides))
    else:
        from loka_tune.models import build_model

        try:
            model = build_model(cfg.model.name, cfg.model.preset, **kw, **dict(cfg.model.overrides))
        except ConfigError as e:
            raise ConfigError(str(e), key=f"model.overrides.{e.key}" if e.key not in (None, "model", "preset")
                              else "model.name") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{cfg.model.name!r} returned {type(model).__name__}, not an nn.Module", key="model.name")
    return model


def train_config(cfg: StudyConfig, seed: int | None = None, *, device: str | None = None) -> Any:
    """The trainer's :class:`TrainConfig` for one short run of the study."""
    return cfg.training.to_train_config(seed, device=device)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def speed_source(cfg: StudyConfig, device: str) -> str:
    """"measured" or "modeled": the study's ``objective.speed``, "auto" meaning measured on CUDA."""
    s = cfg.objective.speed
    if s == "auto":
        return "measured" if device.startswith("cuda") else "modeled"
    if s == "measured" and not device.startswith("cuda"):
        warnings.warn("objective.speed = 'measured' on a CPU times the emulated FP8 kernels, which says"
                      " nothing about a GPU; use 'modeled' (or 'auto') on a CPU", stacklevel=2)
    return s


def trial_model(cfg: StudyConfig, source: Any, config: PrecisionConfig, *,
                device: str = "cpu") -> tuple[nn.Module, Any]:
    """A fresh model (same init seed as the baseline) on ``device`` with ``config`` applied
    (on that device: GPU-only kernels accept only CUDA layers); returns it and the summary."""
    from loka_tune.applier import apply

    model = make_model(cfg, source).to(resolve_device(device))
    summary = apply(model, config)
    return model, summary


def _first_batch(source: Any, cfg: StudyConfig, device: str = "cpu", *, max_rows: int | None = None) -> Any:
    bs = cfg.training.batch_size if max_rows is None else min(max_rows, cfg.training.batch_size)
    return next(iter(source.batches("train", bs, seed=cfg.training.seed, device=device)))


# ---------------------------------------------------------------------------------------------
# speed: modeled (cost model) or measured


def _roles_for(kind: str) -> tuple[GemmRole, ...]:
    return (GemmRole.FWD,) if kind == "inference" else ROLES


def modeled_gemm_seconds(model: nn.Module, batch: Any, *, batch_size: int, cost_batch_size: int,
                         device: str, kind: str = "train_step") -> float:
    """Sum over the model's linear sites x roles of the cost model's seconds at ``cost_batch_size``.

    Each site's precision is the one actually applied (``LokaLinear.precision``; plain
    ``nn.Linear`` = bf16), its shape the one a forward pass on ``batch`` shows, with the rows
    scaled from ``batch_size`` to ``cost_batch_size``.
    """
    from loka_tune.kernels.costmodel import estimate_gemm_seconds
    from loka_tune.kernels.linear import find_linears

    lin = find_linears(model)
    sites = discover_sites(model, batch.dense, batch.sparse, linears=lin)
    total = 0.0
    for s in sites:
        prec = getattr(lin[s.name], "precision", None)
        for role in _roles_for(kind):
            choice = BF16 if prec is None else prec[role]
            m, k, n = s.shape(role, cost_batch_size)
            total += estimate_gemm_seconds(choice, m, k, n, role, device)
    return total


def modeled_seconds(model: nn.Module, batch: Any, cfg: StudyConfig, baseline: "Baseline") -> float:
    """Modeled step (or forward) seconds: GEMMs from the cost model + the baseline's non-GEMM remainder."""
    g = modeled_gemm_seconds(model, batch, batch_size=cfg.training.batch_size,
                             cost_batch_size=cfg.cost_batch_size, device=cfg.objective.cost_device,
                             kind=cfg.objective.kind)
    return g + baseline.remainder_s


@torch.no_grad()
def measure_forward_seconds(model: nn.Module, batch: Any, *, reps: int = 20, warmup: int = 5,
                            autocast: str = "auto") -> float:
    """Median seconds of ``model(dense, sparse)`` in eval mode (CUDA events on a GPU), under the
    trainer's autocast rule for ``autocast`` ("auto": bf16 on CUDA, fp32 on the CPU; pass the
    study's ``training.autocast``): the bf16 baseline is then timed in bf16, as it trains."""
    from loka_tune.objectives.trainer import _autocast, _autocast_dtype

    was = model.training
    model.eval()
    on_cuda = batch.dense.is_cuda
    dev = batch.dense.device
    times = []
    try:
        for i in range(warmup + reps):
            if on_cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                with _autocast(dev, _autocast_dtype(autocast, dev)):
                    model(batch.dense, batch.sparse)
                b.record()
                torch.cuda.synchronize()
                dt = a.elapsed_time(b) / 1e3
            else:
                t0 = time.perf_counter()
                with _autocast(dev, _autocast_dtype(autocast, dev)):
                    model(batch.dense, batch.sparse)
                dt = time.perf_counter() - t0
            if i >= warmup:
                times.append(dt)
    finally:
        model.train(was)
    return float(statistics.median(times))


# ---------------------------------------------------------------------------------------------
# the baseline


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
        from dataclasses import asdict

        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Baseline":
        d = dict(d)
        for k in ("seeds", "eval_logloss", "window_losses", "window_steps"):
            d[k] = tuple(d[k])
        return cls(**d)


def _train(model: nn.Module, source: Any, tcfg: Any, on_step: Any = None) -> Any:
    from loka_tune.objectives.trainer import train

    return train(model, source, tcfg, on_step=on_step, progress=False)


def run_baseline(cfg: StudyConfig, source: Any, device: str, *, force: bool = False,
                 probe_out: Path | None = None) -> tuple[Baseline, Any, nn.Module]:
    """bf16 short runs on every seed (the Probe watching the first); returns the baseline,
    the probe's statistics (or None) and the first seed's trained model."""
    from loka_tune.objectives.metrics import relative_log_loss

    bf16 = PrecisionConfig()
    results = []
    stats = None
    first_model: nn.Module | None = None
    for i, seed in enumerate(cfg.training.seeds):
        from loka_tune.applier import apply

        model = make_model(cfg, source, seed=seed)
        apply(model, bf16)
        tcfg = train_config(cfg, seed, device=device)
        t0 = time.perf_counter()
        if i == 0 and cfg.probe.enabled:
            from loka_tune.probe import Probe

            with Probe(model, every=cfg.probe.every) as probe:
                res = _train(model, source, tcfg)
            stats = probe.stats
            if probe_out is not None:
                stats.save(probe_out)
        else:
            res = _train(model, source, tcfg)
        if i == 0:
            first_model = model
        if res.status != "ok":
            raise StudyError(f"the bf16 baseline (seed {seed}) did not finish: status {res.status!r}"
                             f" (non-finite step {res.nonfinite_step}); lower training.lr_dense/lr_sparse")
        _log(f"[loka-tune] baseline seed {seed}: eval log loss {res.eval_logloss:.5f}, NE {res.eval_ne:.4f},"
             f" AUC {res.eval_auc:.4f} ({time.perf_counter() - t0:.1f}s)")
        results.append(res)
    lls = tuple(float(r.eval_logloss) for r in results)
    floor = max([abs(relative_log_loss(ll, lls[0])) * 100 for ll in lls[1:]], default=0.0)
    r0 = results[0]
    bl = Baseline(seeds=tuple(cfg.training.seeds), eval_logloss=lls, eval_ne=float(r0.eval_ne),
                  eval_auc=float(r0.eval_auc), window_losses=tuple(float(x) for x in r0.loss_curve),
                  window_steps=tuple(int(s) for s in r0.curve_steps), noise_floor_pct=float(floor),
                  step_time_s=float(r0.step_time_s), speed_source="measured",
                  measured_step_time_s=float(r0.step_time_s), device=str(r0.device))
    assert first_model is not None
    return bl, stats, first_model


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


# ---------------------------------------------------------------------------------------------
# the pruner


def _pruner_base() -> type:
    import optuna

    return optuna.pruners.BasePruner


class HopelessPruner:
    """Prune a trial whose latest windowed training loss is ``factor`` x the budget above the
    baseline's at the same step (the intermediate values are that relative gap, in percent).

    Built lazily as an :class:`optuna.pruners.BasePruner` through :func:`make_pruner`.
    """

    def __init__(self, threshold_pct: float, warmup_steps: int = 0) -> None:
        self.threshold_pct = float(threshold_pct)
        self.warmup_steps = int(warmup_steps)

    def prune(self, study: Any, trial: Any) -> bool:
        step = trial.last_step
        if step is None or step < self.warmup_steps:
            return False
        v = trial.intermediate_values[step]
        return not math.isfinite(v) or v > self.threshold_pct


def make_pruner(cfg: StudyConfig) -> Any:
    """The Optuna pruner of ``trials.pruner``."""
    import optuna

    if cfg.trials.pruner == "none":
        return optuna.pruners.NopPruner()
    if cfg.trials.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=cfg.trials.prune_warmup_steps)
    cls = type("HopelessPruner", (HopelessPruner, optuna.pruners.BasePruner), {})
    return cls(cfg.trials.hopeless_factor * cfg.objective.budget_pct, cfg.trials.prune_warmup_steps)


# ---------------------------------------------------------------------------------------------
# storage and study


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
    """The Optuna RDB storage with heartbeats; a dead worker's trial is failed and re-queued."""
    return _retry_db(lambda: _make_storage(cfg, url))


def _make_storage(cfg: StudyConfig, url: str | None = None) -> Any:
    import optuna

    url = url or cfg.storage.url
    engine_kwargs: dict[str, Any] = {}
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        engine_kwargs = {"connect_args": {"timeout": 60}}  # wait on a locked SQLite file
    else:
        engine_kwargs = {"pool_pre_ping": True}
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


def _has_set_constraint() -> bool:
    try:
        import optuna
    except ImportError:  # pragma: no cover
        return False
    return hasattr(optuna.trial.Trial, "set_constraint")


_HAS_SET_CONSTRAINT = _has_set_constraint()


def _set_constraint(trial: Any, rel_pct: float | None, budget: float) -> None:
    """Feasible when relative log loss - budget <= 0 (unknown: infeasible)."""
    if _HAS_SET_CONSTRAINT:
        v = 1e9 if rel_pct is None or not math.isfinite(rel_pct) else float(rel_pct) - float(budget)
        trial.set_constraint("rel_logloss_minus_budget_pct", v)


def _constraints(frozen: Any) -> Sequence[float]:
    budget = frozen.user_attrs.get("budget_pct")
    rel = frozen.user_attrs.get("rel_logloss_pct")
    if budget is None or rel is None or not math.isfinite(rel):
        return (1e9,)
    return (float(rel) - float(budget),)


def open_study(cfg: StudyConfig, storage: Any | None = None, *, study_name: str | None = None,
               worker_index: int = 0) -> Any:
    """Create or load the study (TPE with the loss constraint, the study's pruner)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = storage or make_storage(cfg)
    kw: dict[str, Any] = {}
    if not _HAS_SET_CONSTRAINT:  # optuna < 5: the sampler reads the constraint through constraints_func
        kw["constraints_func"] = _constraints
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(seed=cfg.study.seed + 7919 * worker_index, n_startup_trials=cfg.trials.n_startup_trials,
                                             multivariate=True, constant_liar=True, **kw)
    return _retry_db(lambda: optuna.create_study(storage=storage, study_name=study_name or cfg.name,
                                                 direction="minimize", sampler=sampler, pruner=make_pruner(cfg),
                                                 load_if_exists=True))


# ---------------------------------------------------------------------------------------------
# preparing a study: baseline, probe, space, enqueued trials


@dataclass
class StudyContext:
    """Everything a worker needs to evaluate trials of a prepared study."""

    cfg: StudyConfig
    study: Any
    source: Any
    baseline: Baseline
    space: SearchSpace
    device: str
    speed: str
    tracker: Any = None
    batch: Any = None  # one training batch on the CPU (site shapes for the cost model)


def no_fp8_reason(space: SearchSpace, cfg: StudyConfig) -> str:
    """Why a space has no FP8 candidate left: the counts of the drop reasons, and what to change."""
    from collections import Counter

    kinds: Counter[str] = Counter()
    for sc in space.sites:
        for why in (w for d in sc.dropped.values() for w in d.values()):
            kinds[why.split(":", 1)[0]] += 1
    parts = ", ".join(f"{n} {k}" for k, n in kinds.most_common()) or "no candidate at all"
    hint = []
    if kinds.get("slow"):
        hint.append(f"no FP8 choice is predicted faster than bf16 at these GEMM shapes (cost batch"
                    f" {cfg.cost_batch_size} rows, probe.min_speedup {cfg.probe.min_speedup}): FP8 pays off on"
                    " wide layers (>= 2048) and large batches; lower probe.min_speedup to explore anyway")
    if kinds.get("unsafe"):
        hint.append(f"some choices exceed probe.max_error {cfg.probe.max_error}")
    if not kinds or kinds.get("ineligible"):
        hint.append("layers narrower than space.min_dim or not aligned to space.align take no FP8")
    return (f"no FP8 candidate is left ({parts} site x GEMM x choice dropped): " + "; ".join(hint)
            + ". The search explores the Mods only.")


def _probe_report(cfg: StudyConfig, stats: Any, candidates: Mapping[str, list[GemmChoice]], device: str,
                  out: Path) -> Any:
    from loka_tune.probe import measure

    flat: list[GemmChoice] = []
    for cs in candidates.values():
        for c in cs:
            if c not in flat:
                flat.append(c)
    # speed at the batch the objective is priced at (cost_batch_size, default the training batch)
    scale = cfg.cost_batch_size / cfg.training.batch_size
    report = measure(stats, flat, samples=cfg.probe.samples, device=device, cost_device=cfg.objective.cost_device,
                     speed_row_scale=scale)
    report.save(out)
    return report


def _dispatch_plan(cfg: StudyConfig, report: Any) -> PrecisionConfig | None:
    try:
        from loka_tune.dispatch import build_plan
    except ImportError:  # Dispatch not installed in this checkout
        return None
    return build_plan(report, max_error=cfg.probe.max_error, min_speedup=max(cfg.probe.min_speedup, 1.0))


def _fastest_safe(sc: SiteChoices, role: str, choices: tuple[str, ...]) -> str:
    fp8 = [c for c in choices if c != BF16_ID]
    if not fp8:
        return BF16_ID
    roles = [r.value for r in ROLES] if role == "all" else [role]

    def score(c: str) -> float:
        sp = [sc.speedup.get(r, {}).get(c) for r in roles]
        sp = [s for s in sp if s is not None]
        return sum(sp) / len(sp) if sp else 1.0

    return max(fp8, key=score)


def prepare_study(cfg: StudyConfig, study: Any, *, device: str, force: bool = False,
                  tracker: Any = None) -> StudyContext:
    """Load the study's baseline and space, computing (and storing) them if this is the first worker."""
    source = make_source(cfg)
    speed = speed_source(cfg, device)
    batch = _first_batch(source, cfg, max_rows=64)  # shapes per example: a small CPU batch is enough
    attrs = study.user_attrs
    if ATTR_BASELINE in attrs and ATTR_SPACE in attrs:
        baseline = Baseline.from_dict(attrs[ATTR_BASELINE])
        space = SearchSpace.from_dict(attrs[ATTR_SPACE])
        _log(f"[loka-tune] study {cfg.name!r}: reusing its baseline (log loss {baseline.logloss:.5f}, noise floor"
             f" {baseline.noise_floor_pct:.3g}%) and space ({len(space.sites)} sites)")
        check_budget(cfg, baseline, force=force)
        return StudyContext(cfg, study, source, baseline, space, device, speed, tracker, batch)

    out = cfg.output_dir
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    prep = out / f".prepare-{os.getpid()}"  # private: two workers racing to prepare never share a file
    prep.mkdir(parents=True, exist_ok=True)
    baseline, stats, _model = run_baseline(cfg, source, device, force=force, probe_out=prep / "probe_stats.json")
    check_budget(cfg, baseline, force=force)

    # sites on a fresh (unapplied) model, candidates, eligibility
    fresh = make_model(cfg, source)
    sites = discover_sites(fresh, batch.dense, batch.sparse)
    candidates = enumerate_candidates(cfg.space.backends, cfg.space.formats, cfg.space.granularities,
                                      cfg.space.roundings, device=device)
    space = build_space(sites, candidates, batch_size=cfg.training.batch_size, align=cfg.space.align,
                        min_dim=cfg.space.min_dim, device=device, per_role=cfg.space.per_role,
                        mods=mods_dims(cfg.space.mods, blocknorm_sizes=cfg.space.blocknorm_sizes,
                                       pad_multiples=cfg.space.pad_multiples))

    # speed of the baseline in the objective's terms
    if speed == "modeled":
        from loka_tune.applier import apply

        bf16_model = make_model(cfg, source)
        apply(bf16_model, PrecisionConfig())
        gemm = modeled_gemm_seconds(bf16_model, batch, batch_size=cfg.training.batch_size,
                                    cost_batch_size=cfg.cost_batch_size, device=cfg.objective.cost_device,
                                    kind=cfg.objective.kind)
        f = cfg.objective.non_gemm_fraction
        remainder = gemm * f / (1.0 - f)
        baseline = replace(baseline, speed_source="modeled", gemm_bf16_s=gemm, remainder_s=remainder,
                           step_time_s=gemm + remainder)
    elif cfg.objective.kind == "inference":
        m = make_model(cfg, source).to(device)
        from loka_tune.applier import apply

        apply(m, PrecisionConfig())
        t = measure_forward_seconds(m, _first_batch(source, cfg, device), autocast=cfg.training.autocast)
        baseline = replace(baseline, step_time_s=t)

    # probe pruning
    report = None
    if stats is not None:
        report = _probe_report(cfg, stats, candidates, device, prep / "probe_report.json")
        speedup_fn = None
        if speed == "modeled":
            from loka_tune.kernels.costmodel import modeled_speedup

            def speedup_fn(site: Site, role: str, cid: str) -> float:
                m, k, n = site.shape(role, cfg.cost_batch_size)
                try:
                    return modeled_speedup(cid, m, k, n, role, cfg.objective.cost_device)
                except UnsupportedChoiceError:
                    return 0.0
        primary = report.select(report.primary_dist) if hasattr(report, "select") else report
        space = prune_by_probe(space, primary.results, max_error=cfg.probe.max_error,
                               min_speedup=cfg.probe.min_speedup, speedup=speedup_fn)
    n_fp8 = space.n_fp8_candidates()
    _log(f"[loka-tune] space: {len(space.sites)} sites, {n_fp8} FP8 candidates after pruning,"
         f" {len(distributions(space))} parameters ({time.perf_counter() - t0:.1f}s to prepare)")
    if n_fp8 == 0:
        _log("[loka-tune] " + no_fp8_reason(space, cfg))

    # store, unless another worker was faster (then use theirs: every worker must share one space)
    attrs = study.user_attrs
    if ATTR_BASELINE in attrs and ATTR_SPACE in attrs:
        import shutil

        shutil.rmtree(prep, ignore_errors=True)
        return prepare_study(cfg, study, device=device, force=force, tracker=tracker)
    for f in prep.iterdir():  # publish the probe files
        os.replace(f, out / f.name)
    prep.rmdir()
    study.set_user_attr(ATTR_SPACE, space.to_dict())
    study.set_user_attr(ATTR_STUDY, cfg.to_dict())
    study.set_user_attr(ATTR_BASELINE, baseline.to_dict())
    ctx = StudyContext(cfg, study, source, baseline, space, device, speed, tracker, batch)

    # the first trials (unless [trials] enqueue_starts = false: then the sampler picks every trial)
    seeds: list[tuple[str, dict[str, Any]]] = []
    if cfg.trials.enqueue_starts:
        seeds.append(("all-bf16", params_picking(space, lambda sc, r, ch: BF16_ID)))
        if report is not None:
            plan = _dispatch_plan(cfg, report)
            if plan is not None:
                p, notes = params_from_config(space, plan)
                seeds.append(("dispatch", p))
        seeds.append(("all-fp8-fastest-safe", params_picking(space, _fastest_safe)))
    for label, params in seeds:
        study.enqueue_trial(params, user_attrs={"seeded": label}, skip_if_exists=True)
    if tracker is not None:
        tracker.log_baseline(baseline, space, out / "probe_report.json" if report is not None else None)
    return ctx


# ---------------------------------------------------------------------------------------------
# one trial


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
    reason: str = ""
    steps_run: int = 0
    wall_s: float = 0.0

    def feasible(self, budget_pct: float) -> bool:
        return self.status == "ok" and math.isfinite(self.rel_logloss_pct) and self.rel_logloss_pct <= budget_pct

    def attrs(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


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
    try:
        model, _summary = trial_model(cfg, ctx.source, config, device=ctx.device)
    except (UnsupportedChoiceError, BackendError) as e:
        return TrialOutcome("failed", reason=f"unsupported: {e}", wall_s=time.perf_counter() - t0)
    modeled = None
    if ctx.speed == "modeled":
        batch = ctx.batch if resolve_device(ctx.device) == "cpu" else _first_batch(ctx.source, cfg, ctx.device, max_rows=64)
        modeled = modeled_seconds(model, batch, cfg, bl)
    base_curve = dict(zip(bl.window_steps, bl.window_losses))

    def on_step(step: int, window_loss: float) -> bool:
        base = base_curve.get(step)
        if base is None or report is None:
            return False
        rel = (window_loss - base) / base * 100.0 if math.isfinite(window_loss) else math.inf
        return bool(report(step, rel))

    try:
        res = _train(model, ctx.source, train_config(cfg, device=ctx.device), on_step=on_step)
    except (UnsupportedChoiceError, BackendError) as e:
        return TrialOutcome("failed", reason=f"unsupported: {e}", wall_s=time.perf_counter() - t0)
    except torch.cuda.OutOfMemoryError as e:  # a config may need more memory (e.g. fp32 copies)
        del model
        torch.cuda.empty_cache()
        return TrialOutcome("failed", reason=f"out of memory: {str(e).splitlines()[0]}",
                            wall_s=time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    if res.status == "nonfinite":
        return TrialOutcome("failed", reason=f"non-finite loss at step {res.nonfinite_step}",
                            steps_run=res.steps_run, wall_s=wall)
    if res.status == "pruned":
        last = res.loss_curve[-1] if res.loss_curve else math.nan
        base = base_curve.get(res.curve_steps[-1]) if res.curve_steps else None
        rel = (last - base) / base * 100 if base else math.nan
        return TrialOutcome("pruned", rel_logloss_pct=rel, steps_run=res.steps_run, wall_s=wall,
                            reason="windowed loss hopeless vs the baseline")
    if modeled is not None:
        t = modeled
    elif cfg.objective.kind == "inference":
        t = measure_forward_seconds(model, _first_batch(ctx.source, cfg, ctx.device), autocast=cfg.training.autocast)
    else:
        t = float(res.step_time_s)
    rel = relative_log_loss(res.eval_logloss, bl.logloss) * 100.0
    return TrialOutcome("ok", rel_logloss_pct=float(rel), step_time_s=float(t), speedup=float(bl.step_time_s / t),
                        eval_logloss=float(res.eval_logloss), eval_ne=float(res.eval_ne),
                        eval_auc=float(res.eval_auc), measured_step_time_s=float(res.step_time_s),
                        steps_run=res.steps_run, wall_s=wall)


# ---------------------------------------------------------------------------------------------
# the worker loop


class _Heartbeat:
    """Records the trial's heartbeat every ``interval`` seconds while a trial runs."""

    def __init__(self, storage: Any, trial_id: int, interval: float) -> None:
        self.storage, self.trial_id, self.interval = storage, trial_id, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            try:
                self.storage.record_heartbeat(self.trial_id)
            except Exception:  # a transient DB error must not kill the trial; the next beat retries
                pass
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> "_Heartbeat":
        if hasattr(self.storage, "record_heartbeat") and self.storage.get_heartbeat_interval():
            try:  # synchronously first: from here on a killed worker leaves a stale trial
                self.storage.record_heartbeat(self.trial_id)
            except Exception:  # noqa: BLE001 - the thread retries
                pass
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def _fail_stale(study: Any, grace_s: float | None = None) -> None:
    """Fail (and re-queue) the trials of dead workers.

    Optuna fails RUNNING trials whose heartbeat is older than the grace period. A worker killed
    between asking a trial and its first heartbeat leaves a RUNNING trial with no heartbeat at
    all, which Optuna never calls stale: such an orphan (no ``worker`` attribute, which is set
    right after the first heartbeat, and started more than ``grace_s`` ago) is failed here and
    its parameters are enqueued again, so no worker waits for it forever.
    """
    import datetime

    import optuna
    from optuna.trial import TrialState

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    if grace_s is None:
        return
    now = datetime.datetime.now()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if "worker" in t.user_attrs or t.datetime_start is None:
            continue
        if (now - t.datetime_start).total_seconds() <= grace_s:
            continue
        storage = study._storage
        try:
            if not storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:  # another worker failed it first
            continue
        get_cb = getattr(storage, "get_heartbeat_stale_trial_callback", None)  # as Optuna's stale check
        callback = get_cb() if get_cb is not None else None
        if callback is not None:
            callback(study, storage.get_trial(t._trial_id))
        else:
            study.enqueue_trial(t.params)
        _log(f"trial {t.number}: its worker died before its first heartbeat; failed and re-queued")


def _n_counted(trials: Iterable[Any]) -> tuple[int, int]:
    """(finished trials that count toward n_trials, running trials)."""
    from optuna.trial import TrialState

    done = running = 0
    for t in trials:
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
            done += 1
        elif t.state == TrialState.FAIL and "fail_reason" in t.user_attrs:
            done += 1  # failed by its config (stale trials of dead workers are re-queued, not counted)
        elif t.state == TrialState.RUNNING:
            running += 1
    return done, running


def _find_duplicate(study: Any, key: str, number: int) -> Any:
    """An earlier trial with the same config key: finished (copy it) or running (wait for it)."""
    from optuna.trial import TrialState

    best = None
    for t in study.get_trials(deepcopy=False):
        if t.number == number or t.user_attrs.get("config_key") != key:
            continue
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED) or (
                t.state == TrialState.FAIL and "fail_reason" in t.user_attrs):
            if not t.user_attrs.get("cache_hit"):
                return t
            best = best or t
        elif t.state == TrialState.RUNNING and t.number < number and best is None:
            best = t
    return best


def _wait_for(study: Any, trial_number: int, key: str, poll_s: float, limit_s: float,
              grace_s: float | None = None) -> Any:
    """Poll until the running trial ``trial_number`` finishes; its frozen trial, or None (it died)."""
    from optuna.trial import TrialState

    t_end = time.time() + limit_s
    while time.time() < t_end:
        _fail_stale(study, grace_s=grace_s)
        t = study.get_trials(deepcopy=False)[trial_number]
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
            return t
        if t.state == TrialState.FAIL:
            return t if "fail_reason" in t.user_attrs else None
        time.sleep(poll_s)
    return None


def _best(study: Any) -> Any:
    return best_trial(study, raise_if_none=False)


def _progress_line(ctx: StudyContext, number: int, n_total: int | None, frozen_attrs: Mapping[str, Any],
                   state: str) -> str:
    done = [t for t in ctx.study.get_trials(deepcopy=False) if t.state.name in STATES_DONE]
    feasible = sum(1 for t in done if t.user_attrs.get("feasible"))
    b = _best(ctx.study)
    best_s = f"{b.user_attrs['speedup']:.3f}x" if b is not None else "-"
    rel = frozen_attrs.get("rel_logloss_pct")
    sp = frozen_attrs.get("speedup")
    tag = " (cache)" if frozen_attrs.get("cache_hit") else ""
    what = (f"rel.LL {rel:+.4f}%  speed-up {sp:.3f}x" if state == "COMPLETE" and rel is not None and sp is not None
            else f"{state.lower()}: {frozen_attrs.get('fail_reason') or frozen_attrs.get('reason') or ''}")
    nn_ = f"/{n_total}" if n_total else ""
    return (f"[loka-tune] trial {number + 1}{nn_}  {what}{tag}  | best {best_s} ({ctx.speed})"
            f"  feasible {feasible}/{len(done)}")


def run_study(cfg: StudyConfig, *, device: str | None = None, storage_url: str | None = None,
              n_trials: int | None = None, timeout_s: float | None = None, force: bool = False,
              tracking: bool | None = None, worker_id: str | None = None, worker_index: int = 0,
              progress: bool = True) -> Any:
    """Run (or join, or resume) the study: prepare it, then ask/evaluate/tell until the trial
    budget is spent. Returns the Optuna study. Safe to run in several processes at once."""
    import optuna
    from optuna.trial import TrialState

    dev = resolve_device(device or cfg.training.device)
    storage = make_storage(cfg, storage_url)
    study = open_study(cfg, storage, worker_index=worker_index)
    n_total = n_trials if n_trials is not None else cfg.trials.n_trials
    timeout = timeout_s if timeout_s is not None else cfg.trials.timeout_s
    tracker = None
    if tracking is not False and cfg.tracking.enabled is not False:
        from loka_tune.tracking import Tracker

        tracker = Tracker.for_study(cfg, study, required=(cfg.tracking.enabled is True or tracking is True))
    ctx = prepare_study(cfg, study, device=dev, force=force, tracker=tracker)
    dists = distributions(ctx.space)
    budget = cfg.objective.budget_pct
    t_start = time.time()
    worker = worker_id or f"{platform.node()}:{os.getpid()}"
    while True:
        if timeout is not None and time.time() - t_start > timeout:
            break
        _fail_stale(study, grace_s=cfg.storage.grace_s)
        done, running = _n_counted(study.get_trials(deepcopy=False))
        if n_total is not None and done + running >= n_total:
            if done >= n_total:
                break
            # others are finishing the last trials; a dead one's trial will be re-queued
            time.sleep(min(cfg.storage.heartbeat_s, 2.0))
            continue
        with warnings.catch_warnings():  # heartbeats are recorded by _Heartbeat below, not by optimize()
            warnings.filterwarnings("ignore", message="Heartbeat of storage")
            trial = study.ask(fixed_distributions=dists)
        hb = _Heartbeat(storage, trial._trial_id, cfg.storage.heartbeat_s)
        hb.__enter__()  # the first beat is recorded before this returns (see _fail_stale for the gap)
        try:
            state, frozen_attrs, params, config = _one_trial(ctx, study, trial, worker, budget)
        except optuna.exceptions.UpdateFinishedTrialError:
            # another worker saw this trial's heartbeat go stale (this process was stalled for
            # longer than [storage] grace_s), failed it and re-queued its configuration: drop
            # our copy and go on with the next trial.
            _log(f"trial {trial.number}: taken over by another worker after a stale heartbeat"
                 f" (raise [storage] grace_s above {cfg.storage.grace_s}s if this machine stalls); skipped")
            continue
        finally:
            hb.__exit__(None, None, None)
        if tracker is not None:
            tracker.log_trial(trial.number, params, config, frozen_attrs, state, ctx)
        if progress:
            _log(_progress_line(ctx, trial.number, n_total, frozen_attrs, state))
    if tracker is not None:
        tracker.finish(ctx)
    return study


def _one_trial(ctx: StudyContext, study: Any, trial: Any, worker: str, budget: float) -> tuple:
    """Evaluate (or copy from the cache) one asked trial and tell the study."""
    from optuna.trial import TrialState

    cfg = ctx.cfg
    params = dict(trial.params)
    config = config_from_params(ctx.space, params)
    key = config.key()
    trial.set_user_attr("config_key", key)
    trial.set_user_attr("config", json.loads(config.to_json()))
    trial.set_user_attr("budget_pct", budget)
    trial.set_user_attr("worker", worker)
    trial.set_user_attr("speed_source", ctx.speed)
    frozen_attrs: dict[str, Any]
    dup = _find_duplicate(study, key, trial.number)
    if dup is not None and dup.state == TrialState.RUNNING:
        dup = _wait_for(study, dup.number, key, poll_s=1.0, limit_s=max(60.0, 4 * cfg.storage.grace_s + 600),
                        grace_s=cfg.storage.grace_s)
    if dup is not None:
        attrs = {k: v for k, v in dup.user_attrs.items()
                 if k not in ("config", "config_key", "worker", "seeded", "cache_hit", "cached_from")}
        attrs.update(cache_hit=True, cached_from=dup.number)
        for k, v in attrs.items():
            trial.set_user_attr(k, v)
        _set_constraint(trial, attrs.get("rel_logloss_pct"), budget)
        if dup.state == TrialState.COMPLETE:
            study.tell(trial, dup.value)
        else:
            study.tell(trial, state=dup.state)
        frozen_attrs = attrs
        state = dup.state.name
        outcome = None
    else:
        def report(step: int, rel: float) -> bool:
            trial.report(rel if math.isfinite(rel) else 1e9, step)
            return trial.should_prune()

        outcome = evaluate_config(ctx, config, report=report)
        attrs = outcome.attrs()
        attrs["feasible"] = outcome.feasible(budget)
        attrs["cache_hit"] = False
        if outcome.status == "failed":
            attrs["fail_reason"] = outcome.reason
        for k, v in attrs.items():
            trial.set_user_attr(k, v)
        _set_constraint(trial, attrs.get("rel_logloss_pct"), budget)
        if outcome.status == "ok":
            study.tell(trial, outcome.step_time_s)
            state = "COMPLETE"
        elif outcome.status == "pruned":
            study.tell(trial, state=TrialState.PRUNED)
            state = "PRUNED"
        else:
            study.tell(trial, state=TrialState.FAIL)
            state = "FAIL"
        frozen_attrs = attrs
    return state, frozen_attrs, params, config


# ---------------------------------------------------------------------------------------------
# answers: best trial, leaderboard, export


def best_trial(study: Any, *, raise_if_none: bool = True) -> Any:
    """The fastest feasible completed trial (the study's answer)."""
    from optuna.trial import TrialState

    ok = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
          if t.user_attrs.get("feasible") and t.value is not None]
    if not ok:
        if raise_if_none:
            raise StudyError(f"study {study.study_name!r} has no feasible trial yet: run more trials, raise"
                             " objective.budget_pct, or look at `loka-tune report` for the closest ones")
        return None
    # ties (same modeled time) go to the lower relative log loss, then the earlier trial
    return min(ok, key=lambda t: (t.value, t.user_attrs.get("rel_logloss_pct") or 0.0, t.number))


def leaderboard(study: Any, *, limit: int | None = None) -> list[dict[str, Any]]:
    """Finished trials, feasible ones first by step time, then the rest by relative log loss."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        if t.state.name not in STATES_DONE:
            continue
        a = t.user_attrs
        cfgd = a.get("config") or {}
        n_fp8 = sum(1 for s in (cfgd.get("sites") or {}).values() for v in s.values() if not v.startswith("bf16"))
        rows.append({"trial": t.number, "state": t.state.name, "feasible": bool(a.get("feasible")),
                     "step_time_s": t.value, "speedup": a.get("speedup"), "rel_logloss_pct": a.get("rel_logloss_pct"),
                     "eval_ne": a.get("eval_ne"), "eval_auc": a.get("eval_auc"), "cache_hit": bool(a.get("cache_hit")),
                     "fp8_gemms": n_fp8, "mods": (cfgd.get("mods") and _mods_str(cfgd["mods"])) or "none",
                     "reason": a.get("fail_reason") or "", "seeded": a.get("seeded", ""),
                     "cached_from": a.get("cached_from")})

    def order(r: dict[str, Any]) -> tuple:
        if r["feasible"]:
            return (0, r["step_time_s"])
        rel = r["rel_logloss_pct"]
        return (1 if r["state"] == "COMPLETE" else 2, rel if rel is not None else math.inf)

    rows.sort(key=order)
    return rows[:limit] if limit else rows


def _mods_str(d: Mapping[str, Any]) -> str:
    from loka_tune.config import ModsConfig

    try:
        return ModsConfig.from_dict(d).short_str()
    except LokaError:
        return "?"


def study_summary(study: Any) -> dict[str, Any]:
    attrs = study.user_attrs
    return {"baseline": attrs.get(ATTR_BASELINE), "study": attrs.get(ATTR_STUDY)}


def export_best(study: Any, out: str | Path | None = None) -> PrecisionConfig:
    """The best feasible trial's PrecisionConfig with its provenance (written to ``out`` if given)."""
    import optuna

    t = best_trial(study)
    a = t.user_attrs
    config = PrecisionConfig.from_dict(a["config"])
    bl = study.user_attrs.get(ATTR_BASELINE) or {}
    st = study.user_attrs.get(ATTR_STUDY) or {}
    from loka_tune import __version__

    prov = {
        "study": study.study_name,
        "trial": t.number,
        "step_time_s": t.value,
        "speedup": a.get("speedup"),
        "speed_source": a.get("speed_source"),
        "rel_logloss_pct": a.get("rel_logloss_pct"),
        "budget_pct": a.get("budget_pct"),
        "eval_logloss": a.get("eval_logloss"),
        "eval_ne": a.get("eval_ne"),
        "eval_auc": a.get("eval_auc"),
        "baseline_logloss": (bl.get("eval_logloss") or [None])[0],
        "baseline_step_time_s": bl.get("step_time_s"),
        "noise_floor_pct": bl.get("noise_floor_pct"),
        "device": bl.get("device"),
        "cost_device": (st.get("objective") or {}).get("cost_device"),
        "cost_batch_size": (st.get("objective") or {}).get("cost_batch_size") or (st.get("training") or {}).get("batch_size"),
        "model": st.get("model"),
        "data": (st.get("data") or {}).get("source"),
        "objective": (st.get("objective") or {}).get("kind"),
        "versions": {"loka_tune": __version__, "torch": torch.__version__, "optuna": optuna.__version__,
                     "python": platform.python_version()},
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    config = config.with_provenance(**prov)
    if out is not None:
        config.save(out)
    return config
