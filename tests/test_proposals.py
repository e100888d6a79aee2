"""The recipe space's starts and the model's proposals (issue 21, point 3): the recipe starts take
each site's recipe value; after them the additive model's frontier under the budget is queued
("model:<k>"), refitted after each trial, never a config already tried, only when predicted to beat
the best trial; nothing of it in a per-GEMM space."""

from __future__ import annotations

import optuna
import pytest

from loka_tune.config import SitePrecision
from loka_tune.space.candidates import BF16_ID, SearchSpace, SiteChoices
from loka_tune.space.encode import config_from_params, distributions
from loka_tune.space.model import sensitivity
from loka_tune.space.sites import Site
from loka_tune.tuner.proposals import ATTR_MODEL, MARGINS, capacities, enqueue_proposals
from loka_tune.tuner.starts import enqueue_mods_starts, enqueue_recipe_starts, recipe_starts

ROLES = ("fwd", "dgrad", "wgrad")
T = "e4m3.tensor.fa.torch_scaled_mm|e4m3.tensor.torch_scaled_mm|e4m3.tensor.torch_scaled_mm"
R = "e4m3.row.pow2.fa.torch_scaled_mm|e4m3.row.pow2.torch_scaled_mm|e4m3.row.pow2.torch_scaled_mm"
RG = "e4m3.row.pow2.fa.torch_scaled_mm|e4m3.row.pow2.torch_scaled_mm|bf16"
D = "e4m3.row.torch_scaled_mm|e4m3.tensor.torch_scaled_mm|bf16"


def _site(name: str, in_f: int, out_f: int, prices: dict[str, float], err: float) -> SiteChoices:
    names = {T: "tensorwise", R: "rowwise", RG: "rowwise_with_gw_hp", D: "dispatch"}
    ids = {c for v in prices for c in v.split("|")} - {BF16_ID}
    return SiteChoices(Site(name, in_f, out_f, 1.0), {r: (BF16_ID, *sorted(ids)) for r in ROLES},
                       error={r: dict.fromkeys(ids, err) for r in ROLES},
                       recipes={"bf16": BF16_ID, **{names[v]: v for v in prices}},
                       prices={BF16_ID: 0.0, **prices})


# seconds saved per step; "big" saves most and is sensitive, "wide" is cheap in loss
SPACE = SearchSpace(sites=(
    _site("big", 8192, 8192, {T: 3e-3, R: 4e-3, RG: 3.5e-3, D: 4.2e-3}, 0.15),
    _site("wide", 8192, 2048, {T: 1e-3, R: 1.2e-3, D: 1.3e-3}, 0.02),
    _site("small", 512, 512, {T: 1e-4}, 0.05),
), mods={"mods.no_bias": (False, True)}, per_gemm=False, price_source="modeled")
BASE_S, NOBIAS_S = 0.1, 0.09
ALPHA_TRUE, BUDGET = 0.5, 0.4


def test_recipe_starts_take_each_sites_recipe_value() -> None:
    starts = dict(recipe_starts(SPACE, ["torch_scaled_mm", "torchao"]))
    assert list(starts) == ["tensorwise@filter", "rowwise@filter", "dispatch"]  # no torchao starts here
    tw, rw, d = starts["tensorwise@filter"], starts["rowwise@filter"], starts["dispatch"]
    assert (tw["big@site"], tw["wide@site"], tw["small@site"]) == (T, T, BF16_ID)  # torchao's tensorwise filter
    assert (rw["big@site"], rw["wide@site"], rw["small@site"]) == (R, BF16_ID, BF16_ID)  # ... and rowwise's
    assert (d["big@site"], d["wide@site"], d["small@site"]) == (D, D, BF16_ID)  # small has no dispatch value
    assert all(p["mods.no_bias"] is False for p in starts.values())


def _finish(study: optuna.Study, trial: optuna.trial.Trial) -> None:
    """A modeled world: step = bf16 + Mods - the prices, relLL = the Mods' 0.1% + ALPHA_TRUE x sum MERE."""
    from loka_tune.tuner.results import within_budget

    params = trial.params
    nobias = params.get("mods.no_bias", False)
    ref = NOBIAS_S if nobias else BASE_S
    saved = sens = 0.0
    for sc in SPACE.sites:
        v = params.get(f"{sc.name}@site", BF16_ID)
        saved += sc.prices.get(v, 0.0)
        sens += sensitivity(sc, v, 0.2) if v != BF16_ID else 0.0
    rel = (0.1 if nobias else 0.0) + ALPHA_TRUE * sens
    step = ref - saved
    cfg = config_from_params(SPACE, params)
    for k, v in {"config_key": cfg.key(), "rel_logloss_pct": rel, "budget_pct": BUDGET, "step_time_s": step,
                 "mods_step_time_s": ref, "feasible": within_budget(rel, BUDGET), "cache_hit": False}.items():
        trial.set_user_attr(k, v)
    study.tell(trial, step)


def _propose(study: optuna.Study, space: SearchSpace = SPACE) -> bool:
    return enqueue_proposals(study, space, budget_pct=BUDGET, base_s=BASE_S, unmeasured_error=0.2)


def _run_starts(study: optuna.Study) -> None:
    dists = distributions(SPACE)
    enqueue_mods_starts(study, SPACE, recipe_starts(SPACE, ["torch_scaled_mm"]))
    for _ in range(2):
        _finish(study, study.ask(fixed_distributions=dists))
    assert not enqueue_recipe_starts(study)


def test_proposals_follow_the_recipe_starts_under_their_mods() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study()
    dists = distributions(SPACE)
    assert not _propose(study)  # no starts yet: nothing to do
    _run_starts(study)
    assert not _propose(study) and ATTR_MODEL not in study.user_attrs  # the recipe starts are queued: first them
    running = study.ask(fixed_distributions=dists)
    waiting = [study.ask(fixed_distributions=dists) for _ in range(2)]
    assert _propose(study)  # the starts run (elsewhere): the first proposals wait for them
    for t in (running, *waiting):
        _finish(study, t)
    assert not _propose(study)
    queued = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    labels = [t.user_attrs["seeded"] for t in queued]
    assert labels == [f"model:{i + 1}" for i in range(len(labels))] and 1 <= len(labels) <= len(MARGINS) + 1
    info = study.user_attrs[ATTR_MODEL]
    assert info["proposed"] == len(labels) and info["n_alpha"] == 3 and info["beta"] == pytest.approx(1.0)
    assert info["alpha"] == pytest.approx(ALPHA_TRUE)  # the world is additive: the fit recovers it
    assert info["under"] == "nobias"  # the faster feasible bf16 + Mods start's (0.1% < budget)
    first = queued[0].system_attrs["fixed_params"]
    assert first["mods.no_bias"] is True
    # the frontier within the budget (no noise floor here): predicted within it
    assert queued[0].user_attrs["model_rel_pct"] <= BUDGET + 1e-12
    assert queued[0].user_attrs["model_step_s"] == pytest.approx(
        NOBIAS_S - sum(sc.prices[first[f"{sc.name}@site"]] for sc in SPACE.sites))
    keys = [config_from_params(SPACE, t.system_attrs["fixed_params"]).key() for t in queued]
    tried = {t.user_attrs["config_key"] for t in study.get_trials() if "config_key" in t.user_attrs}
    assert len(set(keys)) == len(keys) and not set(keys) & tried  # each new, none tried
    # a queued trial goes first: nothing more now
    assert not _propose(study) and len(study.get_trials(states=(optuna.trial.TrialState.WAITING,))) == len(keys)
    for _ in keys:
        _finish(study, study.ask(fixed_distributions=dists))
    # refitted after each trial; a new point only when it is untried and predicted to beat the best
    _propose(study)
    again = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    best = min(t.value for t in study.get_trials() if t.user_attrs.get("feasible"))
    for t in again:
        assert t.user_attrs["model_step_s"] < best and t.user_attrs["seeded"] == f"model:{len(keys) + 1}"
    assert study.user_attrs[ATTR_MODEL]["fits"] >= 2


def test_the_best_feasible_config_is_found_by_the_proposals() -> None:
    """In this additive world the proposals reach the exact optimum under the budget (found by
    enumerating every config), with the starts and at most len(MARGINS) + 2 proposals."""
    import itertools

    study = optuna.create_study()
    dists = distributions(SPACE)
    _run_starts(study)
    for _ in range(20):
        if _propose(study):
            raise AssertionError("nothing runs elsewhere: no reason to wait")
        if not study.get_trials(states=(optuna.trial.TrialState.WAITING,)):
            break
        _finish(study, study.ask(fixed_distributions=dists))
    n_model = sum(1 for t in study.get_trials() if str(t.user_attrs.get("seeded", "")).startswith("model:"))
    assert 1 <= n_model <= len(MARGINS) + 3
    found = min(t.value for t in study.get_trials() if t.user_attrs["feasible"])
    best = None
    for combo in itertools.product(*(sc.values for sc in SPACE.sites)):
        for nobias in (False, True):
            sens = sum(sensitivity(sc, v, 0.2) for sc, v in zip(SPACE.sites, combo) if v != BF16_ID)
            rel = (0.1 if nobias else 0.0) + ALPHA_TRUE * sens
            step = (NOBIAS_S if nobias else BASE_S) - sum(sc.prices[v] for sc, v in zip(SPACE.sites, combo))
            if rel <= BUDGET and (best is None or step < best):
                best = step
    assert found == pytest.approx(best, rel=1e-12)


def test_capacities_leave_the_noise_floor_out_of_the_budget() -> None:
    assert capacities(1.0, 0.43) == pytest.approx([0.57, 0.5, 0.25])
    assert capacities(0.5, 0.029) == pytest.approx([0.471, 0.25, 0.125])
    assert capacities(1.0, 0.9) == pytest.approx([0.5, 0.25])  # at least half the budget, no repeat
    assert capacities(1.0, 0.0) == pytest.approx([1.0, 0.5, 0.25])


def test_no_proposals_in_a_per_gemm_space() -> None:
    from loka_tune.tuner.starts import ATTR_STARTS

    study = optuna.create_study()
    study.set_user_attr(ATTR_STARTS, {"state": "done", "mods": {}, "under_trial": None})
    per_gemm = SearchSpace(sites=(SiteChoices(Site("a", 64, 64, 1.0), {r: (BF16_ID,) for r in ROLES}),))
    assert not _propose(study, per_gemm) and not study.get_trials() and ATTR_MODEL not in study.user_attrs


def test_a_proposal_decodes_to_the_sites_precisions() -> None:
    study = optuna.create_study()
    _run_starts(study)
    dists = distributions(SPACE)
    for _ in range(3):
        _finish(study, study.ask(fixed_distributions=dists))
    _propose(study)
    t = study.get_trials(states=(optuna.trial.TrialState.WAITING,))[0]
    cfg = config_from_params(SPACE, t.system_attrs["fixed_params"])
    for sc in SPACE.sites:
        assert cfg.resolve(sc.name) == SitePrecision.parse(t.system_attrs["fixed_params"][f"{sc.name}@site"])


def test_the_report_line_of_the_model() -> None:
    from loka_tune.tuner.proposals import model_line

    assert model_line({}) is None  # never ran (a per-GEMM space, or no starts)
    study = optuna.create_study()
    _run_starts(study)
    dists = distributions(SPACE)
    for _ in range(3):
        _finish(study, study.ask(fixed_distributions=dists))
    _propose(study)
    line = model_line(study.user_attrs)
    assert line is not None and line.startswith("model: 1 proposal(s)") and "under Mods 'nobias'" in line
    assert f"alpha {ALPHA_TRUE:.3g}%" in line and "(3 trials)" in line


def test_a_proposal_fixes_every_mods_dimension_even_without_a_feasible_mods_start() -> None:
    """No bf16 + Mods start feasible (the recipe starts ran with every Mod off): the proposals
    still fix each Mods parameter (off), so the sampler draws none of an enqueued trial."""
    from loka_tune.tuner.starts import ATTR_STARTS

    study = optuna.create_study()
    study.set_user_attr(ATTR_STARTS, {"state": "done", "mods": {}, "under": "none", "under_trial": None})
    _propose(study)
    (t,) = study.get_trials(states=(optuna.trial.TrialState.WAITING,))[:1]
    assert set(t.system_attrs["fixed_params"]) == set(distributions(SPACE))
    assert t.system_attrs["fixed_params"]["mods.no_bias"] is False
