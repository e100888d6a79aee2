"""Issue 13: the production regime reaches the trial trainer, trials carry speed-ups vs bf16 and
vs bf16 + the same Mods, the confirmation stage picks the confirmed best, the export records it,
and the probe leaves the steps that do not collect hook-free."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from loka_tune.config import ModsConfig, PrecisionConfig
from loka_tune.errors import ConfigError, StudyError
from tests.tiny_measured import tiny_measured_study

STUDY = tiny_measured_study("regime")


def _cfg(tmp_path: Path, extra: str = "") -> Any:
    from loka_tune.tuner.study import load_study

    p = tmp_path / "s.toml"
    p.write_text(STUDY + extra)
    return load_study(p, cwd=tmp_path)


# ---------------------------------------------------------------------------------------------
# the regime


def test_regime_defaults_compile_on_cuda_only(tmp_path: Path) -> None:
    from loka_tune.tuner.build import train_config

    cfg = _cfg(tmp_path)
    cpu = train_config(cfg, device="cpu")
    assert (cpu.compile, cpu.cuda_graphs, cpu.batch_size, cpu.warmup_steps) == (False, False, 32, 1)
    # on CUDA "auto" compiles, and compilation stays out of the timed steps
    assert cfg.regime.compiled("cuda") and cfg.regime.compiled("cuda:1") and not cfg.regime.compiled("cpu")
    cuda = cfg.regime.apply(cfg.training.to_train_config(device="cuda"))
    assert cuda.compile and cuda.warmup_steps == 3


def test_regime_overrides_training_and_quotes_bad_values(tmp_path: Path) -> None:
    from loka_tune.tuner.build import train_config

    cfg = _cfg(tmp_path, '[regime]\ncompile = true\nbatch_size = 64\nautocast = "off"\n')
    t = train_config(cfg, 1, device="cpu")
    assert (t.compile, t.batch_size, t.autocast, t.seed, t.warmup_steps) == (True, 64, "off", 1, 3)
    assert cfg.batch_size == 64 and cfg.cost_batch_size == 64
    with pytest.raises(ConfigError, match="'yes'") as e:
        _cfg(tmp_path, '[regime]\ncompile = "yes"\n')
    assert e.value.key == "regime.compile"
    graphs = _cfg(tmp_path, "[regime]\ncuda_graphs = true\n")
    with pytest.raises(ConfigError, match="--device cuda"):
        train_config(graphs, device="cpu")
    with pytest.raises(ConfigError, match=r"\[3\]") as e:
        _cfg(tmp_path, "[confirm]\nseeds = [3]\n")
    assert e.value.key == "confirm.seeds"


def _fake_result(step_time_s: float = 0.01, logloss: float = 0.5) -> Any:
    return SimpleNamespace(status="ok", step_time_s=step_time_s, eval_logloss=logloss, eval_ne=1.0, eval_auc=0.6,
                           steps_run=12, step_losses=(0.7,) * 12, loss_curve=(0.6, 0.55, 0.5), curve_steps=(4, 8, 12),
                           nonfinite_step=None)


def _ctx(cfg: Any, *, speed: str = "measured", study: Any = None) -> Any:
    from loka_tune.tuner.baseline import Baseline
    from loka_tune.tuner.build import make_source
    from loka_tune.tuner.prepare import StudyContext

    bl = Baseline(seeds=(0, 1), eval_logloss=(0.5, 0.502), eval_ne=1.0, eval_auc=0.6, window_losses=(0.6, 0.55, 0.5),
                  window_steps=(4, 8, 12), noise_floor_pct=0.4, step_time_s=0.012, speed_source="measured",
                  measured_step_time_s=0.012)
    return StudyContext(cfg, study, make_source(cfg), bl, space=None, device="cpu", speed=speed)  # type: ignore[arg-type]


def _counting_runs(monkeypatch: pytest.MonkeyPatch, step_s: list[float]) -> list[Any]:
    """Every training run of a trial (``trial``) and of a bf16 + Mods reference (``baseline``)
    through one fake, its n-th run timed at ``step_s[n]``; returns the runs' TrainConfigs."""
    from loka_tune.tuner import baseline, trial

    seen: list[Any] = []

    def fake_train(model: nn.Module, source: Any, tcfg: Any, on_step: Any = None, **kw: Any) -> Any:
        seen.append(tcfg)
        return _fake_result(step_s[len(seen) - 1])

    monkeypatch.setattr(trial, "train_in_study", fake_train)
    monkeypatch.setattr(baseline, "train_in_study", fake_train)
    return seen


ROW = "e4m3.row.emulated"


def test_the_regime_reaches_the_trial_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trial's run, and the bf16 + Mods reference it is compared with, are timed in the regime."""
    from loka_tune.tuner import trial

    cfg = _cfg(tmp_path, "[regime]\ncompile = true\nbatch_size = 48\n")
    seen = _counting_runs(monkeypatch, [0.010, 0.011, 0.009])
    study = SimpleNamespace(user_attrs={}, set_user_attr=lambda k, v: study.user_attrs.__setitem__(k, v))
    ctx = _ctx(cfg, study=study)
    fp8 = PrecisionConfig.from_sites({"top_mlp.0.linear": ROW}, mods=ModsConfig(no_bias=True))
    out = trial.evaluate_config(ctx, fp8)
    assert out.status == "ok"
    assert [(t.compile, t.batch_size, t.warmup_steps) for t in seen] == [(True, 48, 3), (True, 48, 3)]
    # speed vs bf16 (the baseline's 12 ms) and vs bf16 + the same Mods (the reference run's 11 ms)
    assert out.speedup == pytest.approx(0.012 / 0.010) and out.speedup_vs_mods == pytest.approx(0.011 / 0.010)
    assert out.mods_step_time_s == pytest.approx(0.011)
    # the reference is measured once per Mods set and shared through the study
    assert study.user_attrs["loka.reference.nobias"] == pytest.approx(0.011)
    again = trial.evaluate_config(ctx, fp8)
    assert len(seen) == 3 and again.mods_step_time_s == pytest.approx(0.011)  # the trial ran, its reference did not
    # without Mods the reference is the bf16 baseline itself
    assert trial.reference_seconds(ctx, ModsConfig()) == pytest.approx(0.012)


def test_a_plain_bf16_trial_under_mods_is_its_own_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The "bf16+mods" start trains bf16 + those Mods in the regime: its run times the Mods set's
    reference (no second run), and later trials under those Mods are compared with it."""
    from loka_tune.tuner import trial

    cfg = _cfg(tmp_path, "[regime]\ncompile = true\nbatch_size = 48\n")
    seen = _counting_runs(monkeypatch, [0.011, 0.010])
    study = SimpleNamespace(user_attrs={}, set_user_attr=lambda k, v: study.user_attrs.__setitem__(k, v))
    ctx = _ctx(cfg, study=study)
    mods = ModsConfig(no_bias=True)
    start = trial.evaluate_config(ctx, PrecisionConfig(mods=mods))
    assert len(seen) == 1 and start.status == "ok"
    assert start.mods_step_time_s == pytest.approx(0.011) and start.speedup_vs_mods == pytest.approx(1.0)
    assert start.speedup == pytest.approx(0.012 / 0.011)
    assert study.user_attrs["loka.reference.nobias"] == pytest.approx(0.011)
    fp8 = trial.evaluate_config(ctx, PrecisionConfig.from_sites({"top_mlp.0.linear": ROW}, mods=mods))
    assert len(seen) == 2 and fp8.speedup_vs_mods == pytest.approx(0.011 / 0.010)
    # a reference the study already has (another worker's, or a resumed study's) is kept
    seen2 = _counting_runs(monkeypatch, [0.013])
    study2 = SimpleNamespace(user_attrs={"loka.reference.nobias": 0.0115},
                             set_user_attr=lambda k, v: study2.user_attrs.__setitem__(k, v))
    other = trial.evaluate_config(_ctx(cfg, study=study2), PrecisionConfig(mods=mods))
    assert len(seen2) == 1 and other.mods_step_time_s == pytest.approx(0.0115)
    assert study2.user_attrs["loka.reference.nobias"] == pytest.approx(0.0115)
    # a modeled study models its reference: a measured step time never stands in for it
    seen3 = _counting_runs(monkeypatch, [0.5])
    modeled = _ctx(cfg, speed="modeled", study=SimpleNamespace(user_attrs={}, set_user_attr=lambda k, v: None))
    assert trial.plain_bf16(PrecisionConfig(mods=mods))
    assert not trial.plain_bf16(PrecisionConfig.from_sites({"top_mlp.0.linear": ROW}))
    ref_key = "loka.reference.nobias"
    monkeypatch.setattr(trial, "modeled_seconds", lambda *a, **k: 0.004)
    trial.evaluate_config(modeled, PrecisionConfig(mods=mods))
    assert len(seen3) == 1 and modeled.references[ref_key] == pytest.approx(0.004)


def test_the_all_bf16_trial_is_the_baselines_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain bf16 without Mods on the pairing seed is the baseline's run: the trial takes its
    numbers and trains nothing; the inference objective (whose speed is a forward pass of
    the trained model) and any other config still run."""
    from loka_tune.tuner import trial

    cfg = _cfg(tmp_path, "[regime]\ncompile = true\nbatch_size = 48\n")
    seen = _counting_runs(monkeypatch, [0.010])
    ctx = _ctx(cfg)
    out = trial.evaluate_config(ctx, PrecisionConfig())
    assert seen == []
    assert (out.status, out.rel_logloss_pct, out.speedup, out.speedup_vs_mods) == ("ok", 0.0, 1.0, 1.0)
    assert out.eval_logloss == ctx.baseline.logloss == 0.5
    assert out.step_time_s == out.mods_step_time_s == out.measured_step_time_s == pytest.approx(0.012)
    assert out.reason.startswith(trial.BASELINE_RUN) and "seed 0" in out.reason
    assert out.run is not None  # the confirmation takes it as seed 0's run, as it takes any trial's
    assert {k: out.run[k] for k in ("seed", "steps", "compile", "batch_size", "nproc")} == {
        "seed": 0, "steps": cfg.training.steps, "compile": True, "batch_size": 48, "nproc": 1}
    assert out.feasible(0.1)
    # a bf16 config with a backend of its own is not the baseline's run
    own = PrecisionConfig.from_sites({"top_mlp.0.linear": "bf16.emulated"})
    assert not trial.plain_bf16(own)
    # another pairing seed than the baseline's first: trained
    other = _cfg(tmp_path, "[regime]\ncompile = true\nbatch_size = 48\n")
    ctx2 = _ctx(other)
    ctx2.baseline = type(ctx.baseline)(**{**ctx.baseline.__dict__, "seeds": (5, 1)})
    trial.evaluate_config(ctx2, PrecisionConfig())
    assert len(seen) == 1


# ---------------------------------------------------------------------------------------------
# the confirmation stage and the export


def _study_with_trials(cfg: Any, trials: list[tuple[float, float, bool]]) -> Any:
    """An in-memory Optuna study whose COMPLETE trials have (value, rel_logloss_pct, feasible)."""
    import optuna
    from optuna.distributions import CategoricalDistribution

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="regime")
    for i, (value, rel, feas) in enumerate(trials):
        choice = ("bf16", "e4m3.row.emulated", "e5m2.row.emulated", "e4m3.tensor.emulated")[i]
        config = PrecisionConfig.from_sites({"top.0": choice})
        attrs = {"config_key": f"k{i}", "config": config.to_dict(), "budget_pct": 1.0, "speed_source": "measured",
                 "status": "ok", "rel_logloss_pct": rel, "step_time_s": value, "speedup": 0.012 / value,
                 "speedup_vs_mods": 0.012 / value, "feasible": feas, "cache_hit": False}
        study.add_trial(optuna.trial.create_trial(params={"x": i}, distributions={"x": CategoricalDistribution(
            list(range(len(trials))))}, value=value, user_attrs=attrs))
    study.set_user_attr("loka.baseline", {"eval_logloss": [0.5, 0.502], "step_time_s": 0.012, "noise_floor_pct": 0.4})
    study.set_user_attr("loka.study", cfg.to_dict())
    return study


def test_confirmation_exports_the_confirmed_best(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from loka_tune.tuner import confirm
    from loka_tune.tuner.results import export_best, exported_trial, leaderboard

    cfg = _cfg(tmp_path)
    # trial 1 claims the best speed but its loss does not hold on seed 1; trial 2 holds; trial 3
    # is over budget (never a candidate); trial 0 is the slowest feasible one
    study = _study_with_trials(cfg, [(0.012, 0.0, True), (0.008, 0.5, True), (0.009, 0.6, True), (0.007, 2.0, False)])
    rel = {1: {0: 0.9, 1: 1.5}, 2: {0: 0.5, 1: 0.7}, 0: {0: 0.0, 1: 0.1}}
    calls: list[tuple[int, int]] = []

    def fake_run(ctx: Any, config: PrecisionConfig, seed: int) -> dict[str, Any]:
        n = next(t.number for t in study.trials if t.user_attrs["config"] == config.to_dict())
        calls.append((n, seed))
        t = {0: 0.012, 1: 0.0085, 2: 0.0095}[n]
        return {"seed": seed, "status": "ok", "rel_logloss_pct": rel[n][seed], "step_time_s": t,
                "ref_step_time_s": 0.0119, "eval_logloss": 0.5}

    monkeypatch.setattr(confirm, "_run_seed", fake_run)
    ctx = _ctx(cfg, study=study)
    assert exported_trial(study).number == 1  # before the confirmation: the search's best
    res = confirm.confirm_best(ctx)
    assert res is not None and res["trials"] == [1, 2, 0] and res["seeds"] == [0, 1]
    assert sorted(calls) == [(n, s) for n in (0, 1, 2) for s in (0, 1)]
    rows = {r["trial"]: r for r in res["rows"]}
    assert not rows[1]["feasible"] and rows[2]["feasible"] and res["chosen"] == 2
    assert rows[2]["rel_logloss_pct"] == pytest.approx(0.6)
    assert rows[2]["rel_logloss_sd_pct"] == pytest.approx(math.sqrt(0.02))
    assert rows[2]["speedup_vs_mods"] == pytest.approx(0.0119 / 0.0095)

    config = export_best(study, tmp_path / "best.json")
    p = config.provenance
    assert p["trial"] == 2 and p["confirmed"] is True and p["confirmed_seeds"] == [0, 1]
    assert p["claimed_speedup"] == pytest.approx(0.012 / 0.009)
    assert p["confirmed_speedup"] == pytest.approx(0.0119 / 0.0095)
    assert p["confirmed_speedup_vs_bf16"] == pytest.approx(0.012 / 0.0095)
    assert p["confirmed_rel_logloss_pct"] == pytest.approx(0.6)
    assert p["confirmed_rel_logloss_sd_pct"] == pytest.approx(math.sqrt(0.02))
    assert PrecisionConfig.load(tmp_path / "best.json").provenance["confirmed_speedup"] == p["confirmed_speedup"]
    assert [r["trial"] for r in leaderboard(study) if r["exported"]] == [2]
    # the unconfirmed best on request; the same candidates and seeds are not confirmed twice
    assert export_best(study, unconfirmed=True).provenance["trial"] == 1
    assert export_best(study, unconfirmed=True).provenance["confirmed"] is False
    confirm.confirm_best(ctx)
    assert len(calls) == 6


def test_no_confirmed_candidate_refuses_the_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from loka_tune.tuner import confirm
    from loka_tune.tuner.results import export_best

    cfg = _cfg(tmp_path)
    study = _study_with_trials(cfg, [(0.010, 0.5, True)])
    monkeypatch.setattr(confirm, "_run_seed", lambda ctx, config, seed: {
        "seed": seed, "status": "ok", "rel_logloss_pct": 3.0, "step_time_s": 0.01, "ref_step_time_s": 0.012})
    assert confirm.confirm_best(_ctx(cfg, study=study))["chosen"] is None
    with pytest.raises(StudyError, match="--unconfirmed"):
        export_best(study)
    assert export_best(study, unconfirmed=True).provenance["trial"] == 0


def test_report_shows_the_confirmation() -> None:
    from loka_tune.commands.report import format_confirmation

    c = {"seeds": [0, 1], "regime": {"compile": True, "batch_size": 8192}, "speed_source": "measured", "chosen": 4,
         "rows": [{"trial": 4, "claimed_speedup_vs_mods": 1.1, "speedup_vs_mods": 1.05, "rel_logloss_pct": 0.1,
                   "rel_logloss_sd_pct": 0.02, "feasible": True}]}
    text = format_confirmation(c)
    assert "compiled, batch 8192" in text and "*     4    1.100     1.050" in text and "confirmed best" in text
    assert "not run" in format_confirmation(None)


# ---------------------------------------------------------------------------------------------
# the probe: no hook on the steps that do not collect


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def _train_steps(model: nn.Module, probe: Any, steps: int, manual: bool) -> list[int]:
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    hooks_during = []
    for _ in range(steps):
        hooks_during.append(_hooks(model))
        loss = model(torch.randn(64, 32, generator=gen)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if manual:
            probe.step()
    return hooks_during


def test_manual_probe_is_hook_free_between_collections() -> None:
    from loka_tune.probe import Probe

    every, steps = 5, 17
    torch.manual_seed(0)
    m1 = _Tiny()
    with Probe(m1, every=every, step_on="manual") as p1:
        hooks = _train_steps(m1, p1, steps, manual=True)
    # steps 5, 10, 15 (1-based) collect: only their forwards see the two root hooks
    assert [i + 1 for i, h in enumerate(hooks) if h] == [5, 10, 15] and set(hooks) == {0, 2}
    assert p1.collections == 3 and _hooks(m1) == 0
    # the same collections as a forward-counting probe: the same statistics
    torch.manual_seed(0)
    m2 = _Tiny()
    with Probe(m2, every=every) as p2:
        _train_steps(m2, p2, steps, manual=False)
    s1, s2 = p1.stats.sites["a"].x, p2.stats.sites["a"].x
    assert p2.collections == 3 and s1.batches == s2.batches == 3
    assert s1.mean is not None and s2.mean is not None and (s1.mean == s2.mean).all()


def test_probe_allocates_on_its_first_step() -> None:
    """The first collection costs what the others do: the accumulators exist before it."""
    from loka_tune.probe import Probe

    m = _Tiny()
    with Probe(m, every=3, step_on="manual") as p:
        _train_steps(m, p, 1, manual=True)
        assert all(s.x.moments is not None and s.dy.moments is not None and s.w is not None
                   for s in p._sites.values())
        assert p.collections == 0


def test_baseline_progress_lines(capsys: pytest.CaptureFixture[str]) -> None:
    from loka_tune.tuner.baseline import _say_progress
    from loka_tune.tuner.log import to_stderr

    to_stderr()  # the library only logs: its lines show where a handler asks (the CLI's)
    say = _say_progress("baseline seed 0", 40)
    for step in range(10, 41, 10):
        say(step, 0.5)
    err = capsys.readouterr().err
    assert [ln.split("step ")[1].split("/")[0] for ln in err.splitlines()] == ["10", "20", "30"]


def test_price_first_is_a_probe_key(tmp_path: Path) -> None:
    assert _cfg(tmp_path, "[probe]\nprice_first = true\n").probe.price_first is True
    assert _cfg(tmp_path).probe.price_first is False  # off by default: the quickstart's report is unchanged
    with pytest.raises(ConfigError, match="'yes'") as e:
        _cfg(tmp_path, '[probe]\nprice_first = "yes"\n')
    assert e.value.key == "probe.price_first"
