"""The study loop end to end on a tiny CPU study: baseline, probe, space, trials, MLflow, export."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest

from loka_tune.errors import StudyError
from loka_tune.space.candidates import SearchSpace
from loka_tune.tuner import trial as trial_module
from loka_tune.tuner.baseline import Baseline
from loka_tune.tuner.build import make_model, make_source, trial_model
from loka_tune.tuner.loop import run_study
from loka_tune.tuner.prepare import no_fp8_reason
from loka_tune.tuner.results import ATTR_BASELINE, ATTR_SPACE, best_trial, export_best
from loka_tune.tuner.study import load_study

FIXTURES = Path(__file__).resolve().parent / "fixtures"

TINY = """
[study]
name = "{name}"
output_dir = "{out}"

[model]
{model}

[data]
source = "synthetic"
[data.params]
num_dense = 16
cardinalities = [60, 60, 40, 40]
eval_examples = 512

[training]
steps = 8
batch_size = 32
lr_dense = 3e-3
lr_sparse = 3e-2
seeds = [0, 1]
eval_batches = 4
window = 4
warmup_steps = 1
device = "cpu"

[objective]
budget_pct = {budget}
speed = "modeled"
cost_batch_size = 262144

[space]
formats = ["e4m3"]
granularities = ["row", "tensor"]
backends = ["emulated"]
{space_extra}

[probe]
samples = 2
every = 4
min_speedup = 0.0

[trials]
n_trials = {n_trials}
n_startup_trials = 2

[tracking]
enabled = {tracking}
"""

DLRM = 'name = "dlrm"\npreset = "tiny"\n[model.overrides]\nembedding_dim = 16\nbottom_mlp = [32]\ntop_mlp = [64]'


def write_study(tmp_path: Path, *, name: str = "t", model: str = DLRM, budget: float = 50.0, n_trials: int = 4,
                tracking: str = "false", space_extra: str = "") -> Path:
    p = tmp_path / f"{name}.toml"
    p.write_text(textwrap.dedent(TINY.format(name=name, out=tmp_path / "runs" / name, model=model, budget=budget,
                                             n_trials=n_trials, tracking=tracking, space_extra=space_extra)))
    return p


def _done(study):  # noqa: ANN001, ANN202
    return [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED", "FAIL")]


@pytest.mark.slow
def test_tiny_study_end_to_end_with_mlflow(tmp_path: Path) -> None:
    cfg = load_study(write_study(tmp_path, tracking="true"))
    study = run_study(cfg, tracking=True)
    done = _done(study)
    assert len([t for t in done if not t.user_attrs.get("cache_hit")]) == 4  # a cache copy is not counted
    # the first trial is the enqueued all-bf16 config: the paired run reproduces the baseline exactly
    t0 = study.trials[0]
    assert t0.user_attrs["seeded"] == "all-bf16"
    assert t0.user_attrs["rel_logloss_pct"] == 0.0 and t0.user_attrs["feasible"]
    assert math.isclose(t0.user_attrs["speedup"], 1.0, rel_tol=1e-9)
    # then the recipes (no Mods in this space): torchao's size filter keeps none of these narrow
    # Linears, so the tensorwise@filter start repeats all-bf16 and is not queued (no site has a
    # rowwise or a tensorwise_fa value: those two are no starts at all); the Dispatch plan puts
    # FP8 where the cost model prices it faster at this cost batch (262144 rows); the model has
    # nothing predicted faster (both starts' losses are within noise): the other trials are the sampler's
    from loka_tune.tuner.starts import ATTR_STARTS

    starts = study.user_attrs[ATTR_STARTS]
    assert starts["state"] == "done" and [label for label, _ in starts["recipes"]] == [
        "tensorwise@filter", "dispatch"]
    seeded = [t.user_attrs.get("seeded") for t in study.trials]
    assert seeded[:2] == ["all-bf16", "dispatch"] and not any(seeded[2:])
    assert study.trials[1].user_attrs["config"]["sites"]  # FP8 somewhere
    for t in done:
        assert t.user_attrs["speed_source"] == "modeled"
        assert "config_key" in t.user_attrs
    # baseline and space are stored for other workers / resumes
    bl = Baseline.from_dict(study.user_attrs[ATTR_BASELINE])
    assert len(bl.eval_logloss) == 2 and bl.noise_floor_pct >= 0 and bl.speed_source == "modeled"
    assert (cfg.output_dir / "probe_report.json").is_file()
    # answer + export with provenance
    best = best_trial(study)
    assert best.user_attrs["feasible"] and best.value <= t0.value
    out = tmp_path / "best.json"
    pc = export_best(study, out)
    from loka_tune.config import PrecisionConfig

    loaded = PrecisionConfig.load(out)
    assert loaded.key() == pc.key() == best.user_attrs["config_key"]
    prov = loaded.provenance
    assert prov["trial"] == best.number and prov["speed_source"] == "modeled" and prov["study"] == "t"
    assert "torch" in prov["versions"] and prov["cost_device"] == "h200"
    # the exported config applies to a fresh model
    from loka_tune.applier import apply

    model = make_model(cfg, make_source(cfg))
    summary = apply(model, str(out))
    assert summary.config_key == pc.key()
    # MLflow: one parent, one nested run per trial, metrics + the config artifact
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parents = [r for r in runs if r.data.tags.get("loka.kind") == "study"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert len(parents) == 1 and len(children) == len(done)
    r0 = next(r for r in children if r.data.tags["loka.trial"] == "0")
    assert r0.data.metrics["rel_logloss_pct"] == 0.0 and r0.data.tags["feasible"] == "True"
    # an enqueued start's label, as on the leaderboard; the sampler's trials have none
    assert {r.data.tags["loka.trial"]: r.data.tags.get("seeded") for r in children} == {
        str(t.number): t.user_attrs.get("seeded") for t in done}
    assert {"step_time_s", "speedup", "eval_ne", "eval_auc"} <= set(r0.data.metrics)
    assert any(k.startswith("site.") for k in r0.data.params) and r0.data.params["mods"] == "none"
    arts = {a.path for a in client.list_artifacts(r0.info.run_id)}
    assert "precision_config.json" in arts
    parent_arts = {a.path for a in client.list_artifacts(parents[0].info.run_id)}
    assert {"probe_report.json", "speed_vs_loss.png", "leaderboard.json"} <= parent_arts
    # searchable: the per-site parameters
    hits = client.search_runs([exp.experiment_id], filter_string="params.mods = 'none'")
    assert len(hits) == len(done)


def test_resume_runs_no_completed_trial_again(tmp_path: Path) -> None:
    cfg = load_study(write_study(tmp_path, n_trials=3))
    s1 = run_study(cfg, tracking=False, progress=False)
    before = {t.number: (t.value, t.user_attrs["config_key"]) for t in _done(s1)}
    s2 = run_study(cfg, tracking=False, n_trials=5, progress=False)
    after = {t.number: (t.value, t.user_attrs["config_key"]) for t in _done(s2)}
    assert len([t for t in _done(s2) if not t.user_attrs.get("cache_hit")]) == 5  # cache copies are not counted
    assert all(after[n] == v for n, v in before.items())  # kept as they were
    evaluated = [t.user_attrs["config_key"] for t in _done(s2) if not t.user_attrs.get("cache_hit")]
    assert len(evaluated) == len(set(evaluated))  # no configuration evaluated twice


def test_no_probe_and_no_enqueued_starts_leave_the_space_unpruned_and_the_sampler_alone(tmp_path: Path) -> None:
    """[probe] enabled = false + [trials] enqueue_starts = false in the per-GEMM space: plain TPE."""

    p = write_study(tmp_path, n_trials=2, space_extra="per_gemm = true")
    text = p.read_text().replace("min_speedup = 0.0", "min_speedup = 1.0")  # the probe would drop slow ones
    p.write_text(text.replace("[probe]\n", "[probe]\nenabled = false\n")
                 .replace("[trials]\n", "[trials]\nenqueue_starts = false\n"))
    cfg = load_study(p)
    assert not cfg.probe.enabled and not cfg.trials.enqueue_starts
    study = run_study(cfg, tracking=False, progress=False)
    assert len(_done(study)) == 2
    assert not any("seeded" in t.user_attrs for t in study.trials)  # every trial came from the sampler
    assert not (cfg.output_dir / "probe_report.json").exists()
    space = SearchSpace.from_dict(study.user_attrs[ATTR_SPACE])
    reasons = [why for sc in space.sites for d in sc.dropped.values() for why in d.values()]
    assert all(why.startswith("ineligible") for why in reasons)  # nothing unsafe / slow removed
    assert not any(sc.error or sc.speedup for sc in space.sites)
    assert space.n_fp8_candidates() > 0
    # the same study with the probe on drops slow candidates at this cost batch size: the check above can fail
    p.write_text(text.replace("name = \"t\"", "name = \"t2\"").replace(str(tmp_path / "runs" / "t"),
                                                                      str(tmp_path / "runs" / "t2"))
                 .replace("n_trials = 2", "n_trials = 1"))
    cfg2 = load_study(p)
    s2 = run_study(cfg2, tracking=False, progress=False)
    assert s2.trials[0].user_attrs["seeded"] == "all-bf16"
    pruned = SearchSpace.from_dict(s2.user_attrs[ATTR_SPACE])
    assert pruned.n_fp8_candidates() < space.n_fp8_candidates()


def test_budget_below_noise_floor_is_refused_unless_forced(tmp_path: Path) -> None:
    cfg = load_study(write_study(tmp_path, budget=1e-6, n_trials=1))
    with pytest.raises(StudyError, match="noise floor"):
        run_study(cfg, tracking=False, progress=False)
    with pytest.warns(UserWarning, match="forced"):
        study = run_study(cfg, tracking=False, force=True, progress=False)
    assert len(_done(study)) == 1


def test_user_model_given_as_module_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(FIXTURES))
    model = 'name = "usermodel:build"\n[model.overrides]\nwidth = 64'
    cfg = load_study(write_study(tmp_path, name="user", model=model, n_trials=3))
    study = run_study(cfg, tracking=False, progress=False)
    space = SearchSpace.from_dict(study.user_attrs[ATTR_SPACE])
    assert "mlp.2" in space.site_names and "out" in space.site_names
    assert any(len(c) > 1 for sc in space.sites for c in sc.choices.values())
    assert len(_done(study)) == 3 and best_trial(study).user_attrs["feasible"]


def test_failed_trial_is_recorded_and_the_study_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from loka_tune.errors import UnsupportedChoiceError

    cfg = load_study(write_study(tmp_path, n_trials=3))
    real = trial_model

    def flaky(cfg_, source, config, **kw):  # noqa: ANN001, ANN003, ANN202
        if config.sites:  # every config with an FP8 site "cannot run here"
            raise UnsupportedChoiceError("no kernel for this choice on this device")
        return real(cfg_, source, config, **kw)

    monkeypatch.setattr(trial_module, "trial_model", flaky)
    study = run_study(cfg, tracking=False, progress=False)
    failed = [t for t in study.trials if t.state.name == "FAIL"]
    assert failed and all("unsupported" in t.user_attrs["fail_reason"] for t in failed)
    assert len(_done(study)) == 3 and best_trial(study).user_attrs["config"]["sites"] == {}


def _hopeless_rule(threshold_pct: float, warmup_steps: int, values: dict[int, float]) -> bool:
    """The home-made HopelessPruner's rule, which Optuna's ThresholdPruner replaced."""
    if not values:
        return False
    step = max(values)
    if step < warmup_steps:
        return False
    v = values[step]
    return not math.isfinite(v) or v > threshold_pct


@pytest.mark.parametrize("warmup", [0, 4])
def test_hopeless_pruner_decides_as_the_rule_it_replaced(tmp_path: Path, warmup: int) -> None:
    import dataclasses

    import optuna
    from optuna.trial import TrialState

    from loka_tune.tuner.optuna_setup import make_pruner

    cfg = load_study(write_study(tmp_path, budget=0.5))
    cfg = cfg.with_overrides(trials=dataclasses.replace(cfg.trials, prune_warmup_steps=warmup))
    pruner = make_pruner(cfg)
    assert isinstance(pruner, optuna.pruners.ThresholdPruner)
    threshold = cfg.trials.hopeless_factor * cfg.objective.budget_pct  # 10 x 0.5% = 5%
    study = optuna.create_study(pruner=pruner)
    # what the loop reports: the window-loss gap in percent (>= -100), a non-finite gap as 1e9; -inf never
    # reaches the pruner (there the two would differ: the old rule pruned it, ThresholdPruner does not)
    values = [-100.0, -1.0, 0.0, 4.9, threshold, threshold + 1e-9, 5.1, 100.0, 1e9, math.nan, math.inf]
    for v in values:
        for steps in ([2], [4], [2, 4], [4, 8], [8], [2, 4, 8]):
            trial = study.ask()
            history = {s: 0.0 for s in steps[:-1]} | {steps[-1]: v}
            for s, x in history.items():
                trial.report(x, s)
            assert trial.should_prune() == _hopeless_rule(threshold, warmup, history), (v, steps)
            study.tell(trial, state=TrialState.PRUNED)


def test_cli_tune_report_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from loka_tune.cli import main

    p = write_study(tmp_path, n_trials=2)
    assert main(["tune", str(p), "--no-tracking"]) == 0
    assert "best trial" in capsys.readouterr().out
    assert main(["report", str(p)]) == 0
    out = capsys.readouterr().out
    assert "COMPLETE" in out and "speed_vs_loss.png" in out
    assert (tmp_path / "runs" / "t" / "speed_vs_loss.png").is_file()
    best = tmp_path / "best.json"
    assert main(["export", str(p), "--out", str(best)]) == 0
    assert json.loads(best.read_text())["provenance"]["study"] == "t"
    # by name + storage, and the errors
    cfg = load_study(p)
    assert main(["export", "t", "--storage", cfg.storage.url, "--out", str(tmp_path / "b2.json")]) == 0
    assert main(["export", "nope", "--storage", cfg.storage.url]) == 2
    assert "no study named 'nope'" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing.toml")]) == 2


def test_report_without_matplotlib_prints_the_leaderboard(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from loka_tune.cli import main
    from loka_tune.tuner import tracking

    p = write_study(tmp_path, n_trials=1)
    assert main(["tune", str(p), "--no-tracking"]) == 0
    capsys.readouterr()

    def no_mpl(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(tracking, "write_plots", no_mpl)
    assert main(["report", str(p)]) == 0
    out, err = capsys.readouterr()
    assert "COMPLETE" in out and "plots skipped" in err and "--no-plots" in err


def test_no_fp8_reason_counts_the_drops_and_names_the_knob(tmp_path: Path) -> None:
    from types import SimpleNamespace

    cfg = load_study(write_study(tmp_path))
    space = SimpleNamespace(sites=[
        SimpleNamespace(dropped={"fwd": {"e4m3.row.emulated": "slow: speed-up 0.8 < min_speedup 1.0"},
                                 "wgrad": {"e4m3.row.emulated": "ineligible: K=13 not a multiple of 16"}}),
        SimpleNamespace(dropped={"fwd": {"e4m3.row.emulated": "slow: speed-up 0.9 < min_speedup 1.0"}}),
    ])
    msg = no_fp8_reason(space, cfg)
    assert "2 slow, 1 ineligible" in msg and "min_speedup" in msg and "min_dim" in msg and "Mods only" in msg
    assert "unsafe" not in msg


def test_make_model_copies_a_kept_build_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A built-in model is built once per seed: later calls return a copy with the same weights
    and leave the random state where a build leaves it; user factories are called every time."""
    import torch

    from loka_tune.tuner import build

    monkeypatch.setattr(build, "_PRISTINE", type(build._PRISTINE)())
    cfg = load_study(write_study(tmp_path))
    source = make_source(cfg)
    builds: list[int] = []
    real = build._build_model
    monkeypatch.setattr(build, "_build_model", lambda c, s, seed: builds.append(seed) or real(c, s, seed))
    first = make_model(cfg, source, seed=0)
    rng_after_build = torch.get_rng_state()
    after_build = torch.rand(3)
    with torch.no_grad():
        next(first.parameters()).add_(1.0)  # a caller's changes never reach the kept copy
    again = make_model(cfg, source, seed=0)
    assert torch.equal(torch.get_rng_state(), rng_after_build) and torch.equal(torch.rand(3), after_build)
    fresh = real(cfg, source, 0)
    assert again is not first and builds == [0]
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), fresh.state_dict().values(), strict=True))
    other = make_model(cfg, source, seed=1)
    assert builds == [0, 1] and not torch.equal(next(other.parameters()), next(again.parameters()))
    make_model(cfg, source, seed=2)  # two seeds are kept: seed 0 (the least recent) goes
    make_model(cfg, source, seed=0)
    assert builds == [0, 1, 2, 0]
    from dataclasses import replace

    user = replace(cfg, model=replace(cfg.model, name="my_models:build"))
    assert user.model.is_function and build._pristine_key(user, source, 0) is None  # never kept
