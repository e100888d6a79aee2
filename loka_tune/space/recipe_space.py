"""The recipe space, a study's default: per site a few whole-site recipes instead of per-GEMM choices.

Why: the per-GEMM space of a large model has one categorical parameter per site x GEMM with up to
~17 choices each (69 parameters on Wukong large); a dozen trials cannot cover it, and the random
draws of TPE's first trials put FP8 on GEMMs too small to gain (0.43x on an H200). Here each site
has one parameter (``"<site>@site"``) whose values are :meth:`SitePrecision.short_str` strings:

- ``bf16``, always, first;
- ``tensorwise``, ``tensorwise_fa`` (fast accumulation in all three GEMMs), ``rowwise``,
  ``rowwise_with_gw_hp`` (rowwise fwd and dgrad, wgrad in bf16): the uniform recipes of
  :data:`loka_tune.recipes.RECIPES`, each GEMM as the nearest choice the pruned per-GEMM space
  keeps there (:func:`recipe_gemm`: e4m3 of the recipe's granularity on that backend, the
  recipe's scale rounding and torchao's fast accumulation, on in fwd and off in the gradients
  unless the recipe asks for it everywhere, where offered; a GEMM the space lacks it for is bf16);
- ``dispatch``: the Dispatch plan's per-GEMM choice at this site (from the probe report), each
  GEMM likewise bf16 where the space lacks it.

Stages (as the per-GEMM space's: enumerate, price, select):

1. :func:`recipe_candidates`: per site, every recipe through every backend of ``[space]
   backends`` (``"<recipe>.<backend>"``) and ``"dispatch"``, as site values;
2. the caller prices every candidate value (``loka_tune.tuner.prepare._site_prices``: seconds per
   step saved against the site in bf16, measured on a GPU or modeled);
3. :func:`select_recipes`: per recipe the backend with the largest saving; a recipe that is bf16
   at every GEMM, is not priced, or (unless ``keep_slow``) saves nothing, is dropped
   (:attr:`SiteChoices.recipe_dropped` says why), except at a site its size filter in ``keep``
   takes: the study's recipe starts (``tensorwise@filter``, ...) are the named recipes on all of
   torchao's filter sites, also where a site priced alone saves nothing (a Mod such as
   ``fp8_chain`` changes what a site costs, and the price of a Linear alone does not see it);
   one whose value repeats an earlier recipe's
   names the same value (:attr:`SiteChoices.recipes` maps both names to it; the parameter lists
   it once). At most six values per site; a site left with bf16 only gets no parameter.

The space is plain data (:class:`SearchSpace` with ``per_gemm=False``), stored in the study with
its prices, so every worker and every resume decodes trials and reads the prices the same way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from loka_tune.config import ROLES, Format, GemmChoice, PrecisionConfig, SitePrecision
from loka_tune.recipes import DISPATCH, RECIPES, SizeFilter
from loka_tune.space.candidates import BF16_ID, SearchSpace, SiteChoices

__all__ = ["SITE_RECIPES", "UNIFORM_RECIPES", "recipe_gemm", "site_recipe", "recipe_candidates", "select_recipes",
           "space_table"]

#: the uniform recipes a site chooses among (besides bf16), in the order its values list them
UNIFORM_RECIPES: tuple[str, ...] = ("tensorwise", "tensorwise_fa", "rowwise", "rowwise_with_gw_hp")
#: every recipe of a site's parameter, bf16 first
SITE_RECIPES: tuple[str, ...] = ("bf16", *UNIFORM_RECIPES, DISPATCH)


def recipe_gemm(choices: Sequence[str], recipe: str, role: str, backend: str) -> str:
    """The choice id ``recipe`` takes at one GEMM (``role``; ``"all"`` in a tied space reads as
    fwd) through ``backend``, among that GEMM's surviving ``choices``; ``"bf16"`` where none fits.

    The recipe's choice (:data:`loka_tune.recipes.RECIPES`) fixes the formats, the granularity
    and the backend; among the choices that match those, the recipe's scale rounding comes first,
    then torchao's fast accumulation (on in fwd, off in the gradients' GEMMs), or fast
    accumulation everywhere when the recipe's choice has it (``tensorwise_fa``).
    """
    r = "fwd" if role == "all" else role
    target = SitePrecision.parse(RECIPES[recipe].format(backend=backend), key="recipe")[r]
    if target.is_bf16:
        return BF16_ID
    fits = [c for c in choices if c != BF16_ID and _same_kind(GemmChoice.parse(c), target)]
    if not fits:
        return BF16_ID
    fa = target.fast_accum or r == "fwd"

    def rank(cid: str) -> tuple[bool, bool]:
        c = GemmChoice.parse(cid)
        return (c.rounding != target.rounding, c.fast_accum != fa)

    return min(fits, key=rank)


def _same_kind(c: GemmChoice, target: GemmChoice) -> bool:
    return (c.a_format == target.a_format == Format.E4M3 and c.b_format == target.b_format
            and c.granularity == target.granularity and c.backend == target.backend)


def site_recipe(sc: SiteChoices, recipe: str, backend: str) -> str:
    """``recipe`` through ``backend`` at site ``sc``, as its value (a SitePrecision short_str)."""
    return SitePrecision(*(GemmChoice.parse(recipe_gemm(sc.choices[r.value], recipe, r.value, backend))
                           for r in ROLES)).short_str()


def _dispatch_value(sc: SiteChoices, plan: PrecisionConfig) -> str:
    prec = plan.resolve(sc.name)
    ids = [prec[r].short_str() if prec[r].short_str() in sc.choices[r.value] else BF16_ID for r in ROLES]
    return SitePrecision(*(GemmChoice.parse(i) for i in ids)).short_str()


def recipe_candidates(space: SearchSpace, backends: Sequence[str],
                      dispatch: PrecisionConfig | None = None) -> SearchSpace:
    """The recipe space before pricing: per site every candidate value, by label
    (``"<recipe>.<backend>"`` for each recipe of :data:`UNIFORM_RECIPES` x each FP8 backend of
    ``backends``, and ``"dispatch"`` with a Dispatch ``plan``; bf16 first as ``"bf16"``).

    ``space`` is the pruned per-GEMM space (its choices are kept beside the values: the probe's
    errors live there). Candidates that are bf16 at every GEMM are left out here already.
    """
    fp8 = [b for b in dict.fromkeys(backends) if b != "bf16"]
    sites = []
    for sc in space.sites:
        cands: dict[str, str] = {"bf16": BF16_ID}
        for recipe in UNIFORM_RECIPES:
            for be in fp8:
                v = site_recipe(sc, recipe, be)
                if v != BF16_ID:
                    cands[f"{recipe}.{be}"] = v
        if dispatch is not None:
            v = _dispatch_value(sc, dispatch)
            if v != BF16_ID:
                cands[DISPATCH] = v
        sites.append(replace(sc, recipes=cands, prices={}, recipe_dropped={}))
    return replace(space, sites=tuple(sites), per_gemm=False, price_source=None)


def select_recipes(candidates: SearchSpace, prices: Mapping[str, Mapping[str, float]], *, source: str,
                   keep_slow: bool = False, keep: Mapping[str, SizeFilter] | None = None) -> SearchSpace:
    """The recipe space: per site and recipe the priced candidate that saves most (see the module).

    ``prices[site][value]``: seconds per step a value saves against the site in bf16 (what
    ``_site_prices`` returns for ``candidates``). ``source``: ``"modeled"`` or ``"measured"``.
    ``keep_slow``: keep values that save nothing (``[probe] min_speedup < 1`` asks to explore them).
    ``keep``: recipe name -> size filter; a priced value of that recipe is kept at the sites the
    filter takes even when it saves nothing (the study passes :data:`loka_tune.recipes.SIZE_FILTERS`
    when it queues the recipe starts, so that each start is its whole recipe).
    """
    sites = []
    for sc in candidates.sites:
        priced = prices.get(sc.name, {})
        values: dict[str, str] = {"bf16": BF16_ID}
        kept_prices: dict[str, float] = {BF16_ID: 0.0}
        dropped: dict[str, str] = {}
        for recipe in (*UNIFORM_RECIPES, DISPATCH):
            labels = [k for k in sc.recipes if k == recipe or k.startswith(recipe + ".")]
            if not labels:
                dropped[recipe] = "bf16 at every GEMM here (the pruned space has none of its choices)"
                continue
            options = [(sc.recipes[k], priced.get(sc.recipes[k])) for k in labels]
            fin = [(v, p) for v, p in options if p is not None and math.isfinite(p)]
            if not fin:
                dropped[recipe] = f"not priced ({', '.join(v for v, _ in options)})"
                continue
            value, saved = max(fin, key=lambda vp: vp[1])  # the first backend on a tie
            if value in kept_prices:  # the value of an earlier recipe too: one value, two names
                values[recipe] = value
            elif not (saved > 0 or keep_slow or _kept(keep, recipe, sc)):
                dropped[recipe] = f"slow: {value} saves {saved:.3g} s per step (<= 0)"
            else:
                values[recipe] = value
                kept_prices[value] = float(saved)
        sites.append(replace(sc, recipes=values, prices=kept_prices, recipe_dropped=dropped))
    return replace(candidates, sites=tuple(sites), per_gemm=False, price_source=source)


def _kept(keep: Mapping[str, SizeFilter] | None, recipe: str, sc: SiteChoices) -> bool:
    """Whether ``keep`` asks for ``recipe`` at site ``sc`` whatever its price."""
    f = (keep or {}).get(recipe)
    return f is not None and f.keeps(sc.site.in_features, sc.site.out_features)


def space_table(space: SearchSpace) -> str:
    """A recipe space as text: per site with a parameter, each value's saving per step (the
    recipes' names, the value, the price), for ``loka-tune report`` and the tune log."""
    if space.per_gemm:
        return "space: per GEMM ([space] per_gemm = true): no recipe values, no prices"
    with_param = [sc for sc in space.sites if len(sc.values) > 1]
    lines = [f"space: recipes per site, prices {space.price_source} (seconds saved per step vs the site in bf16);"
             f" {len(with_param)} of {len(space.sites)} sites have a parameter"]
    for sc in with_param:
        parts = []
        for v in sc.values[1:]:
            names = "=".join(n for n, x in sc.recipes.items() if x == v)
            price = sc.prices.get(v)
            slow = price is not None and float(price) <= 0
            parts.append(f"{names} {v} {_saved(price)}" + (" (kept, though slow priced alone)" if slow else ""))
        lines.append(f"  {sc.name} ({sc.site.in_features}x{sc.site.out_features}): " + "; ".join(parts))
    return "\n".join(lines)


def _saved(x: Any) -> str:
    return "unpriced" if x is None else f"{float(x) * 1e3:+.4g} ms"
