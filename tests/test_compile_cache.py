"""Issue 21 (time to answer): inductor's cache over a study's compiled runs, measured per run,
kept per trial and summed for the study, ``loka-tune report`` and the H200 receipt.

One test compiles for real on the CPU (inductor's C++ backend): a second trial run of one
config, and a confirmation run of it on another seed, load every graph from inductor's FX
graph cache; the others check the sums and the report's line on stored counts."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from loka_tune.config import ModsConfig, PrecisionConfig
from tests.tiny_measured import tiny_measured_study

STUDY = tiny_measured_study("cache", training={"steps": 8}, extra="[regime]\ncompile = true\n")


def _ctx(tmp_path: Path, study: Any) -> Any:
    from loka_tune.tuner.baseline import Baseline
    from loka_tune.tuner.build import make_source
    from loka_tune.tuner.prepare import StudyContext
    from loka_tune.tuner.study import load_study

    p = tmp_path / "s.toml"
    p.write_text(STUDY)
    cfg = load_study(p, cwd=tmp_path)
    bl = Baseline(seeds=(0, 1), eval_logloss=(0.69, 0.69), eval_ne=1.0, eval_auc=0.5, window_losses=(0.69, 0.69),
                  window_steps=(4, 8), noise_floor_pct=0.1, step_time_s=0.01, speed_source="measured",
                  measured_step_time_s=0.01)
    return StudyContext(cfg, study, make_source(cfg), bl, space=None, device="cpu", speed="measured")  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_second_compiled_run_of_a_config_loads_its_graphs_from_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two trial runs of one config (a fresh model each, a fresh dynamo each) and a confirmation
    run on another seed: the first compiles its graphs, the others find every one of them in
    inductor's FX graph cache (a fresh cache folder: nothing from another test or run)."""
    pytest.importorskip("torch._inductor")
    from loka_tune.tuner import confirm
    from loka_tune.tuner.results import compile_cache_totals
    from loka_tune.tuner.trial import evaluate_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor_cache"))
    study = SimpleNamespace(user_attrs={}, set_user_attr=lambda k, v: study.user_attrs.__setitem__(k, v))
    ctx = _ctx(tmp_path, study)
    config = PrecisionConfig(mods=ModsConfig(no_bias=True))  # bf16 + No Bias: one of a study's starts
    first = evaluate_config(ctx, config)
    second = evaluate_config(ctx, config)
    assert first.status == second.status == "ok", (first.reason, second.reason)
    assert first.run is not None and first.run["compile"] is True
    a, b = first.compile_cache, second.compile_cache
    assert a is not None and b is not None
    assert a["misses"] > 0 and a["hits"] == 0  # compiled, and stored
    assert b["hits"] == a["misses"] and b["misses"] == 0  # every graph again, from the cache
    seed1 = confirm._run_seed(ctx, config, 1)  # other weights, other data: the same graphs
    assert seed1["status"] == "ok" and seed1["compile_cache"]["hits"] == a["misses"]
    assert seed1["compile_cache"]["misses"] == 0
    tot = compile_cache_totals([a, b])
    assert tot is not None and tot["runs"] == 2 and tot["hit_rate"] == pytest.approx(0.5)


@pytest.mark.slow
@pytest.mark.parametrize("allowed", [True, False], ids=["strict_compile", "torch_default"])
def test_a_second_fp8_run_loads_its_traced_forward_and_backward_from_aotautograds_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, allowed: bool) -> None:
    """An FP8 site is a custom autograd.Function, which AOTAutograd's cache bypasses by torch's
    default: strict_compile lets it in, so a second compiled run of one FP8 config (a fresh
    model, another seed, a fresh dynamo) loads its traced forward + backward instead of tracing
    them again, and trains to the same numbers as with the bypass (``torch_default``: the
    setting off, the second run bypasses as the first). The site runs torch._scaled_mm, allowed
    on the CPU; the quickstart model with a 256 x 256 top layer, the site it aligns with."""
    import dataclasses

    pytest.importorskip("torch._inductor")
    import loka_tune.objectives.compiled as compiled
    from loka_tune.applier import apply
    from loka_tune.kernels.backends.scaled_mm import ScaledMMBackend
    from loka_tune.kernels.registry import register_backend, unregister_backend
    from loka_tune.objectives.trainer import train
    from loka_tune.tuner.build import make_model, make_source, train_config
    from loka_tune.tuner.study import load_study

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor_cache"))
    monkeypatch.setattr(compiled, "AOT_CACHE_CUSTOM_FUNCTIONS", allowed)

    @register_backend("cpu_scaled_mm_aot")
    class CPUScaledMM(ScaledMMBackend):
        devices = frozenset({"cpu"})

    try:
        cfg = load_study(Path(__file__).resolve().parents[1] / "studies" / "quickstart.toml")
        # torch._scaled_mm on the CPU is oneDNN's reference matmul (~2.4 s for 16 x 2048 x 2048):
        # a 256 x 256 top layer (16-aligned, as cuBLASLt's FP8 rule wants) and 16-row batches,
        # eval included (the quickstart's 2048-wide layer and 1024-row eval batch took ~150 s a run)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, overrides={**cfg.model.overrides, "top_mlp": [256, 256]}))
        source = make_source(cfg)
        tcfg = dataclasses.replace(train_config(cfg, 0, device="cpu"), compile=True, steps=3, batch_size=16,
                                   eval_batches=1, eval_batch_size=16)
        config = PrecisionConfig(sites={"top_mlp.1.linear": "e4m3.tensor.cpu_scaled_mm_aot"})
        counts, losses = [], []
        for seed in (0, 1):
            model = make_model(cfg, source, seed=seed)
            assert list(apply(model, config).replaced) == ["top_mlp.1.linear"]
            with compiled.strict_compile():
                res = train(model, source, dataclasses.replace(tcfg, seed=seed), progress=False)
            assert res.ok
            counts.append(compiled.compile_cache_counts())
            losses.append(res.step_losses)
    finally:
        unregister_backend("cpu_scaled_mm_aot")
    first, second = counts
    if allowed:
        assert first["aot_misses"] == 1 and first["aot_bypass"] == 0, first  # traced, and stored
        assert second["aot_hits"] == 1 and second["aot_bypass"] == 0, second
    else:
        assert first["aot_bypass"] == second["aot_bypass"] == 1 and second["aot_hits"] == 0, counts
    assert second["hits"] > 0 and second["misses"] == 0  # inductor's graphs from its cache either way
    assert losses[0] != losses[1]  # two seeds: the cache keyed the graph, not the numbers


def _study(trials: list[dict[str, Any]]) -> Any:
    import optuna
    from optuna.distributions import CategoricalDistribution

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="cache")
    for i, attrs in enumerate(trials):
        study.add_trial(optuna.trial.create_trial(
            params={"x": i}, distributions={"x": CategoricalDistribution(list(range(len(trials))))}, value=0.01,
            user_attrs={"config_key": f"k{i}", "status": "ok", "feasible": True, "cache_hit": False, **attrs}))
    return study


def _counts(hits: int, misses: int, bypass: int = 0, **aot: int) -> dict[str, int]:
    return {"hits": hits, "misses": misses, "bypass": bypass, "aot_hits": 0, "aot_misses": 0, "aot_bypass": 0, **aot}


def test_the_study_sums_its_trials_cache_counts_and_report_prints_them() -> None:
    from loka_tune.commands.report import format_compile_cache
    from loka_tune.tuner.results import ATTR_CONFIRM, compile_cache_summary

    assert compile_cache_summary(_study([{}, {}])) is None  # eager trials: nothing compiled
    assert format_compile_cache(None) is None
    study = _study([{"compile_cache": _counts(0, 6, aot_bypass=1)},
                    {"compile_cache": _counts(4, 2, 1, aot_bypass=1)},
                    {"compile_cache": _counts(4, 2, 1), "cache_hit": True, "cached_from": 1},  # a copy ran nothing
                    {}])  # a trial recorded before the counts (or eager): left out
    s = compile_cache_summary(study)
    assert s is not None
    assert (s["runs"], s["hits"], s["misses"], s["bypass"], s["aot_bypass"]) == (2, 4, 8, 1, 2)
    assert s["hit_rate"] == pytest.approx(4 / 13) and s["confirmation"] is None
    line = format_compile_cache(s)
    assert line == ("inductor cache: 4 hits / 8 misses, 1 bypassed across 2 compiled trial runs (hit rate 31%);"
                    " AOTAutograd's cache: 0 hits / 0 misses / 2 bypassed")
    # the confirmation's runs are summed apart (a trial's own run that stands for a seed ran nothing)
    study.set_user_attr(ATTR_CONFIRM, {"rows": [{"trial": 1, "runs": [
        {"seed": 0, "status": "ok", "reused": "trial 1"},
        {"seed": 1, "status": "ok", "compile_cache": _counts(6, 0)}]}]})
    s = compile_cache_summary(study)
    assert s is not None and s["confirmation"] == {"runs": 1, **_counts(6, 0), "hit_rate": 1.0}
    assert format_compile_cache(s).startswith(  # type: ignore[union-attr]
        "inductor cache: 4 hits / 8 misses, 1 bypassed across 2 compiled trial runs (hit rate 31%);"
        " confirmation: 6 hits / 0 misses across 1 compiled runs (hit rate 100%)")


def test_the_confirmation_stores_the_studys_cache_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from loka_tune.tuner import confirm
    from loka_tune.tuner.results import ATTR_COMPILE_CACHE

    config = PrecisionConfig.from_sites({"top_mlp.0.linear": "e4m3.row.emulated"})
    study = _study([{"config": config.to_dict(), "budget_pct": 1.0, "speed_source": "measured", "rel_logloss_pct": 0.1,
                     "speedup_vs_mods": 1.1, "speedup": 1.1,
                     "compile_cache": _counts(1, 5)}])
    study.set_user_attr("loka.baseline", {"eval_logloss": [0.69, 0.69], "step_time_s": 0.01, "noise_floor_pct": 0.1})
    monkeypatch.setattr(confirm, "_run_seed", lambda ctx, config, seed: {
        "seed": seed, "status": "ok", "rel_logloss_pct": 0.1, "step_time_s": 0.009, "ref_step_time_s": 0.01,
        "compile_cache": _counts(6, 0)})
    res = confirm.confirm_best(_ctx(tmp_path, study))
    assert res is not None and res["chosen"] == 0
    stored = study.user_attrs[ATTR_COMPILE_CACHE]
    assert (stored["runs"], stored["hits"], stored["misses"]) == (1, 1, 5)
    assert stored["confirmation"]["runs"] == 2 and stored["confirmation"]["hits"] == 12


@pytest.mark.slow
def test_a_compiled_runs_first_step_says_where_its_compile_went(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled run's ``compile_s`` splits its first step's compile by dynamo's own timers: a
    cold run traces and compiles both graphs (forward, backward), and inductor's kernel codegen
    lies inside them; the same config run again from the caches traces but compiles neither graph.
    The baseline line says it inside the first step's brackets, and the result's JSON keeps it."""
    pytest.importorskip("torch._inductor")
    import dataclasses
    import json

    from loka_tune.applier import apply
    from loka_tune.objectives.compiled import strict_compile
    from loka_tune.objectives.trainer import phases_note, train
    from loka_tune.tuner.build import make_model, make_source, train_config
    from loka_tune.tuner.study import load_study

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor_cache"))
    p = tmp_path / "s.toml"
    p.write_text(STUDY)
    cfg = load_study(p, cwd=tmp_path)
    source = make_source(cfg)
    tcfg = dataclasses.replace(train_config(cfg, 0, device="cpu"), compile=True, steps=3)
    runs = []
    for _ in range(2):
        model = make_model(cfg, source, seed=0)
        apply(model, PrecisionConfig())
        with strict_compile():
            runs.append(train(model, source, tcfg, progress=False))
    cold, warm = runs
    assert cold.ok and warm.ok
    c = cold.compile_s
    assert {"tracing", "forward", "backward", "kernel codegen", "module load"} <= set(c), c
    assert all(v > 0 for v in c.values() if v is not None), c
    assert c["kernel codegen"] + c["module load"] < c["forward"] + c["backward"]  # inside the two compiles
    assert "tracing" in warm.compile_s and not {"forward", "backward"} & set(warm.compile_s), warm.compile_s
    assert "module load" in warm.compile_s  # the cached graphs' modules, loaded
    note = phases_note(cold)
    assert note.startswith(f"first step {cold.phases_s['first_step']:.1f}s (compiling: tracing "), note
    assert f"forward {c['forward']:.1f}s, backward {c['backward']:.1f}s; kernel codegen" in note, note
    assert json.loads(json.dumps(cold.to_dict()))["compile_s"]["forward"] == pytest.approx(c["forward"])


def test_compile_note_says_the_parts_that_ran_and_the_compile_workers_state() -> None:
    """``compile_note`` names each part in order, the two graphs apart from the kernels, and the
    pool of compile workers with whether it was up (until it is, inductor compiles its kernels in
    the process); an eager run's empty split says nothing."""
    from loka_tune.objectives.compiled import compile_note

    assert compile_note({}) == ""
    split = {"tracing": 2.14, "forward": 12.0, "backward": 13.06, "kernel codegen": 15.0, "module load": 1.23,
             "kernel wait": 3.0, "workers": 16.0, "workers_ready": 0.0}
    assert compile_note(split) == ("tracing 2.1s, forward 12.0s, backward 13.1s; kernel codegen 15.0s,"
                                   " module load 1.2s, kernel wait 3.0s; 16 compile workers (not up yet)")
    assert compile_note({"tracing": 0.5, "workers": 8.0, "workers_ready": 1.0}) == (
        "tracing 0.5s; 8 compile workers (up)")


def test_compile_split_reads_dynamos_timers_and_the_pool_without_importing_either(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``compile_split`` sums dynamo's timers of each part (a part that did not run is left out)
    and reads inductor's pool of compile workers only where one was made; with neither module
    imported it returns ``{}`` (and imports nothing)."""
    import sys
    import types

    from loka_tune.objectives import compiled

    utils = types.ModuleType("torch._dynamo.utils")
    utils.compilation_time_metrics = {"bytecode_tracing": [1.0, 0.5], "compile_fx.<locals>.fw_compiler_base": [4.0],
                                      "Scheduler.codegen": [2.0, 1.0], "unrelated": [9.0]}  # type: ignore[attr-defined]

    class Ready:
        def done(self) -> bool:
            return True

    ac = types.ModuleType("torch._inductor.async_compile")
    ac.AsyncCompile = type("AsyncCompile", (), {"_ready_future": Ready()})  # type: ignore[attr-defined]
    ac.get_compile_threads = lambda: 16  # type: ignore[attr-defined]
    ac._pool_set = set()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch._dynamo.utils", utils)
    monkeypatch.setitem(sys.modules, "torch._inductor.async_compile", ac)
    assert compiled.compile_split() == {"tracing": 1.5, "forward": 4.0, "kernel codegen": 3.0}  # no pool made
    ac._pool_set = {"pool"}  # type: ignore[attr-defined]
    assert compiled.compile_split() == {"tracing": 1.5, "forward": 4.0, "kernel codegen": 3.0, "workers": 16.0,
                                        "workers_ready": 1.0}
    monkeypatch.delitem(sys.modules, "torch._dynamo.utils")
    monkeypatch.delitem(sys.modules, "torch._inductor.async_compile")
    assert compiled.compile_split() == {}
    assert "torch._dynamo.utils" not in sys.modules
