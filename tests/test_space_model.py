"""The additive model of a recipe space (issue 21, point 3): sensitivities from the probe's errors,
alpha and beta fitted by least squares through the origin, and the frontier (a multiple-choice
knapsack) checked against exhaustive search; then its proposals as enqueued trials."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from loka_tune.space.candidates import BF16_ID, SearchSpace, SiteChoices
from loka_tune.space.model import ALPHA_PRIOR, GRID, AdditiveModel, Observation, sensitivity
from loka_tune.space.sites import Site

ROLES = ("fwd", "dgrad", "wgrad")
T = "e4m3.tensor.emulated"
R = "e4m3.row.emulated"


def _site(name: str, prices: dict[str, float], errors: dict[str, dict[str, float]]) -> SiteChoices:
    recipes = {"bf16": BF16_ID, **{f"r{i}": v for i, v in enumerate(prices)}}
    return SiteChoices(Site(name, 1024, 1024, 1.0), {r: (BF16_ID, T, R) for r in ROLES}, error=errors,
                       recipes=recipes, prices={BF16_ID: 0.0, **prices})


def _space(sites: list[SiteChoices]) -> SearchSpace:
    return SearchSpace(sites=tuple(sites), per_gemm=False, price_source="modeled")


def test_sensitivity_sums_the_probes_error_over_the_fp8_gemms() -> None:
    sc = _site("a", {}, {"fwd": {T: 0.1, R: 0.05}, "dgrad": {T: 0.2}})
    assert sensitivity(sc, T, 0.3) == pytest.approx(0.1 + 0.2 + 0.3)  # wgrad unmeasured: the default
    assert sensitivity(sc, f"{R}|{T}|bf16", 0.3) == pytest.approx(0.05 + 0.2)
    assert sensitivity(sc, BF16_ID, 0.3) == 0.0


SPACE = _space([
    _site("a", {T: 2e-3, f"{R}|{R}|bf16": 1e-3}, {"fwd": {T: 0.1, R: 0.05}, "dgrad": {T: 0.1, R: 0.05},
                                                  "wgrad": {T: 0.1}}),
    _site("b", {R: 4e-3}, {r: {R: 0.2} for r in ROLES}),
])


def test_fit_is_least_squares_through_the_origin() -> None:
    m0 = AdditiveModel(SPACE, unmeasured_error=0.2)
    assert (m0.alpha, m0.beta) == (ALPHA_PRIOR, 1.0)
    obs = [
        Observation({"a": BF16_ID, "b": BF16_ID}, "none", "COMPLETE", 1.0, 1.0, 0.0),
        Observation({"a": BF16_ID, "b": BF16_ID}, "nobias", "COMPLETE", 0.9, 0.9, 0.2),  # the Mods' own loss
        Observation({"a": T, "b": BF16_ID}, "none", "COMPLETE", 1.0 - 1.5e-3, 1.0, 0.09),
        Observation({"a": T, "b": R}, "nobias", "COMPLETE", 0.9 - 5e-3, 0.9, 0.2 + 0.3),
        Observation({"a": BF16_ID, "b": R}, "none", "PRUNED", None, 1.0, 0.1),  # hopeless: at least the budget
        Observation({"a": T, "b": R}, "hswish", "COMPLETE", 0.5, 0.6, 9.0),  # its Mods' bf16 loss unknown
    ]
    m = m0.fit(obs, budget_pct=0.5)
    p = [2e-3, 6e-3, 6e-3]  # predicted savings of the completed FP8 trials
    meas = [1.5e-3, 5e-3, 0.1]
    assert m.beta == pytest.approx(sum(a * b for a, b in zip(p, meas)) / sum(a * a for a in p), rel=1e-12)
    e = [0.3, 0.9, 0.6]  # sums of MERE: a tensorwise 0.1 x 3, + b rowwise 0.2 x 3; b alone 0.6
    y = [0.09, 0.3, 0.5]  # minus the Mods' own loss; the pruned one at the budget
    assert m.alpha == pytest.approx(sum(a * b for a, b in zip(e, y)) / sum(a * a for a in e), rel=1e-12)
    assert (m.n_alpha, m.n_beta) == (3, 3)
    assert m.mods_rel == {"none": 0.0, "nobias": 0.2}
    assert m.predict_rel({"a": T, "b": BF16_ID}, "nobias") == pytest.approx(0.2 + m.alpha * 0.3)
    assert m.predict_step({"a": T, "b": R}, 1.0) == pytest.approx(1.0 - m.beta * 6e-3)
    # within the noise floor a loss counts 0; a negative fit clips at 0
    quiet = m0.fit(obs[:3], budget_pct=0.5, noise_pct=0.1)
    assert quiet.alpha == 0.0 and quiet.n_alpha == 1
    gain = m0.fit([Observation({"a": T, "b": BF16_ID}, "none", "COMPLETE", 1.001, 1.0, -0.5)], budget_pct=0.5)
    assert gain.alpha == 0.0 and gain.beta == 0.0


def _brute(model: AdditiveModel, cap: float) -> float:
    sites = [sc for sc in model.space.sites if len(sc.values) > 1]
    best = 0.0
    for combo in itertools.product(*(sc.values for sc in sites)):
        vals = dict(zip((sc.name for sc in sites), combo))
        if model.alpha * model.sens(vals) <= cap + 1e-12:
            best = max(best, model.saving(vals))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_frontier_is_the_knapsack_optimum(seed: int) -> None:
    rng = random.Random(seed)
    sites = []
    for i in range(5):
        vals = {}
        for j in range(rng.randint(1, 4)):
            v = [T, R, f"{R}|{R}|bf16", f"{T}|{R}|bf16"][j]
            vals[v] = rng.uniform(-1e-4, 1e-3)  # a value can cost time
        errs = {r: {T: rng.uniform(0.0, 0.2), R: rng.uniform(0.0, 0.2)} for r in ROLES}
        sites.append(_site(f"s{i}", vals, errs))
    model = AdditiveModel(_space(sites), alpha=rng.uniform(0.1, 2.0), unmeasured_error=0.2)
    total = model.alpha * sum(max(sensitivity(sc, v, 0.2) for v in sc.values) for sc in sites)
    for frac in (0.0, 0.2, 0.5, 1.1):
        cap = frac * total
        point = model.frontier(cap)
        assert set(point) == {sc.name for sc in sites if len(sc.values) > 1}
        assert model.alpha * model.sens(point) <= cap + 1e-12  # within its capacity
        # optimal up to the grid: at least the exact optimum of a capacity one cell per site smaller
        slack = len(sites) * cap / GRID
        assert model.saving(point) >= _brute(model, max(cap - slack, 0.0)) - 1e-15
        assert model.saving(point) <= _brute(model, cap) + 1e-15


def test_frontier_without_a_loss_cost_takes_every_saving_and_never_a_slow_value() -> None:
    sc = _site("a", {T: 2e-3, R: -1e-3}, {})
    model = AdditiveModel(_space([sc, _site("b", {R: 1e-3}, {})]), alpha=0.0)
    assert model.frontier(0.5) == {"a": T, "b": R}
    assert AdditiveModel(_space([_site("a", {R: -1e-3}, {})]), alpha=0.0).frontier(0.5) == {"a": BF16_ID}
    assert model.frontier(-0.1) == {"a": BF16_ID, "b": BF16_ID}  # nothing fits a negative capacity
    assert math.isfinite(AdditiveModel(model.space).predict_rel({"a": T}))


def test_the_alpha_prior_is_at_least_every_ratio_of_the_probe_vs_loss_receipt() -> None:
    """ALPHA_PRIOR >= relLL% / (GEMMs x geometric-mean MERE) of every config in the receipt (the
    GEMM count: every Linear of the tiny model but its head, three GEMMs each)."""
    import json
    from pathlib import Path

    from loka_tune.kernels.linear import find_linears
    from loka_tune.models import build_model

    d = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/probe_vs_loss_harsh.json").read_text())
    ratios = []
    for m in d["models"]:
        model = build_model(m["model"], d["setup"]["preset"], num_dense=13, cardinalities=[1000] * 8)
        head = getattr(model, "prediction_head", "head")
        n = 3 * len([s for s in find_linears(model) if s != head])
        ratios += [100 * r["rel_logloss"] / (n * r["pred_learned"]) for r in m["rows"]]
    assert len(ratios) == 20 and max(ratios) == pytest.approx(0.397, abs=5e-4)
    assert ALPHA_PRIOR >= max(ratios)
