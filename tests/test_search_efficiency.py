"""benchmarks/search_efficiency.py (issue 21, point 5): the modeled world is consistent with the
recipe space it prices, the arms run loka-tune's own starts / proposals / sampler, and "trials to
99% of the best" and trials_ratio follow the records."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def se():  # noqa: ANN201
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        yield importlib.import_module("search_efficiency")
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


@pytest.fixture(scope="module")
def world(se):  # noqa: ANN001, ANN201
    return se.build_world(budget_pct=0.5, overshoot=3.0, noise_pct=0.015, seed=0)


def _rec(n: int, speedup: float, feasible: bool = True, evaluated: bool = True, seeded: str | None = None) -> dict:
    return {"trial": n, "evaluated": evaluated, "n_evaluated": n, "seeded": seeded, "feasible": feasible,
            "speedup": speedup, "rel_logloss_pct": 0.1, "true_rel_logloss_pct": 0.1}


def test_summarize_counts_trials_to_99_percent_of_the_best_and_censors(se) -> None:  # noqa: ANN001
    runs = [{"arm": "model", "seed": 0, "wall_s": 1.0, "records": [_rec(1, 1.0), _rec(2, 1.095, seeded="model:1")]},
            {"arm": "model", "seed": 1, "wall_s": 1.0, "records": [_rec(1, 1.0), _rec(2, 1.05), _rec(3, 1.1)]},
            {"arm": "tpe", "seed": 0, "wall_s": 1.0, "records": [_rec(1, 1.2, feasible=False), _rec(2, 1.02),
                                                                _rec(3, 1.09), _rec(4, 1.09)]},
            {"arm": "tpe", "seed": 1, "wall_s": 1.0, "records": [_rec(1, 0.9), _rec(2, 0.95)]}]
    s = se.summarize(runs, budget_pct=0.5)
    assert s["best_speedup"] == 1.1  # the infeasible 1.2 does not count
    m, t = s["arms"]["model"], s["arms"]["tpe"]
    assert m["trials_to_target"] == [2, 3] and not m["censored"]  # 1.095 >= 0.99 x 1.1
    assert t["trials_to_target"] == [3, 2] and t["censored"] and t["reached"] == 1  # seed 1 never: its 2 trials
    assert s["trials_ratio"] == pytest.approx(2.5 / 2.5) and s["trials_ratio_is_upper_bound"]
    assert s["per_run"][0]["reached_by"] == "model:1"


def test_the_world_prices_the_recipe_space_as_it_composes_configs(se, world) -> None:  # noqa: ANN001
    from loka_tune.config import PrecisionConfig, SitePrecision
    from loka_tune.space.encode import config_from_params, params_picking

    assert world.label == "modeled" and not world.recipe.per_gemm and world.per_gemm.per_gemm
    priced = 0
    for sc in world.recipe.sites:
        for v in sc.values[1:]:
            assert sc.prices[v] == pytest.approx(world.site_saving(sc.name, SitePrecision.parse(v)), rel=1e-12)
            priced += 1
    assert priced >= 10
    # the feature-axis Linears (rows per example > 1) are in the space, and their FP8 is expensive in loss
    fa = [sc for sc in world.recipe.sites if sc.site.rows_per_example > 1 and len(sc.values) > 1]
    assert fa and all(world.true_error[(sc.name, "wgrad", c)] == 1.0 for sc in fa for c in sc.choices["wgrad"][1:])
    # a config's step time is base - the sum of its sites' savings; its loss is the same on every call
    params = params_picking(world.recipe, lambda sc, role, ch: ch[-1])
    cfg = config_from_params(world.recipe, params)
    step, rel = world.evaluate(cfg)
    assert step == pytest.approx(world.base_s - sum(world.recipe.site(s.split("@")[0]).prices[v]
                                                    for s, v in params.items()), rel=1e-12)
    assert world.evaluate(cfg) == (step, rel) and rel != world.true_loss(cfg)  # noise, fixed per config
    assert world.evaluate(PrecisionConfig())[0] == world.base_s
    # the budget binds: the config of every GEMM's largest saving costs 3x it
    assert world.kappa > 0 and world.meta["greedy_speedup"] > 1.05
    assert 1.0 < se.recipe_optimum(world) < world.meta["greedy_speedup"]


def test_measured_prices_replace_the_priced_values_and_scale_the_rest(se, world, tmp_path: Path) -> None:  # noqa: ANN001
    from loka_tune.config import SitePrecision

    sc = next(s for s in world.recipe.sites if len(s.values) > 2)
    v1, v2 = sc.values[1], sc.values[2]
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"site_prices": {sc.name: {v1: 2 * sc.prices[v1]}}, "base_s": 0.03}))
    m = se.build_world(prices_path=prices, seed=0)
    assert m.label == "measured per-site prices, modeled composition" and m.base_s == 0.03
    assert m.site_saving(sc.name, SitePrecision.parse(v1)) == pytest.approx(2 * sc.prices[v1])
    # an unpriced precision of that site: its modeled GEMM savings x the site's measured/modeled ratio (2)
    assert m.site_saving(sc.name, SitePrecision.parse(v2)) == pytest.approx(2 * world.site_saving(sc.name,
                                                                                             SitePrecision.parse(v2)))
    assert m.recipe.site(sc.name).values == ("bf16", v1)  # only priced values are choices
    assert m.recipe.price_source == "measured"


def test_arms_run_loka_tunes_starts_proposals_and_sampler(se, world) -> None:  # noqa: ANN001
    res = se.run_benchmark(world, n_trials=7, seeds=[0], arms=["model", "tpe", "random"], log=False)
    runs = {r["arm"]: r for r in res["runs"]}
    for run in runs.values():
        recs = run["records"]
        assert max(r["n_evaluated"] for r in recs) == 7
        assert [r["n_evaluated"] for r in recs] == sorted(r["n_evaluated"] for r in recs)
    seeded = [r["seeded"] for r in runs["model"]["records"]]
    assert seeded[:5] == ["all-bf16", "tensorwise@filter", "tensorwise_fa@filter", "rowwise@filter", "dispatch"]
    assert any(str(s).startswith("model:") for s in seeded[4:])  # the model's proposals follow the starts
    assert not any(r["seeded"] for arm in ("tpe", "random") for r in runs[arm]["records"])
    assert runs["tpe"]["parameters"] > runs["model"]["parameters"]  # per GEMM vs per site
    assert res["trials_ratio"] == res["summary"]["trials_ratio"]
    md = se.to_markdown(res, "cmd")
    assert "trials_ratio" in md and "| model | 0 |" in md and "modeled" in md


def test_write_precs_lists_what_price_sites_must_time(se, tmp_path: Path) -> None:  # noqa: ANN001
    out = tmp_path / "precs.json"
    assert se.main(["--write-precs", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["batch_size"] == 8192 and set(d["shapes"]) == set(d["precs"])
    assert d["shapes"]["head_mlp.0.linear"] == [8192, 16384, 4096]
    assert all(v and "bf16" not in v for v in d["precs"].values())
