"""Candidate enumeration, eligibility filters and probe pruning: the per-site search space.

Stages (one function each, like a sharding planner's enumerate / filter / rate):

1. :func:`enumerate_candidates`: every GEMM choice the allowed backends implement for the
   allowed formats and granularities (:func:`loka_tune.kernels.registry.candidate_choices`).
2. :func:`build_space`: per site x role, keep the candidates that fit the GEMM
   (:func:`eligibility`: minimum size, alignment of K and N, the backend's own
   ``supports(choice, role, device, shape)``); bf16 always stays, first.
3. :func:`prune_by_probe`: drop candidates the probe found unsafe (error above the threshold)
   or slow (speed-up under the threshold), recording why.

A :class:`SearchSpace` is plain JSON-able data: the first worker of a study computes it and
stores it in the study, every other worker (and every resume) decodes trials with that same
space. By default a study searches the *recipe space* built on top of these per-GEMM choices
(:mod:`loka_tune.space.recipe_space`: per site a few whole-site recipes, priced); ``[space]
per_gemm = true`` searches the per-GEMM choices themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

from loka_tune.config import BF16, ROLES, GemmChoice, GemmRole
from loka_tune.errors import BackendError, StudyError
from loka_tune.space.sites import Site

__all__ = [
    "SiteChoices",
    "SearchSpace",
    "enumerate_candidates",
    "eligibility",
    "build_space",
    "prune_by_probe",
]

BF16_ID = BF16.short_str()


@dataclass(frozen=True)
class SiteChoices:
    """The surviving choices of one site, per role (short_str ids, ``"bf16"`` first).

    ``dropped[role][choice]`` says why a candidate left; ``error[role][choice]`` and
    ``speedup[role][choice]`` keep the probe's numbers where it measured them.

    In a recipe space (:mod:`loka_tune.space.recipe_space`) also: ``recipes``, recipe name ->
    the site's value (a :meth:`SitePrecision.short_str`, ``"bf16"`` first: the values of the
    site's parameter), ``prices``, value -> seconds per training step it saves against the site
    in bf16 (positive: faster), and ``recipe_dropped``, recipe name -> why it is not a value.
    """

    site: Site
    choices: Mapping[str, tuple[str, ...]]
    dropped: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    error: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    speedup: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    recipes: Mapping[str, str] = field(default_factory=dict)
    prices: Mapping[str, float] = field(default_factory=dict)
    recipe_dropped: Mapping[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.site.name

    def to_dict(self) -> dict[str, Any]:
        d = {"site": self.site.to_dict(), "choices": {r: list(c) for r, c in self.choices.items()},
             "dropped": {r: dict(d) for r, d in self.dropped.items()},
             "error": {r: dict(d) for r, d in self.error.items()},
             "speedup": {r: dict(d) for r, d in self.speedup.items()}}
        for k in ("recipes", "prices", "recipe_dropped"):  # a recipe space's only: a per-GEMM one reads as before
            if getattr(self, k):
                d[k] = dict(getattr(self, k))
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SiteChoices":
        return cls(Site.from_dict(d["site"]), {r: tuple(c) for r, c in d["choices"].items()},
                   {r: dict(x) for r, x in d.get("dropped", {}).items()},
                   {r: dict(x) for r, x in d.get("error", {}).items()},
                   {r: dict(x) for r, x in d.get("speedup", {}).items()},
                   {str(k): str(v) for k, v in d.get("recipes", {}).items()},
                   {str(k): float(v) for k, v in d.get("prices", {}).items()},
                   {str(k): str(v) for k, v in d.get("recipe_dropped", {}).items()})

    @property
    def values(self) -> tuple[str, ...]:
        """A recipe space's values of this site (``"bf16"`` first; empty in a per-GEMM space)."""
        return tuple(dict.fromkeys(self.recipes.values()))


@dataclass(frozen=True)
class SearchSpace:
    """Per-site choices plus the Mods dimensions.

    ``per_gemm=True``: the per-GEMM space, one parameter per site x role (``per_role=False``
    ties fwd/dgrad/wgrad together: one per site); ``per_gemm=False``: the recipe space, one
    parameter per site whose values are its recipes (:attr:`SiteChoices.recipes`), priced
    by ``price_source`` (``"modeled"``: the cost model, ``"measured"``: timed on the device).
    A space stored before recipe spaces existed has no ``per_gemm`` key: per-GEMM.
    """

    sites: tuple[SiteChoices, ...]
    mods: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    per_role: bool = True
    per_gemm: bool = True
    price_source: str | None = None

    def site(self, name: str) -> SiteChoices:
        for s in self.sites:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def site_names(self) -> list[str]:
        return [s.name for s in self.sites]

    def n_fp8_candidates(self) -> int:
        """FP8 choices left per site x GEMM (the per-GEMM space's; a recipe space is built from them)."""
        return sum(len(c) - 1 for s in self.sites for c in s.choices.values())

    def n_recipe_values(self) -> int:
        """FP8 values of a recipe space's site parameters (0 in a per-GEMM space)."""
        return sum(max(len(s.values) - 1, 0) for s in self.sites)

    def size(self) -> float:
        """Number of distinct configurations (a float: it can be astronomically large): the
        product of the choices of every parameter Optuna sees (``space.encode``'s dims)."""
        n = 1.0
        for sc in self.sites:
            if not self.per_gemm:
                n *= max(len(sc.values), 1)
            elif self.per_role:
                for r in ROLES:
                    n *= max(len(sc.choices[r.value]), 1)
            else:
                n *= max(len(tied_choices(sc)), 1)
        for v in self.mods.values():
            n *= max(len(v), 1)
        return n

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"sites": [s.to_dict() for s in self.sites],
                             "mods": {k: list(v) for k, v in self.mods.items()}, "per_role": self.per_role}
        if not self.per_gemm:  # a per-GEMM space's dict is the one stored before recipe spaces
            d["per_gemm"] = False
            d["price_source"] = self.price_source
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SearchSpace":
        return cls(tuple(SiteChoices.from_dict(s) for s in d["sites"]),
                   {k: tuple(v) for k, v in d.get("mods", {}).items()}, bool(d.get("per_role", True)),
                   bool(d.get("per_gemm", True)), d.get("price_source"))


def enumerate_candidates(backends: Sequence[str], formats: Sequence[str], granularities: Sequence[str],
                         roundings: Sequence[str] | None = None, *, device: str | None = None,
                         ) -> dict[str, list[GemmChoice]]:
    """Per role, every FP8 choice the ``backends`` implement for the allowed formats,
    granularities and scale roundings (on ``device`` when given).

    Per role because the format pairs differ: e5m2 gradients exist in dgrad and wgrad only.
    Raises :class:`StudyError` when no role has any candidate, naming what was asked.
    """
    import warnings

    from loka_tune.kernels import registry

    def importable(name: str) -> bool:  # only the backends asked for: a study on torch_scaled_mm
        try:                            # never imports fbgemm, torchao or triton's kernels
            registry.get_backend(name)
        except BackendError:
            return False
        return True

    missing = [b for b in backends if not importable(b)]
    if missing and len(missing) < len(backends):  # run with what imports; say what is skipped
        warnings.warn(f"backends {missing} cannot be imported here and are left out of the space", stacklevel=2)
        backends = [b for b in backends if b not in missing]
    out: dict[str, list[GemmChoice]] = {}
    for role in ROLES:
        cs = registry.candidate_choices(tuple(backends), formats=tuple(formats),
                                        granularities=tuple(granularities), roles=(role,),
                                        roundings=None if roundings is None else tuple(roundings),
                                        device=device)
        out[role.value] = [c for c in cs if not c.is_bf16]
    if not any(out.values()):
        raise StudyError(
            f"no FP8 candidate: backends {list(backends)} implement none of formats {list(formats)}"
            f" x granularities {list(granularities)} x roundings {list(roundings or ['exact', 'pow2'])}"
            f"{'' if device is None else f' on {device}'}; widen [space] or pick other backends"
            f" (registered: {registry.list_backends()})")
    return out


def eligibility(choice: GemmChoice, role: GemmRole | str, site: Site, batch_size: int, *, align: int = 16,
                min_dim: int = 16, device: str = "cpu",
                supports: Callable[[GemmChoice, GemmRole, str, tuple[int, int, int]], str | None] | None = None,
                ) -> str | None:
    """``None`` if ``choice`` can run ``role`` of ``site`` at ``batch_size``, else the reason.

    FP8 needs K and N of at least ``min_dim`` and multiples of ``align`` (what real FP8
    kernels need for their 16-byte operand alignment); then the backend is asked
    (``supports``, default: the registry backend's ``supports``).
    """
    if choice.is_bf16:
        return None
    role = GemmRole(role)
    K, N = site.in_features, site.out_features
    if min(K, N) < min_dim:
        return f"K={K}, N={N} below min_dim={min_dim}"
    if K % align or N % align:
        return f"K={K}, N={N} not multiples of align={align}"
    shape = site.shape(role, batch_size)
    if supports is None:
        from loka_tune.kernels import registry

        return registry.get_backend(choice.backend).supports(choice, role, device=device, shape=shape)
    return supports(choice, role, device, shape)


def build_space(sites: Iterable[Site], candidates: Mapping[str, Sequence[GemmChoice]] | Sequence[GemmChoice], *, batch_size: int, align: int = 16,
                min_dim: int = 16, device: str = "cpu", per_role: bool = True,
                mods: Mapping[str, tuple[Any, ...]] | None = None,
                supports: Callable[..., str | None] | None = None) -> SearchSpace:
    """Per site x role, the candidates that pass :func:`eligibility` (bf16 first, always).

    ``candidates``: per role (what :func:`enumerate_candidates` returns) or one list for all roles.
    """
    if not isinstance(candidates, Mapping):
        candidates = {r.value: list(candidates) for r in ROLES}
    out = []
    for site in sites:
        choices: dict[str, tuple[str, ...]] = {}
        dropped: dict[str, dict[str, str]] = {}
        for role in ROLES:
            keep = [BF16_ID]
            why: dict[str, str] = {}
            for c in candidates.get(role.value, ()):
                reason = eligibility(c, role, site, batch_size, align=align, min_dim=min_dim, device=device,
                                     supports=supports)
                if reason is None:
                    keep.append(c.short_str())
                else:
                    why[c.short_str()] = f"ineligible: {reason}"
            choices[role.value] = tuple(keep)
            dropped[role.value] = why
        out.append(SiteChoices(site, choices, dropped))
    return SearchSpace(tuple(out), dict(mods or {}), per_role)


def _get(r: Any, name: str) -> Any:
    return r[name] if isinstance(r, Mapping) else getattr(r, name)


def prune_by_probe(space: SearchSpace, results: Iterable[Any], *, max_error: float, min_speedup: float = 1.0,
                   speedup: Callable[[Site, str, str], float] | None = None,
                   skipped: Iterable[Any] = (), unprobed: Iterable[str] = ()) -> SearchSpace:
    """Drop candidates the probe found unsafe (``mere > max_error``, or not finite) or slow.

    ``results``: the probe's ``CandidateResult`` objects (or dicts) with ``site``, ``role``,
    ``choice`` (short_str), ``mere`` and ``speedup``. ``speedup(site, role, choice)``, when
    given, replaces the probe's speed-up (e.g. the cost model at the batch size the study
    targets, when the probe timed another one). A candidate is slow when its speed-up is
    below ``min_speedup``. Candidates the probe did not measure are kept (only the speed
    rule applies to them), except those in ``skipped`` (the probe's ``SkippedCandidate``s)
    whose reason starts with ``"slow:"``: priced too slow before their error was measured
    (``measure(price_first=True)``). bf16 is never dropped. Sites in ``unprobed`` (the
    report's :attr:`~loka_tune.probe.ProbeReport.unprobed`: their statistics could not be
    formed) keep every candidate: nothing known there prunes anything.
    """
    unprobed = set(unprobed)
    by_key: dict[tuple[str, str, str], Any] = {}
    for r in results:
        by_key[(_get(r, "site"), str(_get(r, "role")), str(_get(r, "choice")))] = r
    slow = {(_get(s, "site"), str(_get(s, "role")), str(_get(s, "choice"))): str(_get(s, "reason"))
            for s in skipped if str(_get(s, "reason")).startswith("slow:")}
    out = []
    for sc in space.sites:
        if sc.name in unprobed:
            out.append(sc)
            continue
        choices: dict[str, tuple[str, ...]] = {}
        dropped = {r: dict(d) for r, d in sc.dropped.items()}
        errors: dict[str, dict[str, float]] = {}
        speeds: dict[str, dict[str, float]] = {}
        for role, ids in sc.choices.items():
            keep = []
            for cid in ids:
                if cid == BF16_ID:
                    keep.append(cid)
                    continue
                res = by_key.get((sc.name, role, cid))
                if res is None and (sc.name, role, cid) in slow:
                    dropped.setdefault(role, {})[cid] = slow[(sc.name, role, cid)]
                    continue
                err = float(_get(res, "mere")) if res is not None else None
                sp = speedup(sc.site, role, cid) if speedup is not None else (
                    float(_get(res, "speedup")) if res is not None else None)
                if err is not None:
                    errors.setdefault(role, {})[cid] = err
                if sp is not None:
                    speeds.setdefault(role, {})[cid] = float(sp)
                if err is not None and not (math.isfinite(err) and err <= max_error):
                    dropped.setdefault(role, {})[cid] = f"unsafe: error {err:.3g} > max_error {max_error}"
                elif sp is not None and not sp >= min_speedup:
                    dropped.setdefault(role, {})[cid] = f"slow: speed-up {sp:.3g} < min_speedup {min_speedup}"
                else:
                    keep.append(cid)
            choices[role] = tuple(keep)
        out.append(SiteChoices(sc.site, choices, dropped, errors, speeds))
    return replace(space, sites=tuple(out))


def tied_choices(sc: SiteChoices) -> tuple[str, ...]:
    """The choices a per-GEMM site of a tied space (one parameter for its three GEMMs) offers:
    those every role allows, in the forward's order."""
    common = set(sc.choices[ROLES[0].value])
    for r in ROLES[1:]:
        common &= set(sc.choices[r.value])
    return tuple(c for c in sc.choices[ROLES[0].value] if c in common)
