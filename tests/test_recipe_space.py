"""The recipe space (issue 21, point 3): per site a few whole-site recipes built from the pruned
per-GEMM space, priced, one Optuna parameter per site; the study setting that picks it; the
pricing at preparation (modeled, and the measured interface with a fake timing module)."""

from __future__ import annotations

import itertools
import sys
import types
from pathlib import Path

import pytest

from loka_tune.config import ModsConfig, PrecisionConfig, SitePrecision
from loka_tune.errors import ConfigError
from loka_tune.space.candidates import BF16_ID, SearchSpace, SiteChoices
from loka_tune.space.encode import config_from_params, distributions, param_name, params_from_config, params_picking
from loka_tune.space.recipe_space import recipe_candidates, recipe_gemm, select_recipes, site_recipe, space_table
from loka_tune.space.sites import Site

ROLES = ("fwd", "dgrad", "wgrad")
TS = "e4m3.tensor.torch_scaled_mm"
TS_FA = "e4m3.tensor.fa.torch_scaled_mm"
RS = "e4m3.row.torch_scaled_mm"
RS_P2 = "e4m3.row.pow2.torch_scaled_mm"
RS_P2_FA = "e4m3.row.pow2.fa.torch_scaled_mm"
TF = "e4m3.tensor.fbgemm"
RF = "e4m3.row.fbgemm"
E5 = "e5m2+e4m3.tensor.torch_scaled_mm"


def _sc(name: str, in_f: int, out_f: int, **per_role: tuple[str, ...]) -> SiteChoices:
    return SiteChoices(Site(name, in_f, out_f, 1.0), {r: (BF16_ID, *per_role.get(r, ())) for r in ROLES})


ALL = (TS, TS_FA, RS, RS_P2, RS_P2_FA, TF, RF, E5)
PER_GEMM = SearchSpace(sites=(
    _sc("big", 8192, 8192, fwd=ALL, dgrad=ALL, wgrad=ALL),
    _sc("nowg", 4096, 4096, fwd=(RS, TF), dgrad=(RS, TF)),  # the probe dropped every wgrad choice
    _sc("e5only", 2048, 2048, dgrad=(E5,)),  # no e4m3 x e4m3 choice: no recipe
    _sc("small", 64, 64),  # nothing survived
), mods={"mods.no_bias": (False, True)})


def test_recipe_gemm_takes_the_nearest_choice_of_the_recipes_kind() -> None:
    # tensorwise: exact scales first, fast accumulation in fwd only
    assert recipe_gemm(ALL, "tensorwise", "fwd", "torch_scaled_mm") == TS_FA
    assert recipe_gemm(ALL, "tensorwise", "dgrad", "torch_scaled_mm") == TS
    # tensorwise_fa: fast accumulation in every GEMM; where the space lacks it, the exact twin
    assert [recipe_gemm(ALL, "tensorwise_fa", r, "torch_scaled_mm") for r in ROLES] == [TS_FA] * 3
    assert recipe_gemm((BF16_ID, TS), "tensorwise_fa", "wgrad", "torch_scaled_mm") == TS
    assert site_recipe(PER_GEMM.site("big"), "tensorwise_fa", "torch_scaled_mm") == TS_FA
    # rowwise: power-of-two scales first; without them the exact ones
    assert recipe_gemm(ALL, "rowwise", "fwd", "torch_scaled_mm") == RS_P2_FA
    assert recipe_gemm(ALL, "rowwise", "wgrad", "torch_scaled_mm") == RS_P2
    assert recipe_gemm((BF16_ID, RS), "rowwise", "fwd", "torch_scaled_mm") == RS
    # another backend, or a format pair that is not e4m3 x e4m3: not this recipe
    assert recipe_gemm(ALL, "rowwise", "fwd", "fbgemm") == RF
    assert recipe_gemm((BF16_ID, E5, TF), "tensorwise", "dgrad", "torch_scaled_mm") == BF16_ID
    # rowwise_with_gw_hp keeps wgrad in bf16 whatever the space offers
    assert recipe_gemm(ALL, "rowwise_with_gw_hp", "wgrad", "torch_scaled_mm") == BF16_ID
    assert site_recipe(PER_GEMM.site("big"), "rowwise_with_gw_hp", "torch_scaled_mm") == f"{RS_P2_FA}|{RS_P2}|bf16"
    assert site_recipe(PER_GEMM.site("nowg"), "rowwise", "torch_scaled_mm") == f"{RS}|{RS}|bf16"


def _prices(cands: SearchSpace, saved: dict[tuple[str, str], float]) -> dict[str, dict[str, float]]:
    """Every candidate value priced 1e-4 s, except the (site, label) pairs given (a value two
    labels name takes the given price)."""
    out: dict[str, dict[str, float]] = {}
    for sc in cands.sites:
        site = out.setdefault(sc.name, {})
        for k, v in sc.recipes.items():
            if v != BF16_ID and ((sc.name, k) in saved or v not in site):
                site[v] = saved.get((sc.name, k), 1e-4)
    return out


def test_select_keeps_per_recipe_the_backend_that_saves_most_and_names_repeats_once() -> None:
    cands = recipe_candidates(PER_GEMM, ["torch_scaled_mm", "fbgemm"])
    big = cands.site("big")
    assert set(big.recipes) == {"bf16", "tensorwise.torch_scaled_mm", "tensorwise.fbgemm", "tensorwise_fa.torch_scaled_mm",
                                "rowwise.torch_scaled_mm", "rowwise.fbgemm", "rowwise_with_gw_hp.torch_scaled_mm",
                                "rowwise_with_gw_hp.fbgemm", "tensorwise_fa.fbgemm"}
    assert big.recipes["tensorwise_fa.torch_scaled_mm"] == TS_FA
    # the space has no fbgemm tensorwise with fast accumulation: the recipe takes the exact one there
    assert big.recipes["tensorwise_fa.fbgemm"] == big.recipes["tensorwise.fbgemm"] == TF
    assert cands.site("e5only").recipes == {"bf16": BF16_ID} and cands.site("small").recipes == {"bf16": BF16_ID}
    prices = _prices(cands, {("big", "tensorwise.fbgemm"): 3e-4, ("big", "rowwise.fbgemm"): 0.5e-4,
                             ("nowg", "tensorwise.fbgemm"): -1e-5})
    space = select_recipes(cands, prices, source="modeled")
    b = space.site("big")
    assert b.recipes["tensorwise"] == TF and b.prices[TF] == 3e-4  # fbgemm saves more here
    assert b.recipes["rowwise"] == f"{RS_P2_FA}|{RS_P2}|{RS_P2}"  # torch_scaled_mm does
    # tensorwise_fa's fastest backend is fbgemm's exact tensorwise too: one value, two names
    assert b.recipes["tensorwise_fa"] == TF and b.values.count(TF) == 1
    assert b.values[0] == BF16_ID and len(b.values) == 4
    fa = select_recipes(cands, {**prices, "big": {**prices["big"], TS_FA: 5e-4}}, source="modeled").site("big")
    assert fa.recipes["tensorwise_fa"] == TS_FA and fa.recipes["tensorwise"] == TF and len(fa.values) == 5
    n = space.site("nowg")
    # without a wgrad choice, rowwise and rowwise_with_gw_hp are one value: listed once, named twice
    assert n.recipes["rowwise"] == n.recipes["rowwise_with_gw_hp"] == f"{RS}|{RS}|bf16"
    assert n.values == (BF16_ID, f"{RS}|{RS}|bf16")  # tensorwise (fbgemm -1e-5, torch_scaled_mm none) is slow
    assert "tensorwise" not in n.recipes and n.recipe_dropped["tensorwise"].startswith("slow")
    assert "bf16 at every GEMM" in space.site("e5only").recipe_dropped["tensorwise"]
    # keep_slow (probe.min_speedup < 1) keeps a value that saves nothing
    assert "tensorwise" in select_recipes(cands, prices, source="modeled", keep_slow=True).site("nowg").recipes
    # a value nobody priced is dropped
    unpriced = select_recipes(cands, {"big": prices["big"]}, source="measured")
    assert unpriced.site("nowg").recipe_dropped["rowwise"].startswith("not priced")
    assert unpriced.price_source == "measured" and not unpriced.per_gemm
    # at most six values per site, bf16 first; only sites with a choice get a parameter
    assert all(len(sc.values) <= 6 and sc.values[0] == BF16_ID for sc in space.sites)
    assert set(distributions(space)) == {"big@site", "nowg@site", "mods.no_bias"}
    assert distributions(space)["big@site"].choices == b.values
    text = space_table(space)
    assert "rowwise=rowwise_with_gw_hp" in text and "big (8192x8192)" in text and "small" not in text


def test_dispatch_value_is_the_plans_choice_in_the_space() -> None:
    plan = PrecisionConfig.from_sites({"big": f"{RS}|{TS}|{RF}", "nowg": f"{RS}|{RS_P2}|{RS}"})
    cands = recipe_candidates(PER_GEMM, ["torch_scaled_mm"], plan)
    assert cands.site("big").recipes["dispatch"] == f"{RS}|{TS}|{RF}"
    # nowg's space lacks row pow2 dgrad and any wgrad: those GEMMs are bf16
    assert cands.site("nowg").recipes["dispatch"] == f"{RS}|bf16|bf16"
    assert "dispatch" not in cands.site("small").recipes  # bf16 everywhere: no candidate


def _recipe_space() -> SearchSpace:
    cands = recipe_candidates(PER_GEMM, ["torch_scaled_mm", "fbgemm"])
    return select_recipes(cands, _prices(cands, {}), source="modeled")


def test_encode_round_trip_in_the_recipe_space() -> None:
    space = _recipe_space()
    big = space.site("big")
    params = {"big@site": big.recipes["rowwise_with_gw_hp"], "nowg@site": BF16_ID, "mods.no_bias": True}
    cfg = config_from_params(space, params)
    assert cfg.resolve("big") == SitePrecision.parse(big.recipes["rowwise_with_gw_hp"])
    assert cfg.resolve("nowg").is_bf16 and cfg.mods == ModsConfig(no_bias=True)
    assert [r.pattern for r in cfg.sites] == ["big"]
    back, notes = params_from_config(space, cfg)
    assert back == params and notes == []
    assert config_from_params(space, dict(back)).key() == cfg.key()
    # a site precision that is none of the site's values: bf16 there, noted
    odd = PrecisionConfig.from_sites({"big": f"{TS}|{RS}|bf16", "small": TS})
    p2, notes2 = params_from_config(space, odd)
    assert p2["big@site"] == BF16_ID and any(n.startswith("big@site") for n in notes2)
    assert any(n.startswith("small@site") and "bf16 only" in n for n in notes2)
    picked = params_picking(space, lambda sc, role, ch: ch[-1])
    assert set(picked) == {"big@site", "nowg@site", "mods.no_bias"} and picked["big@site"] == big.values[-1]
    # stored with the study: a JSON round trip
    import json

    again = SearchSpace.from_dict(json.loads(json.dumps(space.to_dict())))
    assert again == space and again.site("big").prices == big.prices


def test_a_space_stored_before_recipe_spaces_reads_as_per_gemm() -> None:
    d = PER_GEMM.to_dict()
    assert "per_gemm" not in d and "recipes" not in d["sites"][0]  # what older studies stored
    old = SearchSpace.from_dict(d)
    assert old.per_gemm and old == PER_GEMM
    assert param_name("big", "fwd") in distributions(old)


# ------------------------------------------------------------------ the study setting
def _space_section(**kw: object):  # noqa: ANN202
    from loka_tune._toml import Table
    from loka_tune.tuner.sections import SpaceSection, Where

    return SpaceSection.from_table(Table(kw, "space"), Where(cwd=Path(".")))


@pytest.mark.parametrize("keys,per_gemm,per_role", [
    ({}, False, True),                                      # the default: recipes
    ({"per_gemm": True}, True, True),                       # the per-GEMM space, per role
    ({"per_gemm": True, "per_role": False}, True, False),   # ... tied
    ({"per_role": False}, True, False),                     # an older study file: its tied per-GEMM space
    ({"per_role": True}, True, True),                       # ... and its per-role one
    ({"per_gemm": False}, False, True),
])
def test_per_gemm_and_per_role(keys: dict, per_gemm: bool, per_role: bool) -> None:
    s = _space_section(**keys)
    assert (s.per_gemm, s.per_role) == (per_gemm, per_role)


@pytest.mark.parametrize("per_role", [True, False])
def test_per_gemm_false_with_per_role_is_a_contradiction(per_role: bool) -> None:
    with pytest.raises(ConfigError, match="drop per_role, or set per_gemm = true") as e:
        _space_section(per_gemm=False, per_role=per_role)
    assert e.value.key == "space.per_role"


# ------------------------------------------------------------------ pricing at preparation
def _cfg(**over: object):  # noqa: ANN202
    from loka_tune.tuner.study import parse_study

    doc = {"study": {"name": "prices"}, "model": {"name": "dlrm", "preset": "tiny"}, "data": {"source": "synthetic"},
           "training": {"batch_size": 256, "device": "cpu"},
           "objective": {"speed": "modeled", "cost_batch_size": 65536}}
    for sec, vals in over.items():
        doc[sec] = {**doc.get(sec, {}), **vals}  # type: ignore[dict-item]
    return parse_study(doc)


def test_modeled_prices_are_the_cost_models_savings_over_the_objectives_gemms() -> None:
    from loka_tune.config import ROLES as R
    from loka_tune.kernels.costmodel import estimate_gemm_seconds, estimate_site_seconds
    from loka_tune.kernels.scaled import share_plan
    from loka_tune.tuner.prepare import _site_prices

    space = _recipe_space()
    cfg = _cfg()
    prices = _site_prices(cfg, space, "cpu")
    assert set(prices) == {"big", "nowg"}  # only what the space can choose
    for sc in space.sites:
        for v in sc.values[1:]:
            prec = SitePrecision.parse(v)
            per_gemm = 0.0
            for r in R:
                m, k, n = sc.site.shape(r, 65536)
                per_gemm += (estimate_gemm_seconds("bf16", m, k, n, r, "h200")
                             - estimate_gemm_seconds(prec[r], m, k, n, r, "h200"))
            M, K, N = sc.site.rows(65536), sc.site.in_features, sc.site.out_features
            compiled = (sum(estimate_site_seconds("bf16", M, K, N).values())
                        - sum(estimate_site_seconds(prec, M, K, N, compiled=True).values()))
            # the layer as a compiled step runs it: a tensorwise operand two GEMMs share is quantized once
            assert prices[sc.name][v] == pytest.approx(compiled, rel=1e-12)
            shared = share_plan(*(c.with_backend("torch_scaled_mm") if c.backend == "emulated" and not c.is_bf16
                                  else c for c in (prec.fwd, prec.dgrad, prec.wgrad))).any
            assert (prices[sc.name][v] > per_gemm) if shared else prices[sc.name][v] == pytest.approx(per_gemm)
    assert prices["big"][space.site("big").recipes["tensorwise"]] > 0  # 8192-wide: FP8 pays off
    inf = _site_prices(_cfg(objective={"kind": "inference"}), space, "cpu")
    v = space.site("big").recipes["rowwise_with_gw_hp"]
    m, k, n = space.site("big").site.shape("fwd", 65536)
    fwd_only = estimate_gemm_seconds("bf16", m, k, n, "fwd", "h200") - estimate_gemm_seconds(
        SitePrecision.parse(v).fwd, m, k, n, "fwd", "h200")
    assert inf["big"][v] == pytest.approx(fwd_only, rel=1e-12)


def test_measured_prices_come_from_site_timing_at_the_batch_one_process_trains_at(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from loka_tune.tuner import prepare

    calls = []

    def price_sites(shapes, precs, *, device, counts=None, progress=None):  # noqa: ANN001, ANN202
        calls.append((shapes, precs, device))
        assert counts is None and callable(progress)  # no tally asked here; the per-cell lines are
        return {s: {v: 1e-5 * (i + 1) for i, v in enumerate(vs)} for s, vs in precs.items()}

    monkeypatch.setitem(sys.modules, "loka_tune.kernels.site_timing",
                        types.SimpleNamespace(price_sites=price_sites))
    monkeypatch.setattr(prepare, "speed_source", lambda cfg, device: "measured")
    space = _recipe_space()
    cfg = _cfg(regime={"batch_size": 8192, "nproc": 2})
    got = prepare._site_prices(cfg, space, "cuda:0")
    (shapes, precs, device), = calls
    assert device == "cuda:0"
    assert shapes == {"big": (4096, 8192, 8192), "nowg": (4096, 4096, 4096)}  # 8192 rows over 2 processes
    assert precs == {"big": list(space.site("big").values[1:]), "nowg": list(space.site("nowg").values[1:])}
    assert got["big"][space.site("big").values[1]] == pytest.approx(1e-5)


def test_recipe_space_end_to_end_from_candidates_to_prices(monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare._recipe_space: the Dispatch plan from a report, the candidates, the prices, the selection."""
    from loka_tune.tuner import prepare

    cfg = _cfg(space={"backends": ["torch_scaled_mm", "fbgemm"]})
    seen = {}

    def fake_prices(c, space, device, counts=None):  # noqa: ANN001, ANN202
        seen["space"] = space
        return {sc.name: {v: (2e-4 if "fbgemm" in v else 1e-4) for v in sc.values[1:]} for sc in space.sites}

    monkeypatch.setattr(prepare, "_site_prices", fake_prices)
    rep = [{"site": "big", "role": r, "choice": RS, "m": 65536, "k": 8192, "n": 8192, "mere": 0.01, "speedup": 1.4,
            "time_source": "modeled"} for r in ROLES]
    space = prepare._recipe_space(cfg, PER_GEMM, rep, "cpu")
    assert seen["space"].site("big").recipes["dispatch"] == RS  # the plan's choice, not resolved off 'emulated'
    assert space.site("big").recipes["tensorwise"] == TF  # fbgemm priced faster
    assert space.site("big").recipes["dispatch"] == RS and space.site("big").prices[RS] == 1e-4
    assert space.price_source == "modeled"


# ------------------------------------------------------------------ the recipe starts' sites stay in the space
SLOWISH = SearchSpace(sites=(
    _sc("wide", 2048, 2048, fwd=ALL, dgrad=ALL, wgrad=ALL),   # torchao's tensorwise filter takes it, rowwise's not
    _sc("thin", 4096, 1024, fwd=ALL, dgrad=ALL, wgrad=ALL),   # neither filter takes it
    _sc("big", 8192, 8192, fwd=ALL, dgrad=ALL, wgrad=ALL),    # both take it
), mods={"mods.fp8_chain": (False, True)})


def _slow_prices(cands: SearchSpace) -> dict[str, dict[str, float]]:
    """Every FP8 value of 'wide' and 'thin' loses 5 us priced alone (the large Wukong's 2048 x 2048
    MLP Linears on an H100, 2026-12-07: tensorwise -5.78 us); 'big' saves 1e-4 s except rowwise, slow."""
    out = _prices(cands, {})
    for name in ("wide", "thin"):
        out[name] = {v: -5e-6 for v in out[name]}
    rw = cands.site("big").recipes["rowwise.torch_scaled_mm"]
    out["big"][rw] = -1e-6
    return out


def test_keep_holds_each_named_recipe_on_its_filter_sites_where_it_prices_slow() -> None:
    from loka_tune.recipes import SIZE_FILTERS
    from loka_tune.tuner.starts import recipe_starts

    cands = recipe_candidates(SLOWISH, ["torch_scaled_mm"])
    prices = _slow_prices(cands)
    plain = select_recipes(cands, prices, source="measured")
    assert plain.site("wide").values == (BF16_ID,)  # without keep every slow value goes
    assert plain.site("wide").recipe_dropped["tensorwise"].startswith("slow")
    # a tensorwise start without its 2048 x 2048 site (no parameter there): 'big' alone, as the
    # 6-site start of the H100 study of 2026-12-07 was
    assert "wide@site" not in dict(recipe_starts(plain, ["torch_scaled_mm"]))["tensorwise@filter"]

    kept = select_recipes(cands, prices, source="measured", keep=SIZE_FILTERS)
    wide, thin, big = kept.site("wide"), kept.site("thin"), kept.site("big")
    tw = cands.site("wide").recipes["tensorwise.torch_scaled_mm"]
    assert wide.recipes["tensorwise"] == tw and wide.prices[tw] == -5e-6  # kept at its price
    assert wide.recipes["tensorwise_fa"] == cands.site("wide").recipes["tensorwise_fa.torch_scaled_mm"]
    # what the filters do not take, or recipes without a filter, still go when slow
    assert "rowwise" not in wide.recipes and "rowwise_with_gw_hp" not in wide.recipes
    assert thin.values == (BF16_ID,) and thin.recipe_dropped["tensorwise"].startswith("slow")
    assert big.recipes["rowwise"] == cands.site("big").recipes["rowwise.torch_scaled_mm"]  # rowwise's filter takes it
    starts = dict(recipe_starts(kept, ["torch_scaled_mm"]))
    assert starts["tensorwise@filter"]["wide@site"] == tw and "thin@site" not in starts["tensorwise@filter"]
    assert starts["tensorwise@filter"]["big@site"] == big.recipes["tensorwise"]
    assert starts["rowwise@filter"]["big@site"] == big.recipes["rowwise"] and starts["rowwise@filter"]["wide@site"] == BF16_ID
    text = space_table(kept)
    assert f"tensorwise {tw} -0.005 ms (kept, though slow priced alone)" in text
    assert "(kept" not in space_table(plain)


@pytest.mark.parametrize("enqueue", [True, False])
def test_the_study_keeps_the_starts_sites_only_when_it_queues_the_starts(
        monkeypatch: pytest.MonkeyPatch, enqueue: bool) -> None:
    from loka_tune.tuner import prepare

    monkeypatch.setattr(prepare, "_site_prices", lambda c, space, device, counts=None: _slow_prices(space))
    cfg = _cfg(space={"backends": ["torch_scaled_mm"]}, trials={"enqueue_starts": enqueue})
    space = prepare._recipe_space(cfg, SLOWISH, None, "cpu")
    assert ("tensorwise" in space.site("wide").recipes) is enqueue
    assert "tensorwise" not in space.site("thin").recipes


def test_recipe_values_never_exceed_six_on_a_rich_space() -> None:
    """Every backend and format: still bf16 + the four uniform recipes + dispatch at most."""
    backends = ["torch_scaled_mm", "fbgemm", "triton", "emulated"]
    ids = [f"{f}.{g}{r}{a}.{b}" for f, g, r, a, b in itertools.product(
        ("e4m3", "e5m2+e4m3"), ("tensor", "row", "block"), ("", ".pow2"), ("", ".fa"), backends)]
    rich = SearchSpace(sites=(_sc("x", 4096, 4096, fwd=tuple(i for i in ids if not i.startswith("e5")),
                                   dgrad=tuple(ids), wgrad=tuple(ids)),))
    plan = PrecisionConfig.from_sites({"x": "e4m3.block.triton|e5m2+e4m3.row.fbgemm|e4m3.tensor.emulated"})
    cands = recipe_candidates(rich, backends, plan)
    assert len(cands.site("x").recipes) == 1 + 4 * 4 + 1
    sel = select_recipes(cands, _prices(cands, {}), source="modeled")
    assert len(sel.site("x").values) == 6


def test_a_measured_recipe_study_lets_the_site_prices_judge_speed_not_the_per_gemm_model() -> None:
    from loka_tune.tuner.prepare import _gemm_speed_prunes

    assert _gemm_speed_prunes(_cfg(), "modeled")  # a CPU study: the cost model prunes GEMMs as before
    assert _gemm_speed_prunes(_cfg(space={"per_gemm": True}), "measured")  # the per-GEMM space: likewise
    assert not _gemm_speed_prunes(_cfg(), "measured")  # recipes timed whole on the GPU decide
