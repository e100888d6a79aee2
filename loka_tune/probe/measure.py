"""The offline half of the probe: error and speed of every candidate at every site and GEMM.

For each site, each distribution (``learned`` / ``normal`` / ``real``, see
:mod:`loka_tune.probe.synth`) and each of ``samples`` draws ``(X, dY, W)`` (float64), the three
GEMMs are built in the canonical form of :mod:`loka_tune.config` (``A @ B.T``, operands from
:func:`loka_tune.config.role_operands`: fwd ``X, W``; dgrad ``dY, W^T``; wgrad ``dY^T, X^T``).

The reference is the float64 product of the draws. Each candidate gets the operands cast to
``operand_dtype`` (default bf16, the dtype a GPU run feeds its GEMMs) and runs through its
backend's :meth:`~loka_tune.kernels.registry.Backend.error_gemm` (``emulated`` on the CPU;
``torch_scaled_mm``: the compiled step's torch-op path, no Triton compilation per width); its output is compared with the reference by
:func:`loka_tune.kernels.quant.mere` and :func:`~loka_tune.kernels.quant.sqnr_db` (reference first):

- **MERE** = ``mean |out - ref| / max(|ref|, guard)``, ``guard = guard_frac * rms(ref)`` with
  :data:`GUARD_FRAC` = 1e-2: without a guard, outputs that happen to be ~0 make the mean
  relative error unbounded (its expectation diverges logarithmically for a continuous
  ``ref``); with it, elements smaller than 1% of the output's rms count as if they were
  that large. (1e-3 was tried first: the per-element relative error then has a variance
  ~1/guard, and on small outputs (a 8 x 16 wgrad) one near-zero element moved MERE by 0.1.) The mean over elements is then averaged (and its std taken) over the draws.
- **SQNR** = ``10 log10(sum ref^2 / sum (out - ref)^2)`` dB, mean and std over the draws.

A caveat shared by both metrics: elements below 1% of the output's rms are not judged by
their own relative error, e.g. the weight-gradient columns of input features a thousand
times smaller than the others (which Adam rescales per parameter). The guard trades that
blind spot for a stable metric.

Speed comes from a :class:`~loka_tune.probe.speed.SpeedModel` at the site's real shape
(not the CPU-capped rows), so each result says ``time_source`` ``measured`` or ``modeled``. A
Linear called several times per step is priced at the rows of all its calls, as the tuner's
cost model (``objectives.speed``) prices it.

Default threshold :data:`DEFAULT_MAX_ERROR` (MERE 0.2): see the constant for where it comes from.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from loka_tune.config import ROLES, Format, GemmChoice, GemmRole, role_operands
from loka_tune.errors import LokaError, ProbeError
from loka_tune.kernels.quant import GUARD_FRAC, RefErrors
from loka_tune.probe.report import CandidateResult, ProbeReport, SkippedCandidate, check_thresholds, is_fast, is_safe
from loka_tune.probe.speed import SpeedModel, default_speed_model
from loka_tune.probe.stats import ProbeStats, SiteStats
from loka_tune.probe.synth import DISTS, MAX_ROWS, SiteSampler

__all__ = [
    "GUARD_FRAC",
    "DEFAULT_MAX_ERROR",
    "DEFAULT_MIN_SPEEDUP",
    "DEFAULT_CANDIDATES",
    "resolve_candidates",
    "measure",
]

# Safe if MERE <= 0.2 (the paper's number, on our guard). Calibration (bf16 operands, guard
# 1e-2, 8 draws of standard-normal X, dY, W at (M, K, N) = (1024, 512, 512) and (4096, 64, 256),
# every role): bf16 0.009 (51 dB); e4m3 with tensor / row / block / mx scaling 0.125-0.136
# (28.5 dB: a 3-bit mantissa is ~4% rms error per output, which the relative metric weighs
# up ~3x through the outputs near 0); e5m2 gradients 0.209-0.213 (24.6 dB). So 0.2 passes
# e4m3 on well-scaled operands with a ~50% margin and fails anything as bad as losing a
# mantissa bit (e5m2) or worse: outliers, features spanning decades, a large common mean
# that the scaling cannot follow.
DEFAULT_MAX_ERROR = 0.2
DEFAULT_MIN_SPEEDUP = 1.05  # the paper's "fast": at least 5% faster than bf16
DEFAULT_CANDIDATES = (
    "bf16",
    "e4m3.tensor.emulated",
    "e4m3.row.emulated",
    "e4m3.block.emulated",
    "mxfp8.mx.emulated",
    "e5m2+e4m3.tensor.emulated",
    "e5m2+e4m3.row.emulated",
)


# ---------------------------------------------------------------------------- candidates
def resolve_candidates(candidates: Iterable[GemmChoice | str] | None, *, include_bf16: bool = True) -> list[GemmChoice]:
    """Parse candidates (``None``: :data:`DEFAULT_CANDIDATES`), dedupe, bf16 first when asked."""
    raw = list(DEFAULT_CANDIDATES if candidates is None else candidates)
    out: list[GemmChoice] = []
    for c in raw:
        try:
            ch = c if isinstance(c, GemmChoice) else GemmChoice.parse(str(c), key="candidates")
        except LokaError as e:
            raise ProbeError(f"bad candidate {c!r}: {e}") from None
        if ch not in out:
            out.append(ch)
    if include_bf16 and not any(c.is_bf16 for c in out):
        out.insert(0, GemmChoice())
    if not out:
        raise ProbeError("no candidates to measure: give at least one GEMM choice, e.g. 'e4m3.row.emulated'")
    return out


def _why_not(choice: GemmChoice, role: GemmRole, device: str, shape: tuple[int, int, int],
             e5m2_anywhere: bool = False) -> str | None:
    """Why ``choice`` is not measured for ``role`` (None: measure it)."""
    if choice.b_format == Format.E5M2 and not e5m2_anywhere:
        return "e5m2 is for gradient operands; B (a weight or an activation) must be e4m3"
    if choice.a_format == Format.E5M2 and role == GemmRole.FWD and not e5m2_anywhere:
        return "e5m2 is for gradient operands; A of fwd is the activation X"
    from loka_tune.kernels.registry import get_backend

    try:
        return get_backend(choice.backend).supports(choice, role, device=device, shape=shape)
    except LokaError as e:
        return str(e)


def _backend_gemm(choice: GemmChoice, a: torch.Tensor, b: torch.Tensor, role: GemmRole) -> torch.Tensor:
    from loka_tune.kernels.registry import get_backend

    return get_backend(choice.backend).error_gemm(a, b, choice, role)


# ---------------------------------------------------------------------------- measure
def measure(
    stats: ProbeStats,
    candidates: Iterable[GemmChoice | str] | None = None,
    *,
    samples: int = 64,
    dists: Sequence[str] = ("learned",),
    device: str | torch.device = "cpu",
    cost_device: str = "h200",
    speed_model: SpeedModel | None = None,
    timing_cache: Any = None,
    max_rows: int = MAX_ROWS,
    operand_dtype: torch.dtype = torch.bfloat16,
    guard_frac: float = GUARD_FRAC,
    max_error: float = DEFAULT_MAX_ERROR,
    min_speedup: float = DEFAULT_MIN_SPEEDUP,
    roles: Iterable[GemmRole | str] = ROLES,
    sites: Iterable[str] | None = None,
    weights: str = "model",
    skip_bad_sites: bool = False,
    seed: int = 0,
    progress: bool = False,
    num_threads: int | None = 1,
    e5m2_anywhere: bool = False,
    speed_row_scale: float = 1.0,
    price_first: bool = False,
) -> ProbeReport:
    """Measure every candidate at every site and role of ``stats``; see the module docstring.

    Args:
        stats: what a :class:`~loka_tune.probe.Probe` collected (``ProbeStats``).
        candidates: GEMM choices or their ids (default :data:`DEFAULT_CANDIDATES`); the plain
            ``bf16`` choice is added when absent (the baseline every speed-up is against).
        samples: draws per site for ``learned`` and ``normal`` (``real`` has one batch).
        dists: distributions to measure (default ``learned`` only); the report holds all of
            them, one result per distribution: consumers that decide from it (dispatch, space
            pruning) should take ``report.select(report.primary_dist)``.
        device: where the GEMMs run (``cpu``: the ``emulated`` backend).
        cost_device: the GPU the speed model prices (``h200``, ``h100``, ``b200``).
        speed_model / timing_cache: override the speed model / give a GPU timing cache.
        max_rows: cap on the rows M of the sampled operands.
        operand_dtype: dtype the candidates get their operands in (the reference is float64).
        guard_frac: the MERE guard as a fraction of rms(ref).
        max_error / min_speedup: thresholds of the ``safe`` / ``fast`` verdicts.
        roles: GEMM roles to measure.
        sites: restrict to these site names.
        weights: ``"model"`` (matrix-normal draws) or ``"current"`` (the last weight) for ``learned``.
        skip_bad_sites: skip sites with unusable stats (NaN/inf, nothing collected) and list
            them in ``report.skipped`` instead of raising :class:`ProbeError`; they are
            ``"unprobed"`` in ``report.meta["sites"]`` (:meth:`ProbeReport.site_status`), where
            every measured site also says which of its statistics fell back and why.
        seed: seeds every draw (a site's draws do not depend on the other sites).
        speed_row_scale: price speed at ``rows x speed_row_scale`` rows instead of the rows the
            probe saw (e.g. a study's ``cost_batch_size / batch_size``: speed at the production
            batch, errors from the short runs' statistics); results' ``m`` is the priced M.
        price_first: price every candidate's speed first (cost model or timing cache: cheap)
            and measure the error only of those at least ``min_speedup`` faster than bf16; the
            others go to ``report.skipped`` with a reason starting ``"slow:"`` (which
            :func:`~loka_tune.space.candidates.prune_by_probe` drops).
        e5m2_anywhere: also measure e5m2 for weights and activations (outside the search space,
            which keeps e5m2 for gradients): for calibration experiments that need choices
            with large errors (``benchmarks/probe_vs_loss.py --harsh``).
        num_threads: torch CPU threads during the measurement (restored afterwards; None:
            leave as is). 1 by default: the probe's GEMMs are small, and multi-threaded
            small matmuls on a busy CPU are orders of magnitude slower (thread contention).
    """
    with _torch_threads(num_threads if str(device).startswith("cpu") else None):
        dists, roles, cands = _check_args(stats, candidates, samples, dists, guard_frac, max_error,
                                          min_speedup, roles, speed_row_scale)
        speed = speed_model if speed_model is not None else default_speed_model(cost_device, timing_cache)
        device = str(device)
        # the replay's factors and draws on the GPU (float64 torch) where the GEMMs run there:
        # on a wide site they are most of the measurement's cost on a CPU (synth's docstring)
        replay_device = device if torch.device(device).type == "cuda" else None
        skipped: list[SkippedCandidate] = []
        names = _usable_sites(stats, sites, dists, skip_bad_sites, skipped)

        t0 = time.perf_counter()
        results: list[CandidateResult] = []
        site_meta: dict[str, Any] = {}
        it: Iterable[str] = names
        if progress:
            from tqdm import tqdm

            it = tqdm(names, desc="probe: measure", unit="site")
        time_cache: dict[tuple[str, str, int, int, int], tuple[float, str]] = {}
        # where the measurement's time goes (wall seconds; the device synchronised at each boundary):
        # the replay's factors, the draws, the candidates' GEMMs with their errors; and per site
        phases = {"replay": 0.0, "draws": 0.0, "gemms": 0.0}
        site_s: dict[str, float] = {}
        sync = _syncer(device)
        for name in it:
            t_site = time.perf_counter()
            site = stats.sites[name]
            valid = _valid_candidates(name, site, roles, cands, device, e5m2_anywhere, skipped)
            if price_first:
                valid = _fast_only(name, site, valid, speed, time_cache, speed_row_scale, min_speedup, skipped)
            meta_site = _site_meta(site)
            fallbacks = site.fallbacks  # statistic -> why it fell back (collection, then replay)
            site_results: list[CandidateResult] = []
            t_rep = time.perf_counter()
            try:
                samplers = [SiteSampler(site, dist, max_rows=max_rows, weights=weights, device=replay_device,
                                        seed=int(np.random.SeedSequence([seed, _stable_hash(name), di]).generate_state(1)[0]))
                            for di, dist in enumerate(dists)
                            if not (dist == "real" and (site.x.real is None or site.dy.real is None))]
            except (ArithmeticError, np.linalg.LinAlgError, RuntimeError) as e:  # the replay's factors: not seen, but never a traceback
                why = f"unusable statistics: the replay could not be formed ({type(e).__name__}: {e})"
                skipped.append(SkippedCandidate(name, "*", "*", why))
                site_meta[name] = {**meta_site, **_status(fallbacks, unprobed=why)}
                continue
            sync()
            phases["replay"] += time.perf_counter() - t_rep
            for sampler in samplers:
                dist = sampler.dist
                n_draws = 1 if dist == "real" else samples
                errs = _measure_site(sampler, valid, n_draws, device, operand_dtype, guard_frac, phases, sync)
                meta_site.setdefault("rows_sampled", {})[dist] = sampler.rows
                if dist == "learned":
                    meta_site["jitter"] = sampler.jitter
                    fallbacks.update(sampler.fallbacks)
                # a Linear called c times per step does c x the rows (as the cost model prices it)
                priced_rows = max(1, round(site.rows * _calls_per_step(site, stats.collections) * speed_row_scale))
                site_results += _results(name, site, dist, n_draws, sampler.rows, priced_rows, valid, errs, speed,
                                         time_cache, max_error, min_speedup)
            results += site_results
            site_meta[name] = {**meta_site, **_status(fallbacks)}
            site_s[name] = time.perf_counter() - t_site
        for sk in skipped:  # sites whose statistics are unusable: unprobed (they keep every candidate)
            if sk.role == "*" and sk.site not in site_meta and sk.reason.startswith("unusable statistics"):
                site_meta[sk.site] = {**_site_meta(stats.sites[sk.site]), **_status(stats.sites[sk.site].fallbacks,
                                                                                    unprobed=sk.reason)}
        site_meta = {n: site_meta[n] for n in stats.sites if n in site_meta}  # in the model's order
        meta = {
            "samples": samples, "dists": dists, "device": device, "cost_device": cost_device,
            "speed_model": type(speed).__name__, "max_rows": max_rows,
            "operand_dtype": str(operand_dtype).replace("torch.", ""), "guard_frac": guard_frac,
            "weights": weights, "seed": seed, "candidates": [c.short_str() for c in cands],
            "replay_device": replay_device or "cpu",
            "roles": [r.value for r in roles],
            "stats": {"model": stats.model, "steps": stats.steps, "collections": stats.collections,
                      "every": stats.every, **stats.meta},
            "sites": site_meta, "measure_s": round(time.perf_counter() - t0, 3),
            "phases_s": {k: round(v, 3) for k, v in phases.items()},
            "site_s": {k: round(v, 3) for k, v in site_s.items()},
        }
        return ProbeReport(results, skipped, float(max_error), float(min_speedup), meta, stats)


@contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``n`` torch CPU threads, restored afterwards (``None``: as is)."""
    if n is None:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _check_args(
    stats: ProbeStats,
    candidates: Iterable[GemmChoice | str] | None,
    samples: int,
    dists: Sequence[str],
    guard_frac: float,
    max_error: float,
    min_speedup: float,
    roles: Iterable[GemmRole | str],
    speed_row_scale: float,
) -> tuple[list[str], list[GemmRole], list[GemmChoice]]:
    """:func:`measure`'s argument checks (:class:`ProbeError` quoting the value); returns the
    deduplicated distributions, the roles and the parsed candidates."""
    if not isinstance(stats, ProbeStats):
        raise ProbeError(f"measure() needs ProbeStats (Probe(...).stats or ProbeStats.load), got {type(stats).__name__}")
    if isinstance(speed_row_scale, bool) or not isinstance(speed_row_scale, (int, float)) \
            or not math.isfinite(speed_row_scale) or speed_row_scale <= 0:
        raise ProbeError(f"speed_row_scale must be a finite number > 0, got {speed_row_scale=!r}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ProbeError(f"samples must be a positive integer, got {samples=!r}")
    dists = list(dict.fromkeys(dists))
    bad = [d for d in dists if d not in DISTS]
    if bad or not dists:
        raise ProbeError(f"unknown distribution(s) {bad or dists!r}: choose among {', '.join(DISTS)}")
    if not (guard_frac > 0 and math.isfinite(guard_frac)):
        raise ProbeError(f"guard_frac must be a small positive fraction, got {guard_frac=!r}")
    check_thresholds(max_error, min_speedup)
    try:
        role_list = [GemmRole(r) for r in roles]
    except ValueError:
        raise ProbeError(f"roles must be among 'fwd', 'dgrad', 'wgrad', got {list(roles)!r}") from None
    return dists, role_list, resolve_candidates(candidates)


def _usable_sites(stats: ProbeStats, sites: Iterable[str] | None, dists: list[str], skip_bad_sites: bool,
                  skipped: list[SkippedCandidate]) -> list[str]:
    """The site names to measure (all, or ``sites``), in the stats' order; sites with unusable
    statistics raise :class:`ProbeError` or, with ``skip_bad_sites``, are appended to
    ``skipped``, as are sites without a captured batch when ``real`` is measured."""
    names = list(stats.sites)
    if sites is not None:
        want = list(sites)
        unknown = [s for s in want if s not in stats.sites]
        if unknown:
            raise ProbeError(f"unknown site(s) {unknown!r}; the stats have {names[:10]!r}")
        names = [n for n in names if n in want]
    problems = {n: r for n, r in stats.problems().items() if n in names}
    if stats.collections == 0 or not stats.sites:
        stats.check()  # raises with the reason
    if problems:
        if not skip_bad_sites:
            stats.check(names)
        for n in [n for n in names if n in problems]:
            skipped.append(SkippedCandidate(n, "*", "*", f"unusable statistics: {problems[n]}"))
        names = [n for n in names if n not in problems]
    if "real" in dists:
        no_real = [n for n in names if stats.sites[n].x.real is None or stats.sites[n].dy.real is None]
        for n in no_real:
            skipped.append(SkippedCandidate(n, "*", "*", "dist 'real': no captured batch (keep_real=False)"))
    return names


def _valid_candidates(name: str, site: SiteStats, roles: list[GemmRole], cands: list[GemmChoice], device: str,
                      e5m2_anywhere: bool, skipped: list[SkippedCandidate]) -> dict[GemmRole, list[GemmChoice]]:
    """Per role, the candidates measured at ``site``; the others go to ``skipped`` with the reason."""
    valid: dict[GemmRole, list[GemmChoice]] = {}
    for role in roles:
        shape = site.shape(role.value)
        valid[role] = []
        for c in cands:
            why = _why_not(c, role, device, shape, e5m2_anywhere)
            if why is None:
                valid[role].append(c)
            else:
                skipped.append(SkippedCandidate(name, role.value, c.short_str(), why))
    return valid


def _fast_only(name: str, site: SiteStats, valid: dict[GemmRole, list[GemmChoice]], speed: SpeedModel,
               time_cache: dict[tuple[str, str, int, int, int], tuple[float, str]], speed_row_scale: float,
               min_speedup: float, skipped: list[SkippedCandidate]) -> dict[GemmRole, list[GemmChoice]]:
    """``valid`` without the candidates priced slower than ``min_speedup`` x bf16 (to ``skipped``)."""
    priced_rows = max(1, round(site.rows * speed_row_scale))
    out: dict[GemmRole, list[GemmChoice]] = {}
    for role, cs in valid.items():
        m, k, n = role.shape(priced_rows, site.in_features, site.out_features)
        t_bf16 = _time(speed, time_cache, GemmChoice(), m, k, n, role)[0]
        out[role] = []
        for c in cs:
            t = _time(speed, time_cache, c, m, k, n, role)[0]
            spd = t_bf16 / t if t > 0 and math.isfinite(t) else math.nan
            if is_fast(spd, min_speedup):
                out[role].append(c)
            else:
                skipped.append(SkippedCandidate(name, role.value, c.short_str(),
                                                f"slow: speed-up {spd:.3g} < min_speedup {min_speedup} (priced"
                                                " before measuring; error not measured)"))
    return out


def _results(
    name: str,
    site: SiteStats,
    dist: str,
    n_draws: int,
    rows: int,
    priced_rows: int,
    valid: dict[GemmRole, list[GemmChoice]],
    errs: dict[tuple[GemmRole, str], list[tuple[float, float]]],
    speed: SpeedModel,
    time_cache: dict[tuple[str, str, int, int, int], tuple[float, str]],
    max_error: float,
    min_speedup: float,
) -> list[CandidateResult]:
    """One :class:`CandidateResult` per (role, candidate) of ``site`` for ``dist``: the error
    statistics over the draws and the speed at ``priced_rows`` rows."""
    out: list[CandidateResult] = []
    for role in valid:
        m, k, n = role.shape(priced_rows, site.in_features, site.out_features)
        t_bf16 = _time(speed, time_cache, GemmChoice(), m, k, n, role)
        for c in valid[role]:
            e = np.asarray(errs[(role, c.short_str())], dtype=np.float64)  # (draws, 2)
            t, src = _time(speed, time_cache, c, m, k, n, role)
            spd = t_bf16[0] / t if t > 0 and math.isfinite(t) else math.nan
            mm, sq = e[:, 0], e[:, 1]
            out.append(CandidateResult(
                site=name, role=role.value, choice=c.short_str(), m=m, k=k, n=n,
                mere=float(mm.mean()), mere_std=float(mm.std()),
                sqnr_db=_mean_db(sq), sqnr_std=float(np.std(sq[np.isfinite(sq)])) if np.isfinite(sq).any() else 0.0,
                time_s=t, bf16_time_s=t_bf16[0], speedup=spd, time_source=src,
                safe=is_safe(float(mm.mean()), max_error), fast=is_fast(spd, min_speedup),
                dist=dist, samples=n_draws, rows=rows,
            ))
    return out


def _measure_site(
    sampler: SiteSampler,
    valid: dict[GemmRole, list[GemmChoice]],
    n_draws: int,
    device: str,
    operand_dtype: torch.dtype,
    guard_frac: float,
    phases: dict[str, float] | None = None,
    sync: Callable[[], None] = lambda: None,
) -> dict[tuple[GemmRole, str], list[tuple[float, float]]]:
    """Every draw's ``(MERE, SQNR)`` per (role, candidate); the wall seconds of the draws and of
    the GEMMs with their errors are added to ``phases["draws"]`` / ``phases["gemms"]``.

    The errors stay on the device until the site is done (:class:`~loka_tune.kernels.quant.RefErrors`:
    one read-back per site, not four per candidate; the phase timers still wait once per draw)."""
    ph = phases if phases is not None else {"draws": 0.0, "gemms": 0.0}
    errs: dict[tuple[GemmRole, str], list[tuple[float, float]]] = {
        (r, c.short_str()): [] for r, cs in valid.items() for c in cs
    }
    pending: list[tuple[tuple[GemmRole, str], torch.Tensor]] = []  # (role, candidate) -> its terms, in draw order
    with torch.no_grad():
        for _ in range(n_draws):
            t = time.perf_counter()
            x, dy, w = sampler.draw_tensors(device)
            sync()
            t1 = time.perf_counter()
            ph["draws"] += t1 - t
            for role, cs in valid.items():
                if not cs:
                    continue
                a64, b64 = role_operands(role, x, dy, w)
                ref = RefErrors(a64 @ b64.T, guard_frac)  # float64 reference
                a, b = a64.to(operand_dtype), b64.to(operand_dtype)
                for c in cs:
                    pending.append(((role, c.short_str()), ref.terms(_backend_gemm(c, a, b, role))))
                del ref
            sync()
            ph["gemms"] += time.perf_counter() - t1
        t = time.perf_counter()
        rows = torch.stack([v for _, v in pending]).cpu().tolist() if pending else []
        ph["gemms"] += time.perf_counter() - t
    for (key, _), row in zip(pending, rows):
        errs[key].append(RefErrors.metrics(row))
    return errs


def _syncer(device: str) -> Callable[[], None]:
    """A function that waits for the work queued on ``device``'s current stream (a no-op off
    CUDA), for the phase timers: the stream the measurement queues on, not the whole device, so
    a measurement on a stream of its own beside a training run (the study's probe beside the
    noise twin) never waits for the run's steps."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return lambda: None
    return lambda: torch.cuda.current_stream(dev).synchronize()


def _time(speed: SpeedModel, cache: dict, choice: GemmChoice, m: int, k: int, n: int,
          role: GemmRole) -> tuple[float, str]:
    key = (choice.short_str(), role.value, m, k, n)
    if key not in cache:
        t, src = speed.seconds(choice, m, k, n, role)
        cache[key] = (float(t), str(src))
    return cache[key]


def _mean_db(sq: np.ndarray) -> float:
    fin = sq[np.isfinite(sq)]
    if fin.size == sq.size:
        return float(sq.mean())
    return math.inf if fin.size == 0 and np.all(sq > 0) else float(np.mean(sq))


def _stable_hash(s: str) -> int:
    h = 2166136261
    for ch in s.encode():
        h = ((h ^ ch) * 16777619) & 0xFFFFFFFF
    return h


def _calls_per_step(site: SiteStats, collections: int) -> int:
    """Forward calls of the site per collected step (2 for a Linear used twice), at least 1."""
    if collections <= 0:
        return 1
    return max(1, round((site.x.batches + site.x.nonfinite) / collections))


def _status(fallbacks: dict[str, str], unprobed: str | None = None) -> dict[str, Any]:
    """A site's entry in ``report.meta["sites"]``: ``status`` (``"probed"``, ``"fallback"``:
    probed from a simpler statistic for at least one of them, ``"unprobed"``: nothing
    measured, the search keeps every candidate there), ``fallbacks`` (statistic -> why) and,
    when unprobed, ``reason``."""
    out: dict[str, Any] = {"status": "unprobed" if unprobed else ("fallback" if fallbacks else "probed"),
                           "fallbacks": dict(fallbacks)}
    if unprobed:
        out["reason"] = unprobed
    return out


def _site_meta(site: SiteStats) -> dict[str, Any]:
    def kurt(k: Any) -> float | None:
        return None if k is None else round(float(np.median(k)), 4)

    return {
        "M": site.rows, "K": site.in_features, "N": site.out_features,
        "x_amax": site.x.amax, "x_kurtosis_median": kurt(site.x.kurtosis),
        "dy_amax": site.dy.amax, "dy_kurtosis_median": kurt(site.dy.kurtosis),
        "w_amax": site.w.amax, "w_kurtosis": site.w.kurtosis,
        "cov": "full" if site.x.full else ("diag" if site.x.lr_vals is not None and len(site.x.lr_vals) == 0
                                           else "diag+lowrank"),
    }
