"""LoKA Dispatch: the static per-GEMM plan, from error estimates and timings.

For every site (linear layer) and each of its three GEMMs, :func:`build_plan` keeps the
candidates whose error (MERE, from the probe) is at most ``max_error`` and whose speed-up
over bf16 exceeds ``min_speedup``, and takes the fastest; if none qualifies the GEMM stays in
bf16. The plan is a :class:`~loka_tune.config.PrecisionConfig` (one rule per site), so it
can be applied, exported and used as the tuner's starting point. Its provenance records,
per GEMM, the choice, its error, its speed-up and where the speed came from: ``measured``
(GPU timings) or ``modeled`` (the CPU cost model).

Input records are the probe's ``CandidateResult`` objects (or mappings with the same keys):
``site``, ``role``, ``choice`` (id string or :class:`GemmChoice`), ``m``, ``k``, ``n``,
``mere``, ``speedup``, ``time_s``, ``bf16_time_s``, ``time_source``. With ``timings`` (a
:class:`~loka_tune.kernels.timing.TimingCache` or a mapping ``(choice id, m, k, n, role) ->
seconds``), measured times replace the report's wherever both the candidate and bf16 were
measured on that GEMM.

:func:`recipe_config` (public as ``loka_tune.recipe_config``) is every named recipe's config:
the uniform ones from the recipe table (:mod:`loka_tune.recipes`, via
:meth:`PrecisionConfig.from_recipe`), and ``"dispatch"``, built here from a probe report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping

from loka_tune.config import BF16, ROLES, GemmChoice, GemmRole, ModsConfig, PrecisionConfig, SitePrecision
from loka_tune.errors import ConfigError, UnsupportedChoiceError
from loka_tune.recipes import DISPATCH

__all__ = ["GemmDecision", "build_plan", "decide_gemm", "plan_decisions", "recipe_config"]


@dataclass(frozen=True)
class GemmDecision:
    """What Dispatch chose for one GEMM of one site, and why."""

    site: str
    role: str
    choice: GemmChoice
    speedup: float  # over bf16 (1.0 for bf16)
    mere: float | None
    time_source: str  # "measured" | "modeled" | "none" (bf16 by default, nothing qualified)
    candidates: int  # how many candidates were considered
    qualified: int  # how many passed both thresholds

    def to_dict(self) -> dict[str, Any]:
        return {"choice": self.choice.short_str(), "speedup": round(self.speedup, 4),
                "mere": None if self.mere is None else round(self.mere, 6), "time_source": self.time_source,
                "candidates": self.candidates, "qualified": self.qualified}


def _get(rec: Any, name: str, default: Any = None) -> Any:
    if isinstance(rec, Mapping):
        return rec.get(name, default)
    return getattr(rec, name, default)


def _records(report: Any) -> list[Any]:
    if hasattr(report, "select") and hasattr(report, "primary_dist"):
        # a probe report may hold several input distributions (learned, normal, real): plan on
        # the probe's answer only, never on a mix
        report = report.select(report.primary_dist)
    recs = _get(report, "results", None) if not isinstance(report, (list, tuple)) else report
    if recs is None:
        raise ConfigError(
            f"got {type(report).__name__}; build_plan takes a ProbeReport (with .results) or a list of"
            " candidate records", key="report")
    return list(recs)


def _timing_lookup(timings: Any, choice: str, m: int, k: int, n: int, role: str) -> float | None:
    if timings is None:
        return None
    if hasattr(timings, "get") and not isinstance(timings, Mapping):  # TimingCache
        return timings.get(choice, m, k, n, role)
    v = timings.get((choice, m, k, n, role))
    return None if v is None else float(v)


def decide_gemm(records: Iterable[Any], *, max_error: float = 0.2, min_speedup: float = 1.05,
                timings: Any = None, site: str = "", role: str = "") -> GemmDecision:
    """The Dispatch rule for the candidate records of one GEMM (one site, one role)."""
    recs = list(records)
    best: tuple[float, GemmChoice, float | None, str] | None = None  # (speedup, choice, mere, source)
    qualified = 0
    for r in recs:
        c = _get(r, "choice")
        choice = c if isinstance(c, GemmChoice) else GemmChoice.parse(str(c), key="choice")
        if choice.is_bf16:
            continue
        mere = _get(r, "mere")
        if mere is None or not math.isfinite(float(mere)) or float(mere) > max_error:
            continue
        speedup, source = _get(r, "speedup"), _get(r, "time_source", "modeled")
        m, k, n = _get(r, "m"), _get(r, "k"), _get(r, "n")
        if None not in (m, k, n):
            t = _timing_lookup(timings, choice.short_str(), m, k, n, role)
            t0 = _timing_lookup(timings, "bf16", m, k, n, role)
            if t is not None and t0 is not None and t > 0:
                speedup, source = t0 / t, "measured"
        if speedup is None or not math.isfinite(float(speedup)) or float(speedup) <= min_speedup:
            continue
        qualified += 1
        if best is None or float(speedup) > best[0]:
            best = (float(speedup), choice, float(mere), str(source))
    if best is None:
        return GemmDecision(site, role, BF16, 1.0, None, "none", len(recs), 0)
    return GemmDecision(site, role, best[1], best[0], best[2], best[3], len(recs), qualified)


def _resolve_emulated(choice: GemmChoice, rec: Any, role: str, device: str) -> tuple[GemmChoice, str | None]:
    """Replace an ``emulated`` choice by the real backend the cost model finds fastest."""
    if choice.backend != "emulated":
        return choice, None
    from loka_tune.kernels.costmodel import estimate_gemm_seconds

    m, k, n = _get(rec, "m"), _get(rec, "k"), _get(rec, "n")
    best, best_t = None, math.inf
    for be in ("torch_scaled_mm", "fbgemm", "triton", "torchao"):
        c = choice.with_backend(be)
        try:
            t = estimate_gemm_seconds(c, m, k, n, role, device)
        except UnsupportedChoiceError:
            continue
        if t < best_t:
            best, best_t = c, t
    if best is None:
        return choice, f"no real backend runs {choice.short_str()} on {device}: kept 'emulated'"
    return best, None


def plan_decisions(report: Any, *, max_error: float = 0.2, min_speedup: float = 1.05,
                   timings: Any = None) -> dict[str, dict[str, GemmDecision]]:
    """``{site: {role: GemmDecision}}`` for every (site, role) present in the report."""
    groups: dict[tuple[str, str], list[Any]] = {}
    order: list[str] = []
    for r in _records(report):
        site, role = str(_get(r, "site")), GemmRole(_get(r, "role")).value
        if site not in order:
            order.append(site)
        groups.setdefault((site, role), []).append(r)
    out: dict[str, dict[str, GemmDecision]] = {}
    for site in order:
        out[site] = {}
        for role in ROLES:
            recs = groups.get((site, role.value), [])
            out[site][role.value] = decide_gemm(recs, max_error=max_error, min_speedup=min_speedup,
                                                timings=timings, site=site, role=role.value)
    return out


def build_plan(report: Any, *, max_error: float = 0.2, min_speedup: float = 1.05, timings: Any = None,
               resolve_emulated: bool = True, device: str = "h200") -> PrecisionConfig:
    """The static Dispatch plan as a :class:`PrecisionConfig` (one rule per site; default bf16).

    ``resolve_emulated``: a chosen ``...emulated`` candidate (the probe measures errors with
    the emulated backend) becomes the real backend that the cost model finds fastest on
    ``device`` for that GEMM, so that the plan runs on a GPU.
    """
    if not (max_error > 0):
        raise ConfigError(f"got max_error={max_error!r}; expected a positive MERE threshold", key="max_error")
    if not (min_speedup > 0):
        raise ConfigError(f"got min_speedup={min_speedup!r}; expected e.g. 1.05", key="min_speedup")
    decisions = plan_decisions(report, max_error=max_error, min_speedup=min_speedup, timings=timings)
    recs_by: dict[tuple[str, str], Any] = {}
    for r in _records(report):
        recs_by.setdefault((str(_get(r, "site")), GemmRole(_get(r, "role")).value), r)
    sites: dict[str, SitePrecision] = {}
    per_gemm: dict[str, dict[str, Any]] = {}
    sources: set[str] = set()
    notes: list[str] = []
    for site, by_role in decisions.items():
        chosen = {}
        per_gemm[site] = {}
        for role, d in by_role.items():
            c = d.choice
            if resolve_emulated and not c.is_bf16:
                c, note = _resolve_emulated(c, recs_by.get((site, role)), role, device)
                if note:
                    notes.append(f"{site}.{role}: {note}")
            chosen[role] = c
            info = d.to_dict()
            info["choice"] = c.short_str()
            per_gemm[site][role] = info
            if d.time_source != "none":
                sources.add(d.time_source)
        sites[site] = SitePrecision(chosen["fwd"], chosen["dgrad"], chosen["wgrad"])
    n_fp8 = sum(1 for s in per_gemm.values() for d in s.values() if d["choice"] != "bf16")
    prov = {
        "source": "loka-tune dispatch",
        "max_error": max_error,
        "min_speedup": min_speedup,
        "time_source": "mixed" if len(sources) > 1 else (sources.pop() if sources else "none"),
        "device": device,
        "fp8_gemms": n_fp8,
        "gemms": sum(len(s) for s in per_gemm.values()),
        "per_gemm": per_gemm,
    }
    if notes:
        prov["notes"] = notes
    return PrecisionConfig.from_sites(sites, default="bf16", provenance=prov)


def recipe_config(
    name: str,
    *,
    backend: str = "torch_scaled_mm",
    mods: ModsConfig | Mapping[str, Any] | None = None,
    report: Any = None,
    **plan_options: Any,
) -> PrecisionConfig:
    """The :class:`PrecisionConfig` of recipe ``name``.

    - ``"bf16"``, ``"tensorwise"``, ``"tensorwise_fa"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``: the uniform
      recipes, as :meth:`PrecisionConfig.from_recipe` builds them (``backend``, ``mods``);
    - ``"dispatch"``: LoKA's per-GEMM plan built from a probe ``report`` by :func:`build_plan`
      (``plan_options``: ``max_error``, ``min_speedup``, ``timings``, ``resolve_emulated``,
      ``device``), with ``mods``.
    """
    if name != DISPATCH:
        if report is not None:
            plan_options = {**plan_options, "report": report}
        return PrecisionConfig.from_recipe(name, backend=backend, mods=mods, **plan_options)
    if report is None:
        raise ConfigError(
            "the 'dispatch' recipe is built from a probe report: pass report=<a Probe's report or a"
            " saved probe report>, or call loka_tune.build_plan(report)", key="recipe")
    return replace(build_plan(report, **plan_options), mods=ModsConfig.of(mods))
