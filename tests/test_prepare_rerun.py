"""A preparation that fails leaves nothing behind but its reason, through the real CLI: the
user fixes the study file as told and runs `loka-tune tune` again, without --fresh, and the
study simply starts and completes."""

from __future__ import annotations

from pathlib import Path

import pytest

from loka_tune.cli import main
from tests.test_tune import DLRM, write_study

BAD_MODEL = 'name = "dlrm"\npreset = "tiny"\n[model.overrides]\nno_such_knob = 3'


def _mlflow_runs(out: Path) -> list[tuple[str, str]]:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name("loka-tune")
    return [] if exp is None else [(r.info.run_name, r.info.status) for r in client.search_runs([exp.experiment_id])]


def _fix(study_file: Path, old: str, new: str) -> None:
    text = study_file.read_text()
    assert old in text
    study_file.write_text(text.replace(old, new))


@pytest.mark.parametrize("broken, fixed, reason", [
    pytest.param(BAD_MODEL, DLRM, "no_such_knob", id="bad-model-override"),
    # a budget no trial could be told apart from noise with: refused after the baseline runs
    pytest.param("budget_pct = 1e-06", "budget_pct = 50.0", "below the noise floor", id="budget-below-noise-floor"),
])
def test_fix_the_study_file_then_rerun_without_fresh(broken: str, fixed: str, reason: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    study_file = write_study(tmp_path, n_trials=2, tracking="true")
    _fix(study_file, fixed, broken)
    out = tmp_path / "runs" / "t"

    assert main(["tune", str(study_file)]) == 2  # the preparation fails
    assert reason in capsys.readouterr().err
    assert main(["report", str(study_file)]) == 1  # its reason is kept, and printed
    err = capsys.readouterr().err
    assert "preparation failed" in err and reason in err and f"loka-tune tune {study_file}" in err
    assert main(["export", str(study_file), "--trial", "0", "--out", str(tmp_path / "b.json")]) == 2
    assert "has no trials yet" in capsys.readouterr().err  # not "trials 0 to -1"
    assert _mlflow_runs(out) == []  # no MLflow study run with the broken settings
    assert not list(out.glob(".prepare-*"))

    _fix(study_file, broken, fixed)  # as told: fix the file and run the same command again
    code = main(["tune", str(study_file)])
    text = capsys.readouterr()
    assert code == 0, text.err
    assert "stored with other settings" not in text.err and "best trial" in text.out
    assert main(["report", str(study_file), "--no-plots"]) == 0
    assert "2 finished trials" in capsys.readouterr().out
    runs = _mlflow_runs(out)
    assert [r for r in runs if r[0].startswith("study-")] == [("study-t", "FINISHED")]
