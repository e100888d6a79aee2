"""The enqueued starts: the trials a study runs before any sampled one, so that its answer is at
least as fast as the best named recipe that fits its budget.

Two phases (unless ``[trials] enqueue_starts = false``: then the sampler picks every trial):

1. At preparation (:func:`enqueue_mods_starts`): bf16 under each Mods set of
   :func:`mods_sets`, labelled ``"all-bf16"`` (no Mods) and ``"bf16+mods:<ModsConfig.short_str()>"``
   (e.g. ``"bf16+mods:nobias+bn256+hswish"``).
2. When the last of those has finished (:func:`enqueue_recipe_starts`, called by the loop
   before each ask), under the Mods of the fastest feasible one (none if none is feasible):

   - ``"tensorwise@filter"``, ``"tensorwise_fa@filter"`` and ``"rowwise@filter"``: e4m3
     tensorwise (fast accumulation in fwd, as torchao's) / tensorwise with fast accumulation in
     all three GEMMs / rowwise on the Linears that torchao's size filter converts
     (:data:`loka_tune.recipes.SIZE_FILTERS`), through our backends in the space (the first of
     ``[space] backends`` that offers the choice there);
   - ``"torchao:tensorwise@filter"`` and ``"torchao:rowwise@filter"``: the same through the
     ``torchao`` backend, when it is in the space (torchao's own recipes);
   - ``"dispatch"``: the Dispatch plan of the probe report (with the probe on).

   Only then are the best Mods known, so these are queued by the loop, not at preparation.
   The model's proposals follow them (:mod:`loka_tune.tuner.proposals`), under the same Mods.
   Their site choices are computed at preparation and stored with the study
   (:data:`ATTR_STARTS`, state ``"pending"``); queuing them sets the state to ``"done"``, so a
   resumed study (or a second worker) never queues them twice.

In the recipe space (the default) a start takes at each site the site's value of its recipe:
``tensorwise@filter`` the ``tensorwise`` value at the Linears torchao's filter keeps (bf16 where
the site has no such value, and at every other site; with the starts queued, the recipe space keeps
these values at those sites even where they price slow alone: ``select_recipes(keep=SIZE_FILTERS)``),
``rowwise@filter`` likewise, ``dispatch``
the ``dispatch`` value everywhere; a recipe that no site has a value of is no start there. The
torchao starts are not queued there: each site's recipe
value is already the one of its backends (torchao among them, when in the space) that prices
fastest, so they would repeat ours. In the per-GEMM space (``[space] per_gemm = true``) each
recipe is mapped into the pruned space per site and GEMM: a choice the space lacks there is
bf16 (as :func:`~loka_tune.space.encode.params_from_config` does). A start whose parameters
repeat an earlier start's is dropped from the list; one that repeats an earlier trial's is not queued (``skip_if_exists``); one whose config trains as an
earlier one's (:func:`~loka_tune.tuner.runkey.run_key`: under the ``fp8_chain`` Mod ``tensorwise@filter``
and ``tensorwise_fa@filter``, whose sites all chain) is a cache copy, which does not count toward ``n_trials``. The label is the
trial's user attribute ``seeded``: the leaderboard's note and the MLflow tag show it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from loka_tune.config import ModsConfig
from loka_tune.recipes import DISPATCH, SIZE_FILTERS
from loka_tune.space.candidates import BF16_ID, SearchSpace, SiteChoices
from loka_tune.space.encode import mods_from_params, params_from_config, params_picking
from loka_tune.space.recipe_space import recipe_gemm
from loka_tune.tuner.log import log
from loka_tune.tuner.results import TrialRecord

__all__ = ["ATTR_STARTS", "mods_sets", "recipe_starts", "enqueue_mods_starts", "enqueue_recipe_starts"]

#: the recipes started on torchao's size-filter sites through our backends, in queue order
FILTER_RECIPES: tuple[str, ...] = ("tensorwise", "tensorwise_fa", "rowwise")
#: the same through the torchao backend: torchao's own recipes (it has no tensorwise_fa)
TORCHAO_FILTER_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise")
ATTR_STARTS = "loka.starts"  # study user attr: the recipe starts waiting for the best Mods, and their state
BF16_LABEL = "all-bf16"


def mods_sets(space: SearchSpace) -> list[dict[str, Any]]:
    """The Mods parameters of the bf16 starts: every Mod off, then every Mod of the space on.

    Two sets, not one per subset: each Mod is there to make the step faster (no bias: one add
    less; BlockNorm and Hard Swish: cheaper normalisation and activation; padding: aligned
    GEMMs; the fused epilogue: one kernel less), so with all of them on bf16 is at its fastest,
    and with none it is the reference the budget is measured against. When all-on breaks the
    budget the recipes run without Mods, and the sampler searches the Mods dimensions anyway.
    One more start per Mod (each alone, or all but one) would cost a trial each: a sixth of a
    12-trial budget for two Mods. "On" is a Mod's first setting after off (the first of
    ``[space] blocknorm_sizes`` and ``pad_multiples``).
    """
    dims = {k: v for k, v in space.mods.items() if len(v) > 1}
    off = {k: v[0] for k, v in dims.items()}
    on = {k: v[1] for k, v in dims.items()}
    return [off] if on == off else [off, on]


def mods_label(params: Mapping[str, Any]) -> str:
    mods = mods_from_params(params)
    return BF16_LABEL if mods == ModsConfig() else f"bf16+mods:{mods.short_str()}"


def _recipe_pick(recipe: str, backends: Sequence[str], size_filter: Any) -> Any:
    """A ``params_picking`` rule: the recipe's choice at the Linears ``size_filter`` keeps, else bf16.

    Per-GEMM space: the first backend of ``backends`` whose choice for ``recipe`` the space has
    at that GEMM (:func:`~loka_tune.space.recipe_space.recipe_gemm`: e4m3 of the recipe's
    granularity, then its scale rounding and torchao's fast accumulation, on in fwd and off in the
    gradients' GEMMs unless the recipe has it everywhere, where the space has them). Recipe space: the site's value of ``recipe``.
    """
    def pick(sc: SiteChoices, role: str, choices: tuple[str, ...]) -> str:
        if not size_filter.keeps(sc.site.in_features, sc.site.out_features):
            return BF16_ID
        if role == "site":
            return sc.recipes.get(recipe, BF16_ID)
        for be in backends:
            cid = recipe_gemm(choices, recipe, role, be)
            if cid != BF16_ID:
                return cid
        return BF16_ID

    return pick


class _KeepAll:
    """The size filter of the ``dispatch`` start: every site (Dispatch chose per GEMM already)."""

    def keeps(self, in_features: int, out_features: int) -> bool:
        return True


def recipe_starts(space: SearchSpace, backends: Sequence[str], report: Any = None, *,
                  max_error: float = 0.2, min_speedup: float = 1.0) -> list[tuple[str, dict[str, Any]]]:
    """The recipe starts' parameters in ``space`` (label, params; every Mod off, the loop sets
    the best ones): see the module's docstring. ``backends``: ``[space] backends`` in order."""
    if not space.per_gemm:
        out = [(f"{name}@filter", params_picking(space, _recipe_pick(name, backends, SIZE_FILTERS[name])))
               for name in FILTER_RECIPES if any(name in sc.recipes for sc in space.sites)]
        if any(DISPATCH in sc.recipes for sc in space.sites) or report is not None:
            out.append(("dispatch", params_picking(space, _recipe_pick(DISPATCH, backends, _KeepAll()))))
        return _unique(out)
    ours = [b for b in backends if b not in ("torchao", "bf16")]
    out = []
    for prefix, bes in (("", ours), ("torchao:", ["torchao"] if "torchao" in backends else [])):
        if not bes:
            continue
        for name in (FILTER_RECIPES if not prefix else TORCHAO_FILTER_RECIPES):
            out.append((f"{prefix}{name}@filter", params_picking(space, _recipe_pick(name, bes, SIZE_FILTERS[name]))))
    if report is not None:
        from loka_tune.dispatch import build_plan

        plan = build_plan(report, max_error=max_error, min_speedup=min_speedup)
        out.append(("dispatch", params_from_config(space, plan)[0]))
    return _unique(out)


def _unique(starts: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """``starts`` less those whose parameters repeat an earlier one's (``tensorwise_fa@filter``
    where the space offers no fast accumulation in the gradients' GEMMs is ``tensorwise@filter``)."""
    seen: list[dict[str, Any]] = []
    out = []
    for label, params in starts:
        if params not in seen:
            seen.append(params)
            out.append((label, params))
    return out


def enqueue_mods_starts(study: Any, space: SearchSpace, recipes: list[tuple[str, dict[str, Any]]]) -> None:
    """Phase 1 (at preparation): queue bf16 under each Mods set, and store the recipe starts for
    :func:`enqueue_recipe_starts`."""
    labels = []
    for mods in mods_sets(space):
        label = mods_label(mods)
        study.enqueue_trial(params_picking(space, lambda sc, r, ch: BF16_ID, mods=mods),
                            user_attrs={"seeded": label}, skip_if_exists=True)
        labels.append(label)
    study.set_user_attr(ATTR_STARTS, {"state": "pending", "mods_labels": labels,
                                      "recipes": [[label, params] for label, params in recipes]})


def _best_mods_start(trials: Sequence[Any], labels: set[str]) -> Any:
    """The fastest feasible finished bf16 + Mods start (None: none is feasible)."""
    ok = [t for t in trials if t.user_attrs.get("seeded") in labels and t.state.name == "COMPLETE"
          and TrialRecord.of(t).feasible and t.value is not None]
    return min(ok, key=lambda t: (t.value, t.number)) if ok else None


def enqueue_recipe_starts(study: Any) -> bool:
    """Phase 2 (the loop, before each ask): once every bf16 + Mods start has finished, queue the
    recipe starts under the best one's Mods, once. Returns True when the caller should wait
    instead of asking (a bf16 + Mods start still runs in another worker and nothing is queued:
    an ask now would sample a trial before the recipes)."""
    from optuna.trial import TrialState

    info = study.user_attrs.get(ATTR_STARTS)
    if not info or info.get("state") != "pending":
        return False
    labels = set(info["mods_labels"])
    trials = study.get_trials(deepcopy=False)
    if any(t.user_attrs.get("seeded") in labels and t.state in (TrialState.WAITING, TrialState.RUNNING)
           for t in trials):
        return not any(t.state == TrialState.WAITING for t in trials)
    best = _best_mods_start(trials, labels)
    mods = {k: v for k, v in best.params.items() if k.startswith("mods.")} if best is not None else {}
    under = mods_from_params(mods).short_str()
    for label, params in info["recipes"]:
        study.enqueue_trial({**params, **mods}, user_attrs={"seeded": label}, skip_if_exists=True)
    study.set_user_attr(ATTR_STARTS, {**info, "state": "done", "under": under, "mods": mods,
                                      "under_trial": None if best is None else best.number})
    why = f"trial {best.number}'s, the fastest feasible" if best is not None else "none: no bf16 + Mods start is feasible"
    log(f"[loka-tune] starts: {len(info['recipes'])} recipe(s) queued under Mods {under!r} ({why})")
    return False
