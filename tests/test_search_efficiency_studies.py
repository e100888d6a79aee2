"""benchmarks/search_efficiency_studies.py: the arms are real studies, and "short runs to the best" follow the trial records."""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import sys
import tomllib
from pathlib import Path

import pytest

from tests import test_tune as _tune_tests

REPO = Path(__file__).resolve().parents[1]

# test_tune's tiny DLRM study; arm_config sets the name, output dir, trial count and tracking
TINY = _tune_tests.TINY.format(name="se", out="unused", model=_tune_tests.DLRM, budget=50.0, space_extra="",
                               n_trials=99, tracking="false").replace("min_speedup = 0.0", "min_speedup = 1.0")


@pytest.fixture(scope="module")
def se():  # noqa: ANN201
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        yield importlib.import_module("search_efficiency_studies")
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def _rec(trial: int, value: float | None, *, feasible: bool = True, cache: bool = False, n_eval: int,
         key: str = "k", rel: float = 0.0) -> dict:
    return {"trial": trial, "state": "COMPLETE" if value is not None else "PRUNED", "evaluated": not cache,
            "n_evaluated": n_eval, "cached_from": None, "seeded": None, "feasible": feasible and value is not None,
            "step_time_s": value, "speedup": None if value is None else 1.0 / value, "rel_logloss_pct": rel,
            "config_key": key, "wall_s": 0.1}


def test_summarize_counts_short_runs_not_cache_hits_and_censors(se) -> None:  # noqa: ANN001
    a = [_rec(0, 1.0, n_eval=1, key="a"), _rec(1, 0.9, cache=True, n_eval=1, key="a"),
         _rec(2, 0.8, feasible=False, n_eval=2, key="b"), _rec(3, None, n_eval=3, key="c"),
         _rec(4, 0.701, n_eval=4, key="d"), _rec(5, 0.701, cache=True, n_eval=4, key="d")]
    b = [_rec(0, 0.9, n_eval=1, key="e"), _rec(1, 0.7, n_eval=2, key="f"), _rec(2, 0.6, feasible=False, n_eval=3)]
    c = [_rec(0, 0.95, n_eval=1, key="g"), _rec(1, 0.95, cache=True, n_eval=1, key="g")]
    runs = [{"arm": "loka", "seed": 0, "wall_s": 1.0, "records": a},
            {"arm": "tpe", "seed": 0, "wall_s": 1.0, "records": b},
            {"arm": "tpe", "seed": 1, "wall_s": 1.0, "records": c}]
    s = se.summarize(runs, tol=0.005)
    assert s["overall_best_step_time_s"] == 0.7  # infeasible 0.6 and 0.8 do not count
    ra, rb, rc = s["per_run"]
    assert (ra["n_evaluated"], ra["n_cache_hits"], ra["evals_to_run_best"], ra["best_trial"]) == (4, 2, 4, 4)
    assert ra["reaches_overall_best"] and ra["evals_to_overall_best"] == 4  # 0.701 is within 0.5% of 0.7
    assert ra["evals_to_overall_best_exact"] is None  # ... but not exactly
    assert rb["evals_to_run_best"] == 2 and rb["evals_to_overall_best_exact"] == 2
    assert not rc["reaches_overall_best"] and rc["censored_at"] == 1 and rc["evals_to_overall_best"] is None
    tpe = s["arms"]["tpe"]
    assert tpe["reached_overall_best"] == 1 and tpe["evals_to_overall_best_is_lower_bound"]
    assert tpe["evals_to_overall_best"]["mean"] == 1.5  # (2 + censored 1) / 2
    assert s["acceptance"]["met"] is False  # loka needs 4 > 1.5 / 3
    strict = se.summarize(runs, tol=0.0)
    assert not strict["per_run"][0]["reaches_overall_best"]
    # the same configuration evaluated in two runs with different results shows up in the determinism check
    runs[2]["records"][0]["config_key"] = "a"
    assert se.summarize(runs)["determinism"]["max_rel_diff_step_time"] == pytest.approx(0.05)


def test_run_benchmark_real_studies_tiny_budget(se, tmp_path: Path) -> None:  # noqa: ANN001
    res = se.run_benchmark(TINY, n_trials=2, seeds=[0], arms=("loka", "tpe"), workdir=tmp_path, log=False)
    assert {"meta", "base_study", "runs", "summary"} <= set(res)
    assert res["meta"]["n_trials"] == 2 and res["meta"]["torch"]
    loka, tpe = res["runs"]
    assert (loka["arm"], tpe["arm"]) == ("loka", "tpe")
    for run in res["runs"]:
        recs = run["records"]
        # 2 short runs; a cache copy (a configuration drawn again) is recorded beside them, not counted
        assert sum(r["evaluated"] for r in recs) == 2 and [r["trial"] for r in recs] == list(range(len(recs)))
        assert [r["n_evaluated"] for r in recs] == list(itertools.accumulate(int(r["evaluated"]) for r in recs))
    # loka starts with its enqueued trials; plain TPE gets none, and its space was not probe-pruned
    assert loka["records"][0]["seeded"] == "all-bf16" and loka["records"][0]["speedup"] == pytest.approx(1.0)
    assert not any(r["seeded"] for r in tpe["records"])
    assert "slow" in loka["space"]["dropped"] and set(tpe["space"]["dropped"]) <= {"ineligible"}
    assert tpe["space"]["configs"] > loka["space"]["configs"]
    assert (tmp_path / "tpe-seed0" / "optuna.db").is_file() and not (tmp_path / "tpe-seed0" / "probe_report.json").exists()
    # the same baseline in both arms (deterministic short runs)
    assert loka["baseline"]["eval_logloss"] == tpe["baseline"]["eval_logloss"]
    # "short runs to best" agree with the records
    s = res["summary"]
    best = s["overall_best_step_time_s"]
    assert best == min(r["step_time_s"] for run in res["runs"] for r in run["records"] if r["feasible"])
    for row, run in zip(s["per_run"], res["runs"]):
        feas = [r for r in run["records"] if r["feasible"]]
        own = min(r["step_time_s"] for r in feas)
        first = next(r for r in feas if r["step_time_s"] == own)
        assert row["best_step_time_s"] == own and row["evals_to_run_best"] == first["n_evaluated"]
        hit = next((r for r in feas if r["step_time_s"] <= best * 1.005), None)
        assert row["evals_to_overall_best"] == (hit and hit["n_evaluated"])
        assert row["reaches_overall_best"] == (hit is not None)
    md = se.to_markdown(res, "cmd")
    assert "| loka | 0 |" in md and "| tpe | 0 |" in md and "Acceptance target" in md


def test_arm_config_changes_only_the_arm_keys(se, tmp_path: Path) -> None:  # noqa: ANN001
    base = tomllib.loads(se.BASE_STUDY)
    a = se.arm_config(base, "tpe", 2, 30, tmp_path)
    b = se.arm_config(base, "loka", 1, 30, tmp_path)
    assert (a.probe.enabled, a.trials.enqueue_starts, a.study.seed) == (False, False, 2)
    assert (b.probe.enabled, b.trials.enqueue_starts, b.study.seed) == (True, True, 1)
    assert a.trials.n_trials == b.trials.n_trials == 30 and a.tracking.enabled is False
    assert a.space.per_gemm and not b.space.per_gemm  # plain TPE searches the per-GEMM space, loka the recipes
    assert dataclasses.replace(a.space, per_gemm=False) == b.space
    assert a.training == b.training and a.objective == b.objective and a.model == b.model
    assert a.storage.url != b.storage.url and str(tmp_path) in a.storage.url
    with pytest.raises(ValueError, match="unknown arm"):
        se.run_benchmark(se.BASE_STUDY, n_trials=1, seeds=[0], arms=("random",), workdir=tmp_path)
