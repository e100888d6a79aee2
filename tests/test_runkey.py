"""loka_tune.tuner.runkey: a configuration's key as it trains. Under the fp8_chain Mod the tensorwise
variants of a chained site train the same model (the chain runs its own kernels), so a study runs
and confirms one of them, not both; a site outside every chain still tells configurations apart."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from loka_tune.config import PrecisionConfig
from loka_tune.tuner.runkey import CHAINED, chained_sites, run_key

REPO = Path(__file__).resolve().parents[1]
TW = {"fwd": "e4m3.tensor.fa.torch_scaled_mm", "dgrad": "e4m3.tensor.torch_scaled_mm",
      "wgrad": "e4m3.tensor.torch_scaled_mm"}  # the tensorwise recipe: fast accumulation in fwd
TW_FA = "e4m3.tensor.fa.torch_scaled_mm"  # tensorwise_fa: fast accumulation in all three
MODS = {"no_bias": True, "blocknorm": 256, "hardswish": True}


def _tiny_ctx() -> SimpleNamespace:
    """A study context whose meta model is a tiny Wukong (its dense_mlp, 13 x 256, cannot chain)."""
    from loka_tune.models.registry import build_model

    with torch.device("meta"):
        model = build_model("wukong", preset="tiny", num_dense=13, cardinalities=[100] * 8, fmb_mlp=(256, 256),
                            head_mlp=(256, 256), dense_mlp=(256,), activation="silu")
    return SimpleNamespace(_loka_meta_model=model)


def _config(precision: object, *, chain: bool = True, dense: object = None) -> PrecisionConfig:
    # every Linear the chains take (layers.0's first block, K = 36, is not one: its chain starts at block 1)
    sites = {r"re:(layers\.0\.fmb\.mlp\.1|layers\.1\.fmb\.mlp\.\d|head_mlp\.\d)\.linear": precision,
             r"re:.*fmb\.out": precision}
    if dense is not None:
        sites = {"dense_mlp.0.linear": dense, **sites}
    return PrecisionConfig(mods={**MODS, "fp8_chain": chain}, sites=sites)  # type: ignore[arg-type]


def test_tensorwise_variants_of_the_chained_sites_are_one_run() -> None:
    ctx = _tiny_ctx()
    tw, fa = _config(TW), _config(TW_FA)
    assert tw.key() != fa.key()  # as written: two configurations
    assert run_key(ctx, tw) == run_key(ctx, fa)  # as trained: one model
    sites, chained = chained_sites(ctx._loka_meta_model, tw)
    assert "head_mlp.0.linear" in chained and "layers.1.fmb.out" in chained
    assert "dense_mlp.0.linear" in sites and "dense_mlp.0.linear" not in chained
    assert chained == {s for s in sites if tw.resolve(s).fwd.short_str() != "bf16"}  # each site it asks
    # layers.0's first block runs what it is asked outside the chain: tensorwise there is another model
    inside = PrecisionConfig(mods=tw.mods, sites={"layers.0.fmb.mlp.0.linear": TW, **{r.pattern: r.precision for r in tw.sites}})
    assert run_key(ctx, inside) != run_key(ctx, tw)
    body = json.loads(run_key(ctx, tw))
    assert {s for s, p in body["sites"].items() if p == CHAINED} == chained and set(body["sites"]) == set(sites)


def test_a_site_outside_every_chain_still_tells_configurations_apart() -> None:
    ctx = _tiny_ctx()
    a, b = _config(TW, dense="bf16"), _config(TW, dense=TW_FA)
    assert run_key(ctx, a) != run_key(ctx, b)  # dense_mlp runs its own precision: two models
    assert run_key(ctx, _config(TW, dense=TW_FA)) == run_key(ctx, _config(TW_FA, dense=TW_FA))


def test_without_the_chain_mod_or_a_chain_the_key_is_the_written_one() -> None:
    ctx = _tiny_ctx()
    for config in (_config(TW, chain=False), _config(TW_FA, chain=False),
                   _config("e4m3.row.torch_scaled_mm"),  # the Mod on, no site tensorwise: no chain forms
                   PrecisionConfig(mods={**MODS, "fp8_chain": True})):
        assert run_key(ctx, config) == config.key()
    assert run_key(ctx, _config(TW, chain=False)) != run_key(ctx, _config(TW_FA, chain=False))


def test_a_model_that_does_not_build_on_meta_keeps_the_written_key_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    ctx = SimpleNamespace(cfg=None, source=None)  # no study: the build fails
    tw, fa = _config(TW), _config(TW_FA)
    with caplog.at_level(logging.INFO, logger="loka_tune.tuner"):
        assert run_key(ctx, tw) == tw.key() and run_key(ctx, fa) == fa.key()
    said = [r.getMessage() for r in caplog.records if "meta device" in r.getMessage()]
    assert len(said) == 1 and "as written" in said[0]  # once, not per trial


def test_the_flagship_studys_two_tensorwise_starts_are_one_run() -> None:
    """studies/wukong_h200.toml's exported config (the H100 study of 2026-12-07: tensorwise@filter
    under the fp8_chain Mod) and the same with fast accumulation everywhere (tensorwise_fa@filter):
    one run key, built from the study's own model on the meta device."""
    from loka_tune.applying import load_config
    from loka_tune.tuner.build import make_source
    from loka_tune.tuner.study import load_study

    cfg = load_study(REPO / "studies" / "wukong_h200.toml")
    ctx = SimpleNamespace(cfg=cfg, source=make_source(cfg))
    tw = load_config(REPO / "benchmarks" / "results" / "study_h100_s36_best.json")
    assert tw.mods.fp8_chain and len(tw.sites) == 15
    fa = PrecisionConfig(mods=tw.mods, default=tw.default, sites={r.pattern: TW_FA for r in tw.sites})
    torch.manual_seed(1234)
    rng = torch.get_rng_state()
    assert fa.key() != tw.key() and run_key(ctx, fa) == run_key(ctx, tw)
    assert torch.equal(torch.get_rng_state(), rng)  # the meta build (it seeds) leaves the trial's generators as they were
    _, chained = chained_sites(ctx._loka_meta_model, tw)
    assert chained == {r.pattern for r in tw.sites}  # every one of torchao's 15 filter sites is in a chain
    assert all(p.device.type == "meta" for p in ctx._loka_meta_model.parameters())


def test_the_loop_runs_one_trial_per_run_key_and_copies_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trial loop tells trials apart by :func:`run_key`, not the written key: here a stand-in
    run key that sees only the Mods and whether any site is FP8, so every FP8 trial after the first
    under its Mods (the dispatch start after tensorwise@filter, say) is a cache copy of it: recorded
    with that key and the earlier trial's result, not trained, not counted toward ``n_trials``."""
    import loka_tune.tuner.loop as loop
    from loka_tune.tuner.results import TrialRecord
    from tests.test_starts import _run, _study_file

    written: list[str] = []

    def coarse(ctx: object, config: PrecisionConfig) -> str:
        written.append(config.key())
        fp8 = any(r.precision.to_dict() != {"fwd": "bf16", "dgrad": "bf16", "wgrad": "bf16"} for r in config.sites)
        return json.dumps([config.mods.to_dict(), fp8], sort_keys=True)

    monkeypatch.setattr(loop, "run_key", coarse)
    study = _run(_study_file(tmp_path, n_trials=4))
    trials = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    records = {t.number: TrialRecord.of(t) for t in trials}
    evaluated = [r for r in records.values() if not r.cache_hit]
    copies = [t for t in trials if records[t.number].cache_hit]
    assert len(evaluated) == 4 and len({r.trains_as for r in evaluated}) == 4  # n_trials runs, one per run key
    assert all(r.config_key in written and r.run_key not in written for r in records.values())  # both recorded
    assert copies and len(set(written)) > len(evaluated)  # more configurations as written than runs
    for t in copies:
        r = records[t.number]
        assert r.cached_from in records and not records[r.cached_from].cache_hit
        assert records[r.cached_from].trains_as == r.trains_as and t.value == study.trials[r.cached_from].value
