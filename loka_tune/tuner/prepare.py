"""Preparing a study: the baseline, the probe, the search space it prunes, the recipe space priced on
top of it (the default; ``[space] per_gemm = true``: the per-GEMM space), the first enqueued starts
(bf16 under each Mods set; the recipes wait for them: :mod:`loka_tune.tuner.starts`).

The first worker computes them and stores the baseline and the space in the study's user
attributes; every other worker (and every resume) loads them, so all share one space. Two
workers racing to prepare each work in a private folder; the loser drops its result and loads
the winner's.

Files in the study's output dir: ``probe_report.json`` (per site x GEMM x candidate error and
speed: what the pruning, ``report`` and MLflow read; tens of KB). The probe's raw statistics are
not kept (``loka-tune probe --out DIR`` writes them, ``probe_stats.npz``, when wanted).
``baseline_runs.json`` while a preparation has its baseline runs and probe measurement but has not
stored them (:mod:`loka_tune.tuner.baseline_runs`: the next preparation reuses them).

Pricing (:func:`_site_prices`, recipe space only): per site and candidate recipe value, the seconds
per training step it saves against the site in bf16. Modeled (a CPU study): the cost model's
three GEMMs (fwd only for the inference objective) at ``cost_batch_size``, as the trials' modeled
step times are. Measured (a GPU study): ``loka_tune.kernels.site_timing.price_sites`` times each
site's fwd + dgrad + wgrad compiled at the batch the trials train at, on the study's device.
The prices are stored with the space (:attr:`SiteChoices.prices`, :attr:`SearchSpace.price_source`).
"""

from __future__ import annotations

import os
import shutil
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loka_tune.config import GemmChoice
from loka_tune.data.base import model_inputs
from loka_tune.errors import StudyError, UnsupportedChoiceError
from loka_tune.recipes import SIZE_FILTERS
from loka_tune.space.candidates import SearchSpace, build_space, enumerate_candidates, prune_by_probe
from loka_tune.space.encode import distributions, mods_dims
from loka_tune.space.recipe_space import recipe_candidates, select_recipes
from loka_tune.space.sites import Site, discover_sites
from loka_tune.tuner.baseline import Baseline, check_budget, price_baseline, run_baseline
from loka_tune.tuner.baseline_runs import Reused, drop_runs, load_runs, runs_file, save_runs
from loka_tune.tuner.build import first_batch, make_model, make_source, speed_source
from loka_tune.tuner.log import log
from loka_tune.tuner.optuna_setup import ATTR_SETTINGS, check_settings
from loka_tune.tuner.results import (
    ATTR_BASELINE,
    ATTR_PREPARE_PHASES,
    ATTR_PREPARE_REUSED,
    ATTR_PREPARE_S,
    ATTR_SPACE,
    ATTR_STUDY,
)
from loka_tune.tuner.starts import enqueue_mods_starts, recipe_starts
from loka_tune.tuner.study import StudyConfig

__all__ = ["StudyContext", "prepare_study", "no_fp8_reason"]

ATTR_PREPARE_FAILED = "loka.prepare_failed"  # study user attr: why the last preparation did not finish


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
    references: dict[str, float] = field(default_factory=dict)  # bf16 + Mods seconds (trial.reference_seconds)


def no_fp8_reason(space: SearchSpace, cfg: StudyConfig) -> str:
    """Why a space has no FP8 candidate left: the counts of the drop reasons, and what to change."""
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
    scale = cfg.cost_batch_size / cfg.batch_size
    t0 = time.perf_counter()
    log(f"[loka-tune] probe: measuring {len(flat)} candidates x {len(stats.sites)} sites x 3 GEMMs"
         f" ({cfg.probe.samples} draws each, {stats.collections} collections) ...")
    # the saved verdicts are the study's: its max_error and min_speedup; price_first: error only
    # for the candidates priced fast enough (the others: report.skipped)
    # skip_bad_sites: a site whose statistics cannot be formed is unprobed (keeps every candidate)
    report = measure(stats, flat, samples=cfg.probe.samples, device=device, cost_device=cfg.objective.cost_device,
                     speed_row_scale=scale, max_error=cfg.probe.max_error, min_speedup=cfg.probe.min_speedup,
                     price_first=cfg.probe.price_first and _gemm_speed_prunes(cfg, speed_source(cfg, device)),
                     skip_bad_sites=True)
    report.save(out)
    log(f"[loka-tune] probe: {len(report.results)} results ({time.perf_counter() - t0:.1f}s{_measure_note(report.meta)})")
    log(f"[loka-tune] probe sites: {report.status_line()}")
    return report


def _measure_note(meta: Mapping[str, Any]) -> str:
    """Where the probe's measurement went, for its log line: ``": replay 1.2s, draws 3.4s, GEMMs 5.6s;
    slowest sites head_mlp.0 2.1s, ..."`` (``""`` without the report's timers)."""
    ph, per_site = meta.get("phases_s") or {}, meta.get("site_s") or {}
    if not ph:
        return ""
    names = {"replay": "replay factors", "draws": "draws", "gemms": "GEMMs and errors"}
    note = ": " + ", ".join(f"{names.get(k, k)} {float(v):.1f}s" for k, v in ph.items())
    top = sorted(per_site.items(), key=lambda kv: -float(kv[1]))[:3]
    if top:
        note += "; slowest sites " + ", ".join(f"{k} {float(v):.1f}s" for k, v in top)
    return note


def _gemm_speed_prunes(cfg: StudyConfig, speed: str) -> bool:
    """Whether a GEMM's own (cost-model) speed prunes it: always, except in a measured recipe space,
    where each site's recipes are timed whole and compiled at preparation (``_site_prices``) and
    a per-GEMM price calibrated on eager kernels would drop GEMMs that pay inside a compiled layer
    (on the H200 the per-GEMM model under-prices tensorwise on 8192 x 2048 x 8192 by 40%)."""
    return cfg.space.per_gemm or speed != "measured"


def _prune(cfg: StudyConfig, space: SearchSpace, report: Any, speed: str) -> SearchSpace:
    """The space without the candidates the probe calls unsafe or slow (modeled speed: the cost
    model's; no speed rule where :func:`_gemm_speed_prunes` says the site prices decide)."""
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
    return prune_by_probe(space, primary.results, max_error=cfg.probe.max_error,
                          min_speedup=cfg.probe.min_speedup if _gemm_speed_prunes(cfg, speed) else 0.0,
                          speedup=speedup_fn,
                          skipped=getattr(report, "skipped", ()), unprobed=getattr(report, "unprobed", ()))


def _site_prices(cfg: StudyConfig, space: SearchSpace, device: str,
                 counts: dict[str, int] | None = None) -> dict[str, dict[str, float]]:
    """Seconds per training step each recipe value of ``space`` saves against its site in bf16
    (positive: faster), per site name and value; a value that cannot be priced is left out.

    Modeled (``objective.speed`` resolves to "modeled"): the cost model at ``cost_batch_size``,
    ``t_bf16 - t_value`` of the layer's three GEMMs in its compiled mode
    (:func:`~loka_tune.kernels.costmodel.estimate_site_seconds` ``compiled=True``: an operand two
    GEMMs share tensorwise is quantized once, as compiled steps do, calibrated on the H200's
    compiled site prices), or of the forward GEMM alone for "inference". Measured: ``loka_tune.kernels.site_timing.price_sites`` with each
    site's (M, K, N) at the batch one process trains at (``[regime] batch_size`` else
    ``[training]``'s, split over ``[regime] nproc``) on ``device``; each cell timed (not found in
    the cache) and each that failed is logged, and ``counts`` (when given) gets price_sites' tally.
    """
    precs = {sc.name: [v for v in sc.values if v != "bf16"] for sc in space.sites}
    precs = {k: v for k, v in precs.items() if v}  # only what the space can choose
    if not precs:
        return {}
    if speed_source(cfg, device) == "measured":
        from loka_tune.kernels.site_timing import price_sites

        rows = cfg.batch_size // cfg.regime.nproc
        shapes = {sc.name: (sc.site.rows(rows), sc.site.in_features, sc.site.out_features)
                  for sc in space.sites if sc.name in precs}
        got = price_sites(shapes, precs, device=device, counts=counts,
                          progress=lambda msg: log(f"[loka-tune]   {msg}"))
        return {s: {v: float(x) for v, x in d.items()} for s, d in got.items()}
    from loka_tune.config import ROLES, SitePrecision
    from loka_tune.kernels.costmodel import estimate_gemm_seconds, estimate_site_seconds

    dev = cfg.objective.cost_device
    out: dict[str, dict[str, float]] = {}
    for sc in space.sites:
        M, K, N = sc.site.rows(cfg.cost_batch_size), sc.site.in_features, sc.site.out_features
        for v in precs.get(sc.name, ()):
            prec = SitePrecision.parse(v)
            try:
                if cfg.objective.kind == "inference":  # the forward GEMM alone
                    m, k, n = ROLES[0].shape(M, K, N)
                    saved = (estimate_gemm_seconds(GemmChoice.bf16(), m, k, n, ROLES[0], dev)
                             - estimate_gemm_seconds(prec.fwd, m, k, n, ROLES[0], dev))
                else:  # the layer as a compiled step runs it (shared tensorwise operands quantized once)
                    saved = (sum(estimate_site_seconds("bf16", M, K, N, dev).values())
                             - sum(estimate_site_seconds(prec, M, K, N, dev, compiled=True).values()))
            except UnsupportedChoiceError:
                continue
            out.setdefault(sc.name, {})[v] = saved
    return out


def _recipe_space(cfg: StudyConfig, space: SearchSpace, report: Any, device: str) -> SearchSpace:
    """The recipe space on the pruned per-GEMM ``space``: candidates, their prices, the selection."""
    plan = None
    if report is not None:
        from loka_tune.dispatch import build_plan

        # the space's own choice ids (emulated on a CPU): each GEMM's fastest safe choice
        plan = build_plan(report, max_error=cfg.probe.max_error, min_speedup=max(cfg.probe.min_speedup, 1.0),
                          resolve_emulated=False)
    cands = recipe_candidates(space, cfg.space.backends, plan)
    t0 = time.perf_counter()
    counts: dict[str, int] = {}
    prices = _site_prices(cfg, cands, device, counts)
    source = speed_source(cfg, device)
    cells = (f" {counts['timed']} cell(s) timed, {counts['cached']} from the cache"
             + (f", {counts['failed']} failed" if counts["failed"] else "") + ";") if counts else ""
    log(f"[loka-tune] prices: {sum(len(d) for d in prices.values())} site recipes priced ({source},{cells}"
         f" {time.perf_counter() - t0:.1f}s)")
    # the recipe starts are their whole recipes: on every filter site, also where it prices slow alone
    keep = SIZE_FILTERS if cfg.trials.enqueue_starts else None
    return select_recipes(cands, prices, source=source, keep_slow=cfg.probe.min_speedup < 1.0, keep=keep)


def _enqueue_starts(cfg: StudyConfig, study: Any, space: SearchSpace, report: Any) -> None:
    """The first trials (unless ``[trials] enqueue_starts = false``: then the sampler picks every
    trial): bf16 under each Mods set now, the named recipes under the best of them once those
    have run (:mod:`loka_tune.tuner.starts`)."""
    if not cfg.trials.enqueue_starts:
        return
    recipes = recipe_starts(space, cfg.space.backends, report, max_error=cfg.probe.max_error,
                            min_speedup=max(cfg.probe.min_speedup, 1.0))
    enqueue_mods_starts(study, space, recipes)


def _loaded(cfg: StudyConfig, study: Any, *, force: bool) -> tuple[Baseline, SearchSpace]:
    attrs = study.user_attrs
    baseline = Baseline.from_dict(attrs[ATTR_BASELINE])
    space = SearchSpace.from_dict(attrs[ATTR_SPACE])
    log(f"[loka-tune] study {cfg.name!r}: reusing its baseline (log loss {baseline.logloss:.5f}, noise floor"
         f" {baseline.noise_floor_pct:.3g}%) and space ({len(space.sites)} sites)")
    check_budget(cfg, baseline, force=force)
    return baseline, space


def _prepared(study: Any) -> bool:
    return ATTR_BASELINE in study.user_attrs and ATTR_SPACE in study.user_attrs


def prepare_study(cfg: StudyConfig, study: Any, *, device: str, force: bool = False,
                  tracker: Any = None, on_change: str = "stop") -> StudyContext:
    """Load the study's baseline and space, computing (and storing) them if this is the first worker.

    The baseline, the space and the settings they were made with (``loka.settings``, which later
    runs are checked against) are stored together at the end, so a preparation that fails or is
    interrupted (even by ``kill -9``) leaves nothing that binds the next run: after a fix of the
    study file, ``tune`` simply prepares again. Its reason is kept for ``loka-tune report``
    (``loka.prepare_failed``) and its private ``.prepare-<pid>/`` folder removed; no MLflow study run
    was started (``tracker`` attaches the study's run once it is prepared, with its settings).
    ``on_change``: as :func:`~loka_tune.tuner.optuna_setup.open_study`'s, for a study another
    worker prepared meanwhile."""
    try:
        return _prepare(cfg, study, device=device, force=force, tracker=tracker, on_change=on_change)
    except BaseException as e:
        shutil.rmtree(_private_dir(cfg), ignore_errors=True)
        if not _prepared(study):  # for `loka-tune report`: why there is nothing to show
            why = "interrupted" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
            try:
                study.set_user_attr(ATTR_PREPARE_FAILED, why[:2000])
            except Exception:  # noqa: BLE001 - the storage itself may be what failed
                pass
        raise


def beside_twin(device: str) -> bool:
    """Whether the probe's read-back and measurement run beside the noise twin (in a thread) on
    ``device``: on a GPU, where the twin's compiled steps keep the GPU busy and the host mostly
    waiting (large Wukong at B = 8192 on the H200: a 9.9 s twin, 8.6 s of read-back and
    measurement); not on a CPU, where both would share its cores."""
    return torch.device(device).type == "cuda"


def _private_dir(cfg: StudyConfig) -> Path:
    """This process's preparation folder: two workers racing to prepare never share a file."""
    return cfg.output_dir / f".prepare-{os.getpid()}"


def _baselines(cfg: StudyConfig, source: Any, device: str, *, force: bool, curves: dict[int, Any],
               reports: list[Any], measure: Any, prep: Path, t0: float) -> tuple[Baseline, Any, Reused | None]:
    """The bf16 baseline runs (:func:`run_baseline`; ``measure``: the probe's measurement beside the
    twin, its report appended to ``reports``; each run's losses into ``curves``), kept once they and
    the measurement are done; or the runs a preparation that did not finish kept (:func:`load_runs`).
    Checked against the budget. Returns the baseline, the probe's statistics (None when reused or
    already measured beside) and what was reused."""
    reused, why = load_runs(cfg, device)  # the runs of an earlier preparation that did not finish
    if why:
        log(f"[loka-tune] {why}")
    stats = None
    if reused is not None:
        baseline = reused.baseline
        curves.update(reused.curves)
        if reused.report is not None:
            reports.append(reused.report)
            reused.report.save(prep / "probe_report.json")  # published with the space, as a measured one is
        log(f"[loka-tune] baseline: reusing the runs of a preparation that did not finish ({reused.saved},"
             f" {reused.seconds:.1f}s of runs; {runs_file(cfg)}: same settings but objective.budget_pct, device"
             f" and versions): log loss {baseline.logloss:.5f}, noise floor {baseline.noise_floor_pct:.3g}%;"
             " --fresh runs them again")
    else:
        baseline, stats, _model = run_baseline(cfg, source, device, force=force,
                                               on_run=lambda seed, res: curves.__setitem__(seed, res.step_losses),
                                               with_stats=measure, beside_twin=measure is not None)
        if stats is None or reports:  # the runs and the probe's measurement done: kept until stored
            save_runs(cfg, device, baseline, curves, reports[0] if reports else None, time.perf_counter() - t0)
    kept = reused is not None or stats is None or bool(reports)  # (off a GPU the probe is not measured yet)
    try:
        check_budget(cfg, baseline, force=force)
    except StudyError as e:
        if not kept:  # a file from other settings may be there: it is not these runs
            raise
        raise StudyError(f"{e}. The baseline runs are kept ({runs_file(cfg)}): run tune again with a larger"
                         " objective.budget_pct or --force and they are reused") from None
    return baseline, stats, reused


def _prepare(cfg: StudyConfig, study: Any, *, device: str, force: bool = False,
             tracker: Any = None, on_change: str = "stop") -> StudyContext:
    source = make_source(cfg)
    speed = speed_source(cfg, device)
    batch = first_batch(source, cfg, max_rows=64)  # shapes per example: a small CPU batch is enough
    if _prepared(study):
        baseline, space = _loaded(cfg, study, force=force)
        if tracker is not None:
            tracker.attach_parent(study, cfg)
        return StudyContext(cfg, study, source, baseline, space, device, speed, tracker, batch)

    out = cfg.output_dir
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    prep = _private_dir(cfg)
    prep.mkdir(parents=True, exist_ok=True)
    curves: dict[int, tuple[float, ...]] = {}
    phases: dict[str, float] = {}  # seconds per part of the preparation (logged, stored: ATTR_PREPARE_PHASES)
    mark = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        phases[name] = phases.get(name, 0.0) + now - mark
        mark = now

    # the probe's raw statistics stay in memory: nothing reads them back (the report does), and
    # their float64 covariances were 134 MB for the quickstart's 2048-wide layers. On a GPU the
    # probe's measurement runs beside the noise twin (:func:`beside_twin`; its seconds inside
    # the twin's, the "probe" phase then the pruning alone, and the space line says what ran
    # beside); elsewhere after the budget check, as its own phase. Once the runs and the
    # measurement are done they are kept in <output_dir>/baseline_runs.json until the study stores
    # them: a preparation that stops later (refused on its budget, interrupted while pricing) is
    # not lost, the next one with the same settings but its budget reuses them
    candidates = enumerate_candidates(cfg.space.backends, cfg.space.formats, cfg.space.granularities,
                                      cfg.space.roundings, device=device)
    beside = beside_twin(device)
    reports: list[Any] = []
    probe_s: list[float] = []

    def measure(stats: Any) -> None:
        t = time.perf_counter()
        reports.append(_probe_report(cfg, stats, candidates, device, prep / "probe_report.json"))
        probe_s.append(time.perf_counter() - t)

    baseline, stats, reused = _baselines(cfg, source, device, force=force, curves=curves, reports=reports,
                                         measure=measure if beside else None, prep=prep, t0=t0)
    lap("baselines")

    # sites on a fresh (unapplied) model, eligibility
    model = make_model(cfg, source)
    sites = discover_sites(model, *model_inputs(model, batch))
    space = build_space(sites, candidates, batch_size=cfg.batch_size, align=cfg.space.align,
                        min_dim=cfg.space.min_dim, device=device, per_role=cfg.space.per_role,
                        mods=mods_dims(cfg.space.mods, blocknorm_sizes=cfg.space.blocknorm_sizes,
                                       pad_multiples=cfg.space.pad_multiples))
    lap("sites")
    baseline = price_baseline(cfg, baseline, source, batch, speed=speed, device=device)
    lap("baseline_price")
    if stats is not None and not reports:  # off a GPU: after the budget check (a refused study never measures)
        measure(stats)
        save_runs(cfg, device, baseline, curves, reports[0], phases["baselines"] + probe_s[-1])
    report = reports[0] if reports else None
    if report is not None:
        space = _prune(cfg, space, report, speed)
        lap("probe")
    n_fp8 = space.n_fp8_candidates()
    if not cfg.space.per_gemm:
        space = _recipe_space(cfg, space, report, device)
        lap("prices")
    values = f", {space.n_recipe_values()} FP8 site recipes" if not space.per_gemm else ""
    log(f"[loka-tune] space: {len(space.sites)} sites, {n_fp8} FP8 candidates after pruning{values},"
         f" {len(distributions(space))} parameters ({time.perf_counter() - t0:.1f}s to prepare: "
         + ", ".join(f"{k.replace('_', ' ')} {v:.1f}s" for k, v in phases.items())
         + (f"; the probe's measurement, {probe_s[0]:.1f}s, ran beside the noise twin" if probe_s and beside else "")
         + ")")
    if n_fp8 == 0:
        log("[loka-tune] " + no_fp8_reason(space, cfg))

    # store, unless another worker was faster (then use theirs: every worker must share one space)
    if _prepared(study):
        shutil.rmtree(prep, ignore_errors=True)
        drop_runs(cfg)  # the study holds the winner's
        check_settings(study, cfg, on_change)  # it was prepared from another study file's settings?
        return prepare_study(cfg, study, device=device, force=force, tracker=tracker, on_change=on_change)
    for f in prep.iterdir():  # publish the probe files
        os.replace(f, out / f.name)
    prep.rmdir()
    study.set_user_attr(ATTR_SPACE, space.to_dict())
    study.set_user_attr(ATTR_STUDY, cfg.to_dict())
    study.set_user_attr(ATTR_SETTINGS, cfg.settings())  # what later runs of the study are checked against
    study.set_user_attr(ATTR_BASELINE, baseline.to_dict())
    study.set_user_attr(ATTR_PREPARE_S, time.perf_counter() - t0)  # baselines + probe + space (a receipt's prepare_s)
    study.set_user_attr(ATTR_PREPARE_PHASES, {k: round(v, 3) for k, v in phases.items()})
    if reused is not None:  # what this preparation did not run again (a receipt adds it to prepare_s)
        study.set_user_attr(ATTR_PREPARE_REUSED, {"seconds": round(reused.seconds, 3), "saved": reused.saved})
    drop_runs(cfg)  # the study holds them now
    ctx = StudyContext(cfg, study, source, baseline, space, device, speed, tracker, batch)
    _enqueue_starts(cfg, study, space, report)
    if tracker is not None:
        tracker.attach_parent(study, cfg)  # the study's MLflow run, with the settings it was prepared with
        tracker.log_baseline(baseline, space, out / "probe_report.json" if report is not None else None,
                             curves=curves)
    return ctx
