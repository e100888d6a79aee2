"""The baseline runs of a preparation that did not finish are kept, and the next preparation with
the same settings but its budget reuses them (:mod:`loka_tune.tuner.baseline_runs`).

The case that matters is a GPU's: a study refused on its noise floor after 90 s of baselines at
B = 32768, re-run with a larger budget or --force. On a GPU the probe's measurement runs beside the
noise twin, before the budget check; these tests force that path on the CPU
(``prepare.beside_twin``), as ``tests/test_prepare_beside.py`` does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loka_tune.errors import StudyError
from loka_tune.tuner import baseline_runs, prepare
from loka_tune.tuner.baseline import Baseline
from loka_tune.tuner.loop import run_study
from loka_tune.tuner.results import ATTR_BASELINE, ATTR_PREPARE_REUSED, ATTR_SPACE
from loka_tune.tuner.study import load_study
from tests.test_prepare_beside import spy_runs
from tests.test_tune import write_study


def _prepare(study_file: Path, **kw: Any) -> Any:
    return run_study(load_study(study_file), n_trials=0, confirm=False, tracking=False, progress=False, **kw)


def _set_budget(study_file: Path, budget: str) -> None:
    text = study_file.read_text()
    old = next(line for line in text.splitlines() if line.startswith("budget_pct = "))
    study_file.write_text(text.replace(old, f"budget_pct = {budget}"))


def _refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Any, list[Any], StudyError]:
    """The tiny study with a budget below its noise floor, refused: its file, config, the baseline
    runs it made (a spy from now on) and the refusal."""
    study_file = write_study(tmp_path, budget=1e-6)
    runs = spy_runs(monkeypatch)
    with pytest.raises(StudyError, match="below the noise floor") as refused:
        _prepare(study_file)
    return study_file, load_study(study_file), runs, refused.value


@pytest.fixture
def on_gpu_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prepare, "beside_twin", lambda device: True)


@pytest.mark.usefixtures("on_gpu_path")
def test_a_study_refused_on_its_noise_floor_reuses_its_runs_with_a_larger_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    study_file, cfg, runs, refused = _refused(tmp_path, monkeypatch)
    assert str(refused).endswith(f"The baseline runs are kept ({cfg.output_dir / baseline_runs.RUNS_FILE}): run"
                                       " tune again with a larger objective.budget_pct or --force and they are reused")
    assert len(runs) == 4  # seeds 0 and 1, a twin each
    kept = json.loads((cfg.output_dir / baseline_runs.RUNS_FILE).read_text())
    assert kept["probe_report"]["results"] and kept["seconds"] > 0
    assert kept["key"]["settings"]["training.steps"] == 8 and "objective.budget_pct" not in kept["key"]["settings"]

    _set_budget(study_file, "50.0")  # the refusal's fix: a larger budget
    with caplog.at_level("INFO", logger="loka_tune"):
        study = _prepare(study_file)
    assert len(runs) == 4  # not one run more
    said = [m for m in caplog.messages if "reusing the runs of a preparation that did not finish" in m]
    assert len(said) == 1 and str(cfg.output_dir / baseline_runs.RUNS_FILE) in said[0]
    stored = Baseline.from_dict(study.user_attrs[ATTR_BASELINE])
    runs_bl = Baseline.from_dict(kept["baseline"])  # the runs' baseline, before the space priced it
    assert (stored.eval_logloss, stored.paired_logloss, stored.noise_floor_pct, stored.window_losses,
            stored.measured_step_time_s) == (runs_bl.eval_logloss, runs_bl.paired_logloss, runs_bl.noise_floor_pct,
                                             runs_bl.window_losses, runs_bl.measured_step_time_s)
    assert study.user_attrs[ATTR_PREPARE_REUSED]["seconds"] == pytest.approx(kept["seconds"], abs=1e-3)
    assert not (cfg.output_dir / baseline_runs.RUNS_FILE).exists()  # stored in the study now
    published = json.loads((cfg.output_dir / "probe_report.json").read_text())
    assert published["results"] == kept["probe_report"]["results"]

    # the space is the one a preparation that ran everything makes
    (tmp_path / "ref").mkdir()
    ref_file = write_study(tmp_path / "ref")
    ref = _prepare(ref_file)
    assert study.user_attrs[ATTR_SPACE] == ref.user_attrs[ATTR_SPACE]
    assert Baseline.from_dict(ref.user_attrs[ATTR_BASELINE]).eval_logloss == stored.eval_logloss


@pytest.mark.usefixtures("on_gpu_path")
def test_runs_made_under_other_settings_are_made_again_and_fresh_drops_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    study_file, cfg, runs, _ = _refused(tmp_path, monkeypatch)
    path = cfg.output_dir / baseline_runs.RUNS_FILE
    assert path.is_file() and len(runs) == 4

    study_file.write_text(study_file.read_text().replace("steps = 8", "steps = 9"))  # changes the runs
    with caplog.at_level("INFO", logger="loka_tune"), pytest.raises(StudyError):
        _prepare(study_file)
    assert len(runs) == 8  # all made again
    assert any("made under other settings (training.steps: 8 -> 9): its runs are not reused" in m
               for m in caplog.messages)
    assert json.loads(path.read_text())["key"]["settings"]["training.steps"] == 9  # the new runs are kept

    with caplog.at_level("INFO", logger="loka_tune"), pytest.raises(StudyError):
        _prepare(study_file, on_change="fresh")  # --fresh: the kept runs go too, and are made again
    assert len(runs) == 12
    assert any("deleted the baseline runs kept from an unfinished preparation" in m for m in caplog.messages)


@pytest.mark.usefixtures("on_gpu_path")
def test_a_damaged_file_is_not_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    study_file = write_study(tmp_path)
    cfg = load_study(study_file)
    cfg.output_dir.mkdir(parents=True)
    (cfg.output_dir / baseline_runs.RUNS_FILE).write_text('{"kind": "loka-tune baseline runs", "version": 1, "key"')
    runs = spy_runs(monkeypatch)
    with caplog.at_level("INFO", logger="loka_tune"):
        _prepare(study_file)
    assert len(runs) == 4
    assert any("could not be read (JSONDecodeError" in m and "its runs are not reused" in m for m in caplog.messages)
    assert not (cfg.output_dir / baseline_runs.RUNS_FILE).exists()


def test_off_a_gpu_a_refused_study_keeps_nothing_and_an_interrupted_one_keeps_its_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU the probe's measurement comes after the budget check: a refused study has none, so
    nothing is kept; one stopped later (here: while the prices are made) keeps runs and measurement."""
    study_file = write_study(tmp_path, budget=1e-6)
    cfg = load_study(study_file)
    cfg.output_dir.mkdir(parents=True)
    stale = {"kind": "loka-tune baseline runs", "version": 1, "key": {"device": "cpu", "settings": {}}}
    (cfg.output_dir / baseline_runs.RUNS_FILE).write_text(json.dumps(stale))  # runs of other settings
    with pytest.raises(StudyError, match="below the noise floor") as refused:
        _prepare(study_file)
    assert "are kept" not in str(refused.value)  # the file there is not these runs
    assert json.loads((cfg.output_dir / baseline_runs.RUNS_FILE).read_text()) == stale

    _set_budget(study_file, "50.0")

    def interrupted(*a: Any, **kw: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare, "_recipe_space", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _prepare(study_file)
    kept = json.loads((cfg.output_dir / baseline_runs.RUNS_FILE).read_text())
    assert kept["probe_report"]["results"]
    monkeypatch.undo()
    runs = spy_runs(monkeypatch)
    study = _prepare(study_file)
    assert runs == [] and ATTR_PREPARE_REUSED in study.user_attrs


def test_the_key_leaves_out_the_budget_alone(tmp_path: Path) -> None:
    a = load_study(write_study(tmp_path, name="a", budget=0.5))
    b = load_study(write_study(tmp_path, name="a", budget=5.0))
    assert baseline_runs.runs_key(a, "cpu") == baseline_runs.runs_key(b, "cpu")
    f = write_study(tmp_path, name="a")
    f.write_text(f.read_text().replace("samples = 2", "samples = 3"))
    c = load_study(f)
    assert baseline_runs.runs_key(c, "cpu") != baseline_runs.runs_key(a, "cpu")  # the probe's measurement
    key = baseline_runs.runs_key(a, "cpu")
    assert key["device"] == "cpu" and key["torch"] and key["loka_tune"]
