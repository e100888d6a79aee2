"""benchmarks/study_h200.py on the CPU: the receipt's JSON from an export's provenance and
e2e.py's own summary (its field names, not copies of them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _bench import load_bench

REPO = Path(__file__).resolve().parents[1]


def _load(name: str) -> Any:
    return load_bench(name)


def _e2e_results(step_ms: dict[str, float]) -> dict[str, Any]:
    e2e = _load("e2e.py")
    runs = [{"variant": v, "seed": s, "status": "ok", "step_time_s": ms / 1e3 * (1 + 0.01 * s),
             "eval_logloss": 0.45 + 0.001 * s + (0.0002 if v == "config" else 0.0)}
            for v, ms in step_ms.items() for s in (0, 1)]
    return {"meta": {"compile": True, "batch": 8192, "seeds": [0, 1], "device": "NVIDIA H200"}, "runs": runs,
            **e2e.summarize(runs)}  # as e2e.py writes results.json


def test_receipt_assembles_study_confirmation_and_e2e() -> None:
    bench = _load("study_h200.py")
    prov = {"study": "wukong_h200", "trial": 7, "claimed_speedup": 1.10, "claimed_speedup_vs_bf16": 1.16,
            "confirmed_speedup": 1.09, "confirmed_rel_logloss_pct": 0.1, "confirmed_rel_logloss_sd_pct": 0.02,
            "confirmed_regime": {"compile": True, "batch_size": 8192}}
    r = bench.assemble(prov, _e2e_results({"bf16": 50.0, "bf16_mods": 47.0, "config": 43.0}), 41.5)
    assert r["e2e_speedup"] == pytest.approx(47.0 / 43.0)
    assert r["study_speedup"] == 1.10 and r["confirmed_speedup"] == 1.09 and r["compile"] is True
    assert r["study_vs_e2e"] == pytest.approx(abs(1.10 - 47 / 43) / (47 / 43))
    assert {k: r["pass"][k] for k in ("prepare_s", "compile", "study_vs_e2e")} == {
        "prepare_s": True, "compile": True, "study_vs_e2e": True}
    # a claim e2e does not bear out, a slow preparation, an eager e2e: each fails its own check
    r = bench.assemble({**prov, "claimed_speedup": 1.125}, _e2e_results({"bf16": 50.0, "bf16_mods": 47.3,
                                                                          "config": 47.25}), 256.0)
    assert r["study_vs_e2e"] > 0.1
    assert {k: r["pass"][k] for k in ("prepare_s", "compile", "study_vs_e2e")} == {
        "prepare_s": False, "compile": True, "study_vs_e2e": False}
    r = bench.assemble({**prov, "confirmed_regime": {"compile": False}}, {"rows": [], "meta": {}}, None)
    assert r["e2e_speedup"] is None and r["study_vs_e2e"] is None
    assert not any(r["pass"].values())


def test_receipt_holds_the_export_against_the_faster_recipe_and_the_budget_on_every_seed() -> None:
    bench = _load("study_h200.py")
    prov = {"claimed_speedup": 1.14, "confirmed_regime": {"compile": True, "batch_size": 8192}}
    steps = {"bf16": 60.0, "bf16_mods": 47.0, "config": 41.0, "torchao_tensorwise_filter": 42.5,
             "scaled_mm_tensorwise_filter": 43.0}
    r = bench.assemble(prov, _e2e_results(steps), 50.0, study_s=540.0, budget_pct=0.5)
    assert r["best_recipe_speedup"] == pytest.approx(47.0 / 42.5)  # torchao's: the faster of the two
    assert r["vs_best_recipe"] == pytest.approx(42.5 / 41.0)
    assert {row["variant"] for row in r["e2e_rows"]} == set(steps)
    # config's eval log loss is 0.0002 above bf16's on each seed: +0.044% / +0.044%
    assert set(r["e2e_rel_ll_pct_vs_bf16_per_seed"]) == {"0", "1"}
    assert all(v == pytest.approx(100 * 0.0002 / (0.45 + 0.001 * int(s)))
               for s, v in r["e2e_rel_ll_pct_vs_bf16_per_seed"].items())
    assert r["pass"]["vs_best_recipe"] and r["pass"]["within_budget_every_seed"] and r["pass"]["study_s"]
    # 2% faster than the recipe is not enough; a budget of 0.01% is broken; 11 minutes is too long
    r = bench.assemble(prov, _e2e_results({**steps, "config": 41.7}), 50.0, study_s=660.0, budget_pct=0.01)
    assert r["vs_best_recipe"] == pytest.approx(42.5 / 41.7) and not r["pass"]["vs_best_recipe"]
    assert not r["pass"]["within_budget_every_seed"] and not r["pass"]["study_s"]


def test_receipt_keeps_inductors_cache_hit_rate_read_from_the_work_folders_study(tmp_path: Path) -> None:
    import optuna
    from optuna.distributions import CategoricalDistribution

    from loka_tune.tuner.study import load_study

    bench = _load("study_h200.py")
    study_file = tmp_path / "s.toml"
    study_file.write_text('[study]\nname = "h200"\n[model]\nname = "dlrm"\npreset = "tiny"\n[data]\nsource = "synthetic"\n')
    work = tmp_path / "work" / "study"
    cfg = load_study(study_file).with_output_dir(work)
    work.mkdir(parents=True)
    study = optuna.create_study(study_name=cfg.name, storage=cfg.storage.url)
    for i, cache in enumerate([{"hits": 0, "misses": 4}, {"hits": 3, "misses": 1}]):
        study.add_trial(optuna.trial.create_trial(
            params={"x": i}, distributions={"x": CategoricalDistribution([0, 1])}, value=0.01,
            user_attrs={"status": "ok", "cache_hit": False, "compile_cache": cache}))
    study.set_user_attr("loka.prepare_s", 41.5)
    cache = bench._inductor_cache(study_file, work)
    assert bench._prepare_s(study_file, work) == 41.5
    study.set_user_attr("loka.prepare_reused", {"seconds": 50.25, "saved": "2026-12-08 02:00:00"})
    assert bench._prepare_s(study_file, work) == 91.75  # the reused baseline runs are counted as run
    assert bench._prepare_phases(study_file, work) is None  # a study prepared before the parts were stored
    study.set_user_attr("loka.prepare_phases", {"baselines": 30.0, "probe": 11.5})
    assert bench._prepare_phases(study_file, work) == {"baselines": 30.0, "probe": 11.5}
    assert cache is not None and (cache["runs"], cache["hits"], cache["misses"]) == (2, 3, 5)
    prov = {"claimed_speedup": 1.10, "confirmed_regime": {"compile": True, "batch_size": 8192}}
    r = bench.assemble(prov, _e2e_results({"bf16": 50.0, "bf16_mods": 47.0, "config": 43.0}), 41.5,
                       inductor_cache=cache)
    assert r["inductor_cache_hit_rate"] == pytest.approx(3 / 8) and r["inductor_cache"]["misses"] == 5
    assert bench.assemble(prov, {"rows": [], "meta": {}}, None)["inductor_cache_hit_rate"] is None  # eager: none
