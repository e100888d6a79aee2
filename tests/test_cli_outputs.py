"""What a new user meets after a study, through the real CLI: ``export`` (the best or a chosen
trial), ``train --config`` rebuilding the tuned model from the export alone, and outputs that
cannot be written failing before the work with one line (exit 2, no traceback, no stray file)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loka_tune.cli import main

STUDY = """
[study]
name = "outs"
output_dir = "{out}"
[model]
name = "dlrm"
preset = "tiny"
[model.overrides]
embedding_dim = 8
bottom_mlp = [32]
top_mlp = [48, 32]
[data]
source = "synthetic"
[data.params]
num_dense = 7
cardinalities = [40, 30, 20]
eval_examples = 320
[training]
steps = 6
batch_size = 32
seeds = [0, 1]
eval_batches = 2
window = 3
device = "cpu"
[objective]
budget_pct = 50.0
speed = "modeled"
[space]
formats = ["e4m3"]
granularities = ["row"]
[probe]
samples = 2
every = 3
min_speedup = 0.0
[trials]
n_trials = 3
n_startup_trials = 1
"""


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("outs")
    p = d / "outs.toml"
    p.write_text(STUDY.format(out=d / "runs"))
    assert main(["tune", str(p), "--no-tracking"]) == 0
    return p


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_train_config_rebuilds_the_tuned_model_from_the_export(study: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    best = tmp_path / "best.json"
    assert main(["export", str(study), "--out", str(best)]) == 0
    prov = json.loads(best.read_text())["provenance"]
    assert prov["model"] == {"name": "dlrm", "preset": "tiny",
                             "overrides": {"embedding_dim": 8, "bottom_mlp": [32], "top_mlp": [48, 32]}}
    assert prov["data"] == "synthetic"
    assert prov["data_params"] == {"num_dense": 7, "cardinalities": [40, 30, 20], "eval_examples": 320}
    assert "trial_chosen" not in prov
    out = tmp_path / "m.json"
    assert main(["train", "--config", str(best), "--steps", "3", "--batch-size", "32", "--no-progress",
                 "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["model"] == "dlrm" and d["model_args"] == prov["model"]["overrides"]
    assert d["data"] == "synthetic" and d["eval_count"] == 320 and d["status"] == "ok"
    # --model-arg still overrides what the export recorded
    assert main(["train", "--config", str(best), "--model-arg", "embedding_dim=4", "--steps", "2",
                 "--batch-size", "32", "--no-progress", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["model_args"]["embedding_dim"] == 4
    capsys.readouterr()


def test_train_config_trains_with_the_studys_schedule_and_rates(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The export records the study's [training] schedule and rates; ``train --config`` uses
    them where no option is given (a wide model trained at the CLI's Adam 1e-3 and no warm-up
    instead of a study's 1e-4 + warm-up learns far less), and each option still overrides."""
    d = tmp_path / "sched"
    d.mkdir()
    p = d / "sched.toml"
    p.write_text(STUDY.format(out=d / "runs").replace("name = \"outs\"", "name = \"sched\"")
                 .replace("steps = 6\n", "steps = 6\nlr_dense = 3e-4\nlr_warmup_steps = 2\nlr_cooldown_steps = 2\n"
                                                     "lr_sparse = 0.02\n")
                 .replace("n_trials = 3", "n_trials = 1") + "[regime]\nbatch_size = 16\n")
    assert main(["tune", str(p), "--no-tracking"]) == 0
    best = tmp_path / "best.json"
    assert main(["export", str(p), "--out", str(best)]) == 0
    prov = json.loads(best.read_text())["provenance"]
    # the batch the study's runs trained at: [regime] batch_size over [training]'s
    assert prov["training"] == {"steps": 6, "batch_size": 16, "lr_dense": 3e-4, "lr_sparse": 0.02,
                                "lr_warmup_steps": 2, "lr_cooldown_steps": 2, "sparse_optimizer": "rowwise_adagrad"}
    capsys.readouterr()
    out = tmp_path / "m.json"
    assert main(["train", "--config", str(best), "--json", str(out)]) == 0
    assert "the study's training: steps 6, batch_size 16, lr_dense 0.0003" in capsys.readouterr().err
    m = json.loads(out.read_text())
    assert m["steps_run"] == 6 and m["training"] == {**prov["training"]}
    assert main(["train", "--config", str(best), "--lr-dense", "1e-3", "--steps", "3", "--lr-warmup-steps", "0",
                 "--lr-cooldown-steps", "1", "--no-progress", "--json", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["steps_run"] == 3 and m["training"]["lr_dense"] == 1e-3 and m["training"]["lr_warmup_steps"] == 0
    assert m["training"]["lr_cooldown_steps"] == 1
    assert m["training"]["lr_sparse"] == 0.02 and m["training"]["batch_size"] == 16
    # without --config (or with --model) the command line's defaults, as before
    assert main(["train", "--model", "dlrm", "--steps", "2", "--batch-size", "16", "--no-progress",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["training"] == {"steps": 2, "batch_size": 16, "lr_dense": 1e-3,
                                                       "lr_sparse": 1e-2, "lr_warmup_steps": 0,
                                                       "lr_cooldown_steps": 0, "sparse_optimizer": "rowwise_adagrad"}


def test_train_without_model_or_recorded_model_says_what_to_give(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--steps", "2", "--no-progress"]) == 2
    assert "--model" in _err(capsys)
    from loka_tune.applier import export
    from loka_tune.config import PrecisionConfig

    plain = export(PrecisionConfig(), tmp_path / "plain.json")
    assert main(["train", "--config", str(plain), "--steps", "2", "--no-progress"]) == 2
    assert "records no model" in _err(capsys)


def test_export_a_chosen_trial(study: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t2.json"
    assert main(["export", str(study), "--trial", "2", "--out", str(out)]) == 0
    prov = json.loads(out.read_text())["provenance"]
    assert prov["trial"] == 2 and prov["trial_chosen"] is True
    assert "trial 2 of 'outs'" in capsys.readouterr().out
    assert main(["export", str(study), "--trial", "99", "--out", str(out)]) == 2
    import optuna

    from loka_tune.tuner.study import load_study

    cfg = load_study(study)
    last = optuna.load_study(study_name=cfg.name, storage=cfg.storage.url).trials[-1].number  # 2, or more with cache copies
    assert f"no trial 99 (trials 0 to {last})" in _err(capsys)


def test_export_to_a_folder_fails_before_the_work_and_leaves_no_temp_file(
        study: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(study), "--out", str(tmp_path)]) == 2
    err = _err(capsys)
    assert err.startswith("loka-tune export: error: --out: cannot write") and "is a folder" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["folder", "under-a-file"])
def test_train_json_unwritable_fails_before_training(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      where: str) -> None:
    (tmp_path / "f").write_text("x")
    target = tmp_path if where == "folder" else tmp_path / "f" / "m.json"
    code = main(["train", "--model", "dlrm", "--data", "synthetic:num_sparse=2,cardinality=50,eval_examples=64",
                 "--steps", "2", "--no-progress", "--json", str(target)])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""  # nothing trained, no metrics table
    assert "Traceback" not in out.err and out.err.startswith("loka-tune train: error: --json: cannot write")


def test_train_json_write_failing_after_training_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def full(self: Path, *a: object, **k: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    code = main(["train", "--model", "dlrm", "--data", "synthetic:num_sparse=2,cardinality=50,eval_examples=64",
                 "--steps", "2", "--no-progress", "--json", str(tmp_path / "m.json")])
    out = capsys.readouterr()
    assert code == 2 and "eval logloss" in out.out  # the metrics were printed
    assert out.err.strip() == (f"loka-tune train: error: --json: could not write {str(tmp_path / 'm.json')!r}"
                               " (No space left on device); the metrics are printed above")


def test_probe_out_a_file_fails_before_training(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "report.txt"
    f.write_text("x")
    code = main(["probe", "--model", "dlrm", "--data", "synthetic:num_sparse=2,cardinality=50,eval_examples=64",
                 "--steps", "2", "--every", "1", "--no-progress", "--out", str(f)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip() == f"loka-tune probe: error: --out: cannot write {str(f)!r}: {str(f)!r} is a file, not a" \
                          " folder; choose another path"
