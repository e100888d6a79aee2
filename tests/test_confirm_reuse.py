"""Issue 21 (time to answer): the confirmation takes a trial's own run for the seed it ran on,
in the measured regime too, and trains only the other seeds; what it concludes is what a full
re-run gives where runs are deterministic.

The runs are a deterministic stand-in for training (a function of the config, the seed and
the run's settings), counted per caller: a trial's run, a confirmation run, a bf16 + Mods
timing run. The models, the configs applied to them and the whole tuner path around the runs
(evaluate_config, the trial record, confirm_best) are the real ones, with measured speed."""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from loka_tune.config import ModsConfig, PrecisionConfig
from tests.tiny_measured import tiny_measured_study

STUDY = tiny_measured_study("reuse", extra="[confirm]\nn_best = 3\n")

ROW = "e4m3.row.emulated"
# (sites in FP8, Mods): four configs; their fake step times order them 3, 2, 1, 0 (fastest first)
CONFIGS = [
    PrecisionConfig(),
    PrecisionConfig.from_sites({"top_mlp.0.linear": ROW}),
    PrecisionConfig.from_sites({"top_mlp.0.linear": ROW, "bottom_mlp.1.linear": ROW}, mods=ModsConfig(no_bias=True)),
    PrecisionConfig.from_sites({"top_mlp.0.linear": ROW, "bottom_mlp.1.linear": ROW, "head": ROW}),
]


def _n_fp8(config: PrecisionConfig) -> int:
    """Sites with an FP8 GEMM."""
    return sum(1 for s in config.to_dict().get("sites", {}).values() if any(v != "bf16" for v in s.values()))


def _step_s(config: PrecisionConfig, seed: int) -> float:
    mods = 0.95 if config.mods.no_bias else 1.0
    return 0.010 * (1 - 0.08 * _n_fp8(config)) * mods * (1 + 0.03 * seed)


def _logloss(config: PrecisionConfig, seed: int) -> float:
    return 0.5 * (1 + 0.0015 * _n_fp8(config) + 0.002 * seed) + (0.01 * seed if _n_fp8(config) == 3 else 0.0)


class Runs:
    """The stand-in for ``train_in_study``: deterministic numbers, calls counted by where they come from."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.seeds: list[tuple[str, int]] = []

    def fake(self, where: str) -> Any:
        def _train(model: Any, source: Any, tcfg: Any, *, seed: int | None, config: PrecisionConfig,
                   **kw: Any) -> Any:
            self.calls[where] += 1
            self.seeds.append((config.key(), tcfg.seed))
            return SimpleNamespace(status="ok", step_time_s=_step_s(config, tcfg.seed),
                                   eval_logloss=_logloss(config, tcfg.seed), eval_ne=1.0, eval_auc=0.6,
                                   steps_run=tcfg.steps, step_losses=(0.7,) * tcfg.steps, nonfinite_step=None,
                                   loss_curve=(0.6,), curve_steps=(4,))
        return _train


@pytest.fixture()
def runs(monkeypatch: pytest.MonkeyPatch) -> Runs:
    from loka_tune.tuner import baseline, confirm, trial

    r = Runs()
    monkeypatch.setattr(trial, "train_in_study", r.fake("trial"))
    monkeypatch.setattr(confirm, "train_in_study", r.fake("confirm"))
    monkeypatch.setattr(baseline, "train_in_study", r.fake("reference"))  # time_reference: bf16 + Mods timing runs
    return r


def _ctx(tmp_path: Path, study: Any) -> Any:
    from loka_tune.tuner.baseline import Baseline
    from loka_tune.tuner.build import make_source
    from loka_tune.tuner.prepare import StudyContext
    from loka_tune.tuner.study import load_study

    p = tmp_path / "s.toml"
    p.write_text(STUDY)
    cfg = load_study(p, cwd=tmp_path)
    bf16 = PrecisionConfig()
    bl = Baseline(seeds=(0, 1), eval_logloss=(_logloss(bf16, 0), _logloss(bf16, 1)), eval_ne=1.0, eval_auc=0.6,
                  window_losses=(0.6, 0.55, 0.5), window_steps=(4, 8, 12), noise_floor_pct=0.1,
                  step_time_s=_step_s(bf16, 0), speed_source="measured", measured_step_time_s=_step_s(bf16, 0))
    return StudyContext(cfg, study, make_source(cfg), bl, space=None, device="cpu", speed="measured")  # type: ignore[arg-type]


def _searched(tmp_path: Path, runs: Runs) -> tuple[Any, Any]:
    """A study whose four trials ran through evaluate_config (recorded as the loop records them)."""
    import optuna
    from optuna.distributions import CategoricalDistribution

    from loka_tune.tuner.results import TrialRecord
    from loka_tune.tuner.trial import evaluate_config

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="reuse")
    ctx = _ctx(tmp_path, study)
    for i, config in enumerate(CONFIGS):
        out = evaluate_config(ctx, config)
        assert out.status == "ok"
        start = TrialRecord(config_key=config.key(), config=config.to_dict(), budget_pct=1.0, worker="w",
                            speed_source=ctx.speed)
        rec = TrialRecord(**out.attrs(), feasible=out.feasible(1.0), cache_hit=False)
        study.add_trial(optuna.trial.create_trial(
            params={"x": i}, distributions={"x": CategoricalDistribution(list(range(len(CONFIGS))))},
            value=out.step_time_s, user_attrs={**start.start_attrs(), **rec.result_attrs()}))
    # CONFIGS[0], plain bf16, is the baseline's own run (not trained again); the one Mods set's
    # reference is timed once and shared (its config has FP8 sites: its run is not the reference)
    assert runs.calls == {"trial": 3, "reference": 1}
    return study, ctx


def _older(study: Any) -> Any:
    """The same study as an older loka-tune recorded it: trials without ``run``."""
    import optuna

    old = optuna.create_study(study_name="reuse-old")
    for t in study.get_trials():
        attrs = {k: v for k, v in t.user_attrs.items() if k != "run"}
        old.add_trial(optuna.trial.create_trial(params=t.params, distributions=t.distributions, value=t.value,
                                                user_attrs=attrs))
    for k, v in study.user_attrs.items():
        if k.startswith("loka.reference."):  # the measured reference, not the earlier confirmation
            old.set_user_attr(k, v)
    return old


def test_a_trial_records_how_it_ran(tmp_path: Path, runs: Runs) -> None:
    study, ctx = _searched(tmp_path, runs)
    for t in study.trials:
        assert t.user_attrs["run"] == {"seed": 0, "steps": 12, "compile": False, "cuda_graphs": False, "batch_size": 32,
                                       "autocast": "auto", "device": "cpu", "dual_cast": "off",
                                       "dual_cast_op": "inline", "nproc": 1}
        assert "compile_cache" not in t.user_attrs  # an eager run compiles nothing
    assert {s for _, s in runs.seeds} == {0}  # every trial (and the reference) ran on the pairing seed
    # a run traced under another cast path is another run (its record says which)
    from loka_tune.kernels.dualcast import dual_cast_mode
    from loka_tune.tuner.trial import run_description

    tcfg = ctx.cfg.training.to_train_config()
    with dual_cast_mode("auto"):
        assert run_description(ctx.cfg, tcfg)["dual_cast"] == "auto"
    assert run_description(ctx.cfg, tcfg)["dual_cast"] == "off"


def test_the_confirmation_takes_each_trials_own_run_for_its_seed(tmp_path: Path, runs: Runs,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from loka_tune.tuner import confirm
    from loka_tune.tuner.log import to_stderr

    to_stderr()  # the library only logs: show its progress lines, as the CLI does
    study, ctx = _searched(tmp_path, runs)
    runs.calls.clear()
    capsys.readouterr()
    res = confirm.confirm_best(ctx)
    assert res is not None and res["trials"] == [3, 2, 1] and res["seeds"] == [0, 1]
    reused_calls = dict(runs.calls)
    err = capsys.readouterr().err
    for n in (3, 2, 1):
        assert f"[loka-tune] confirm: trial {n}'s own run stands for seed 0" in err
    rows = {r["trial"]: r for r in res["rows"]}
    for n, row in rows.items():
        by_seed = {x["seed"]: x for x in row["runs"]}
        assert by_seed[0]["reused"] == f"trial {n}" and "reused" not in by_seed[1]
        t = study.trials[n]
        # seed 0 is the trial's own numbers: its step time, the reference timed for it, its loss
        assert by_seed[0]["step_time_s"] == t.value
        assert by_seed[0]["ref_step_time_s"] == t.user_attrs["mods_step_time_s"]
        assert by_seed[0]["rel_logloss_pct"] == pytest.approx(t.user_attrs["rel_logloss_pct"], abs=1e-12)

    # the same study recorded without `run` (an older loka-tune): every seed is trained again
    old = _older(study)
    runs.calls.clear()
    full = confirm.confirm_best(_ctx(tmp_path, old))
    assert full is not None and full["trials"] == res["trials"]
    assert all("reused" not in x for r in full["rows"] for x in r["runs"])
    # one config run and its reference timing run fewer per candidate; nothing else
    assert dict(runs.calls) == {"confirm": 6, "reference": 6}
    assert reused_calls == {"confirm": 3, "reference": 3}
    # where runs are deterministic, the same answer as the full re-run, number for number
    assert full["chosen"] == res["chosen"] == 2  # trial 3 (3 sites) breaks the budget on seed 1
    keys = ("step_time_s", "ref_step_time_s", "speedup_vs_mods", "speedup", "rel_logloss_pct", "rel_logloss_sd_pct",
            "feasible")
    for a, b in zip(res["rows"], full["rows"]):
        assert {k: a[k] for k in keys} == pytest.approx({k: b[k] for k in keys}, rel=1e-12)
    assert not rows[3]["feasible"] and rows[2]["feasible"] and rows[1]["feasible"]


def test_a_trial_that_ran_otherwise_is_run_again(tmp_path: Path, runs: Runs) -> None:
    """A record whose run is not the confirmation's (another batch: a study resumed with another
    [regime]; another speed source) does not stand for it."""
    import optuna

    from loka_tune.tuner import confirm

    study, _ = _searched(tmp_path, runs)
    other = optuna.create_study(study_name="reuse-other")
    for t in study.get_trials():
        attrs = copy.deepcopy(dict(t.user_attrs))
        if t.number == 3:
            attrs["run"]["batch_size"] = 64
        if t.number == 2:
            attrs["speed_source"] = "modeled"
        other.add_trial(optuna.trial.create_trial(params=t.params, distributions=t.distributions, value=t.value,
                                                  user_attrs=attrs))
    for k, v in study.user_attrs.items():
        other.set_user_attr(k, v)  # this study was never confirmed: only its reference is stored
    runs.calls.clear()
    runs.seeds.clear()
    res = confirm.confirm_best(_ctx(tmp_path, other))
    assert res is not None
    reused = {r["trial"]: [x["seed"] for x in r["runs"] if x.get("reused")] for r in res["rows"]}
    assert reused == {3: [], 2: [], 1: [0]}
    assert dict(runs.calls) == {"confirm": 5, "reference": 5}
    assert sorted(s for k, s in runs.seeds if k == CONFIGS[3].key()) == [0, 1]  # both seeds trained again


def test_a_confirmation_cut_short_goes_on_from_its_finished_runs(tmp_path: Path, runs: Runs,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (or a time limit) in the middle of the confirmation: run again, it takes the runs it
    had finished (kept in the study as each finished) and trains only the rest; its answer is the
    one an uncut confirmation gives."""
    from loka_tune.tuner import confirm
    from loka_tune.tuner.results import ATTR_CONFIRM, ATTR_CONFIRM_RUNS

    study, ctx = _searched(tmp_path, runs)
    whole = confirm.confirm_best(_ctx(tmp_path, _older(study)))  # an uncut one, every seed trained
    real = confirm._run_seed
    calls: list[int] = []

    def cut(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(confirm, "_run_seed", cut)
    runs.calls.clear()
    with pytest.raises(KeyboardInterrupt):
        confirm.confirm_best(ctx)
    assert ATTR_CONFIRM not in study.user_attrs and len(study.user_attrs[ATTR_CONFIRM_RUNS]) == 1
    assert dict(runs.calls) == {"confirm": 1, "reference": 1}  # trial 3 on seed 1, then the cut
    monkeypatch.setattr(confirm, "_run_seed", real)
    runs.calls.clear()
    res = confirm.confirm_best(_ctx(tmp_path, study))
    assert res is not None and dict(runs.calls) == {"confirm": 2, "reference": 2}  # trials 2 and 1 on seed 1
    by_trial = {r["trial"]: {x["seed"]: x for x in r["runs"]} for r in res["rows"]}
    assert by_trial[3][1]["kept"] == "an earlier confirmation" and "kept" not in by_trial[2][1]
    assert whole is not None and res["chosen"] == whole["chosen"] == 2
    keys = ("step_time_s", "ref_step_time_s", "speedup_vs_mods", "rel_logloss_pct", "feasible")
    for a, b in zip(res["rows"], whole["rows"]):
        assert {k: a[k] for k in keys} == pytest.approx({k: b[k] for k in keys}, rel=1e-12)


def test_a_bf16_run_on_a_seed_the_baseline_lacks_is_kept_too(tmp_path: Path, runs: Runs) -> None:
    """A one-seed baseline: the confirmation's second seed needs bf16's log loss on it, one bf16
    run; a confirmation run again (a new process: no in-memory reference) takes it from the study."""
    from dataclasses import replace

    from loka_tune.tuner import confirm

    study, ctx = _searched(tmp_path, runs)
    one_seed = replace(ctx.baseline, seeds=(0,), eval_logloss=ctx.baseline.eval_logloss[:1])
    runs.calls.clear()
    assert confirm._bf16_logloss(replace(ctx, baseline=one_seed), 1) == pytest.approx(_logloss(PrecisionConfig(), 1))
    assert dict(runs.calls) == {"confirm": 1}
    fresh = replace(ctx, baseline=one_seed, references={})
    assert confirm._bf16_logloss(fresh, 1) == pytest.approx(_logloss(PrecisionConfig(), 1))
    assert dict(runs.calls) == {"confirm": 1}  # not run again
