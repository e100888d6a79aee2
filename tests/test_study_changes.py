"""Editing a study file and running ``loka-tune tune`` again: a change of the settings the stored
study depends on stops with what changed (--fresh / --resume-anyway); a larger n_trials does not."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from loka_tune.cli import main
from loka_tune.errors import StudyError
from loka_tune.tuner.optuna_setup import ATTR_SETTINGS, open_study
from loka_tune.tuner.results import ATTR_BASELINE
from loka_tune.tuner.study import StudyConfig, load_study

STUDY = """
[study]
name = "edited"
output_dir = "{out}"
[model]
name = "dlrm"
[model.overrides]
embedding_dim = 8
bottom_mlp = [16]
top_mlp = [32]
[data]
source = "synthetic"
[data.params]
num_dense = 4
cardinalities = [30, 20]
eval_examples = 128
[training]
steps = {steps}
batch_size = 32
seeds = [0, 1]
eval_batches = 2
window = 2
device = "cpu"
[objective]
budget_pct = 50.0
speed = "modeled"
[space]
formats = ["e4m3"]
granularities = ["row"]
mods = ["no_bias"]
[probe]
enabled = false
[trials]
n_trials = {n_trials}
n_startup_trials = 1
"""


def _write(p: Path, *, steps: int = 4, n_trials: int = 1) -> Path:
    p.write_text(STUDY.format(out=p.parent / "runs", steps=steps, n_trials=n_trials))
    return p


def _study(p: Path) -> optuna.Study:
    cfg = load_study(p)
    return optuna.load_study(study_name=cfg.name, storage=cfg.storage.url)


def _evaluated(st: optuna.Study) -> int:
    """Trials that count toward n_trials: distinct configurations (cache copies are not counted)."""
    return sum(1 for t in st.trials if t.state.name == "COMPLETE" and not t.user_attrs.get("cache_hit"))


def test_edited_study_stops_then_resumes_anyway_or_starts_fresh(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    f = _write(tmp_path / "s.toml")
    assert main(["tune", str(f), "--no-tracking"]) == 0
    assert _study(f).user_attrs[ATTR_SETTINGS]["training.steps"] == 4
    # more trials: the same study goes on
    _write(f, n_trials=2)
    assert main(["tune", str(f), "--no-tracking"]) == 0
    assert _evaluated(_study(f)) == 2
    n = len(_study(f).trials)
    capsys.readouterr()

    # an edited setting: stop at once, say what changed and what to do
    _write(f, steps=6, n_trials=2)
    assert main(["tune", str(f), "--no-tracking"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("loka-tune tune: error: study 'edited' is stored with other settings")
    assert "training.steps: 4 -> 6" in err[0] and "--fresh" in err[0] and "--resume-anyway" in err[0]
    assert f"{n} trial(s)" in err[0] and len(_study(f).trials) == n

    # --resume-anyway: the stored study, said so
    assert main(["tune", str(f), "--no-tracking", "--resume-anyway"]) == 0
    assert "resuming despite changed settings (training.steps: 4 -> 6)" in capsys.readouterr().err
    assert _study(f).user_attrs[ATTR_SETTINGS]["training.steps"] == 4

    # --fresh: start over with the new settings
    assert main(["tune", str(f), "--no-tracking", "--fresh"]) == 0
    assert "deleted its stored trials" in capsys.readouterr().err
    st = _study(f)
    assert st.user_attrs[ATTR_SETTINGS]["training.steps"] == 6 and _evaluated(st) == 2
    assert main(["tune", str(f), "--no-tracking"]) == 0  # and now the edited file is the study's


def test_fresh_and_resume_anyway_exclude_each_other(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["tune", str(_write(tmp_path / "s.toml")), "--fresh", "--resume-anyway"])
    assert e.value.code == 2 and "not allowed with" in capsys.readouterr().err


def _as_prepared(study: optuna.Study, cfg: StudyConfig) -> None:
    """What prepare_study stores with the baseline and space: the settings they were made with."""
    study.set_user_attr(ATTR_SETTINGS, cfg.settings())
    study.set_user_attr(ATTR_BASELINE, {})


def test_a_study_stored_before_settings_were_is_checked_by_its_summary(tmp_path: Path) -> None:
    f = _write(tmp_path / "s.toml")
    cfg = load_study(f)
    study = open_study(cfg)
    assert ATTR_SETTINGS not in study.user_attrs  # nothing is stored before the study is prepared
    study.set_user_attr("loka.study", cfg.to_dict())  # as an older loka-tune left it: only the summary
    study.set_user_attr(ATTR_BASELINE, {})
    open_study(cfg)  # unchanged: fine
    assert _study(f).user_attrs[ATTR_SETTINGS] == cfg.settings()  # and stored from now on
    with pytest.raises(StudyError, match=r"objective.budget_pct: 50.0 -> 20.0"):
        open_study(load_study(_write_budget(f, 20.0)))


def _write_budget(f: Path, budget: float) -> Path:
    f.write_text(f.read_text().replace("budget_pct = 50.0", f"budget_pct = {budget}"))
    return f


def test_a_changed_regime_is_a_changed_study(tmp_path: Path) -> None:
    """Trials timed in one regime (eager, one process, the study's batch) are not comparable with
    trials of another: [regime] is part of the stored settings, nproc included at its default."""
    f = _write(tmp_path / "s.toml")
    cfg = load_study(f)
    assert cfg.settings()["regime.nproc"] == 1 and "nproc" not in cfg.to_dict()["regime"]
    _as_prepared(open_study(cfg), cfg)
    f.write_text(f.read_text() + "[regime]\nbatch_size = 64\nnproc = 2\n")
    with pytest.raises(StudyError, match=r"regime.batch_size: 0 -> 64; regime.nproc: 1 -> 2"):
        open_study(load_study(f))


def test_the_preparation_stores_and_logs_its_parts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 21's prepare_s <= 60 on the H200 needs to know where its seconds go: the study stores
    each part (ATTR_PREPARE_PHASES) beside the total and the space line names them."""
    from loka_tune.tuner.results import ATTR_PREPARE_PHASES, ATTR_PREPARE_S

    f = _write(tmp_path / "s.toml")
    assert main(["tune", str(f), "--no-tracking"]) == 0
    attrs = _study(f).user_attrs
    phases, total = attrs[ATTR_PREPARE_PHASES], attrs[ATTR_PREPARE_S]
    assert list(phases) == ["baselines", "sites", "baseline_price", "prices"]  # probe off in this study
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= total + 1e-6
    assert phases["baselines"] > 0
    line = next(ln for ln in capsys.readouterr().err.splitlines() if "s to prepare: " in ln)
    assert "baselines " in line and "baseline price " in line and line.endswith("s)")
