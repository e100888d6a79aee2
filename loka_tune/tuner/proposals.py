"""The model's proposals: the frontier of the additive model under the loss budget, as enqueued trials.

In a recipe space (the default; not with ``[space] per_gemm = true``) and with ``[trials]
enqueue_starts`` on, the loop calls :func:`enqueue_proposals` before each ask, after
:func:`~loka_tune.tuner.starts.enqueue_recipe_starts`:

1. Once the recipe starts are queued and have all finished (they calibrate the model), the
   model (:class:`loka_tune.space.model.AdditiveModel`) is fitted to every finished trial and
   its frontier under the Mods of the recipe starts (the fastest feasible bf16 + Mods start's)
   is queued at each capacity of :func:`capacities`: the config of largest predicted saving
   whose predicted relative log loss is within the budget less the noise floor (a measurement
   lands anywhere within the floor), then within :data:`MARGINS` of the budget (safer, should
   the model underestimate the loss).
2. After that, before each ask with nothing queued: the model is fitted again and its frontier
   at the first capacity is queued when it is new.

A point is queued only when its config was never tried (by any trial, in any state) and its
predicted step time beats the best feasible trial so far: when the model has nothing better to
offer, the sampler (TPE over the recipe space) asks, around the frontier the trials so far have
mapped. TPE rather than Optuna's GPSampler: on the binding space of
``benchmarks/search_efficiency.py`` both reached the same best after the proposals in every
seed, GPSampler at ~100x the sampler time (``benchmarks/results/search_efficiency.md``). Labels: ``seeded`` = ``"model:<k>"`` (k = 1, 2, ...), shown by the leaderboard and
MLflow like the starts'; the trial also carries the prediction (``model_step_s``,
``model_rel_pct``). The last fit (alpha, beta, how many trials each rests on, the proposals so
far) is the study's user attribute :data:`ATTR_MODEL`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from loka_tune.space.candidates import BF16_ID, SearchSpace
from loka_tune.space.encode import SITE, config_from_params, mods_from_params, param_name
from loka_tune.space.model import AdditiveModel, Observation
from loka_tune.tuner.log import log
from loka_tune.tuner.results import TrialRecord
from loka_tune.tuner.starts import ATTR_STARTS

__all__ = ["ATTR_MODEL", "MARGINS", "capacities", "observations", "enqueue_proposals", "model_line"]

ATTR_MODEL = "loka.model"  # study user attr: the model's last fit and how many points it proposed
#: the conservative frontier points' fractions of the loss budget (besides the budget less the floor)
MARGINS: tuple[float, ...] = (0.5, 0.25)


def capacities(budget_pct: float, noise_pct: float) -> list[float]:
    """The relative log losses (percent) the first frontier points may predict: the budget less
    the noise floor (at least half the budget), then :data:`MARGINS` of the budget."""
    out = [max(budget_pct - noise_pct, MARGINS[0] * budget_pct)]
    for m in MARGINS:
        if m * budget_pct < out[-1]:
            out.append(m * budget_pct)
    return out


def _values(space: SearchSpace, params: Mapping[str, Any]) -> dict[str, str]:
    return {sc.name: params.get(param_name(sc.name, SITE), BF16_ID) for sc in space.sites if len(sc.values) > 1}


def observations(space: SearchSpace, trials: Sequence[Any]) -> list[Observation]:
    """The finished trials (completed or pruned, not cache copies) as the model reads them."""
    out = []
    for t in trials:
        if t.state.name not in ("COMPLETE", "PRUNED"):
            continue
        r = TrialRecord.of(t)
        if r.cache_hit:
            continue
        out.append(Observation(_values(space, t.params), mods_from_params(t.params).short_str(), t.state.name,
                               t.value if t.state.name == "COMPLETE" else None, r.mods_step_time_s,
                               r.rel_logloss_pct))
    return out


def _tried(space: SearchSpace, trials: Sequence[Any]) -> set[str]:
    keys = set()
    for t in trials:
        k = t.user_attrs.get("config_key")
        if k is None:  # queued, not started yet: decode its parameters
            k = config_from_params(space, t.system_attrs.get("fixed_params", t.params)).key()
        keys.add(k)
    return keys


def _under(space: SearchSpace, starts: Mapping[str, Any], trials: Sequence[Any],
           base_s: float) -> tuple[dict[str, Any], float]:
    """The Mods parameters the recipe starts ran under (every Mods dimension: off where no bf16 +
    Mods start was feasible), and bf16's step time with them."""
    n = starts.get("under_trial")
    best = next((t for t in trials if n is not None and t.number == n), None)
    mods = starts.get("mods")
    if mods is None:  # stored before the key: the best bf16 + Mods start's
        mods = {k: v for k, v in best.params.items() if k.startswith("mods.")} if best is not None else {}
    off = {k: v[0] for k, v in space.mods.items() if len(v) > 1}
    ref = float(best.value) if best is not None and best.value is not None else base_s
    return {**off, **mods}, ref


def enqueue_proposals(study: Any, space: SearchSpace, *, budget_pct: float, base_s: float,
                      unmeasured_error: float, noise_pct: float = 0.0) -> bool:
    """Queue the model's frontier points (see the module). Returns True when the caller should
    wait instead of asking: the first proposals wait for the recipe starts, which run elsewhere.
    ``base_s``: the baseline's step time; ``unmeasured_error``: the sensitivity of a GEMM choice
    the probe did not measure (``[probe] max_error``); ``noise_pct``: the baseline's noise floor."""
    from optuna.trial import TrialState

    if space.per_gemm:
        return False
    starts = study.user_attrs.get(ATTR_STARTS)
    if not starts or starts.get("state") != "done":
        return False
    trials = study.get_trials(deepcopy=False)
    if any(t.state == TrialState.WAITING for t in trials):  # the queue goes first
        return False
    state = dict(study.user_attrs.get(ATTR_MODEL) or {})
    if not state and any(t.state == TrialState.RUNNING and t.user_attrs.get("seeded") for t in trials):
        return True
    mods, ref = _under(space, starts, trials, base_s)
    under = mods_from_params(mods).short_str()
    model = AdditiveModel(space, unmeasured_error=unmeasured_error).fit(
        observations(space, trials), budget_pct=budget_pct, noise_pct=noise_pct)
    feasible = [t.value for t in trials if t.state == TrialState.COMPLETE and t.value is not None
                and TrialRecord.of(t).feasible]
    best = min(feasible) if feasible else None
    tried = _tried(space, trials)
    proposed = int(state.get("proposed", 0))
    queued = []
    caps = capacities(budget_pct, noise_pct)
    for cap in caps if not state else caps[:1]:
        values = model.frontier(cap - model.mods_rel.get(under, 0.0))
        params = {**{param_name(s, SITE): v for s, v in values.items()}, **mods}
        key = config_from_params(space, params).key()
        pred_s, pred_rel = model.predict_step(values, ref), model.predict_rel(values, under)
        if key in tried or (best is not None and not pred_s < best):
            continue
        proposed += 1
        label = f"model:{proposed}"
        study.enqueue_trial(params, user_attrs={"seeded": label, "model_step_s": pred_s, "model_rel_pct": pred_rel})
        tried.add(key)
        queued.append(f"{label} (within {cap:.3g}%: predicted {ref / pred_s:.3f}x vs bf16+Mods, relLL"
                      f" {pred_rel:+.3f}%)")
    study.set_user_attr(ATTR_MODEL, {**model.to_dict(), "proposed": proposed, "fits": int(state.get("fits", 0)) + 1,
                                     "under": under})
    if queued or not state:
        log(f"[loka-tune] model: alpha {model.alpha:.3g}%/MERE ({model.n_alpha} trials), beta {model.beta:.3g}"
             f" ({model.n_beta} trials); " + ("queued " + ", ".join(queued) if queued
                                              else "no untried point predicted faster than the best trial"))
    return False


def model_line(study_attrs: Mapping[str, Any]) -> str | None:
    """The model's last fit as one line (for ``loka-tune report``); None if it never ran."""
    m = study_attrs.get(ATTR_MODEL)
    if not m:
        return None
    return (f"model: {m.get('proposed', 0)} proposal(s) ('model:<k>') under Mods {m.get('under')!r}; last fit (of"
            f" {m.get('fits', 0)}): alpha {float(m['alpha']):.3g}% relLL per unit MERE ({m.get('n_alpha', 0)} trials),"
            f" beta {float(m['beta']):.3g} x the priced savings ({m.get('n_beta', 0)} trials)")
