"""``loka-tune train`` end to end: synthetic data, the real Criteo / Avazu samples, errors."""

from __future__ import annotations

import json
import math

import pytest

from loka_tune.cli import main

# One epoch over the samples' train splits (1,605 Criteo rows, 6,491 Avazu rows): longer runs
# overfit these tiny samples (held-out NE > 1 after two epochs on Criteo for Wukong / DCNv2).
# The acceptance commands as written: no --steps / --batch-size, so the small-sample defaults
# (one epoch at a batch of rows/100) are what is tested.
REAL_RUNS = {
    "criteo": ("criteo_kaggle_head2k.tsv", []),
    "avazu": ("avazu_head8k.csv", []),
}


def run_cli(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:  # a usage error, found when the command line is parsed
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_synthetic_run_writes_metrics(tmp_path, capsys):
    out = tmp_path / "sub" / "out.json"
    out.parent.mkdir()  # an output's folder must exist (test_cli_outputs: the error when it does not)
    argv = ["train", "--model", "dlrm", "--preset", "tiny", "--data",
            "synthetic:num_sparse=4,cardinality=500,eval_examples=2048",
            "--steps", "30", "--window", "10", "--no-progress", "--json", str(out)]
    code, stdout, stderr = run_cli(argv, capsys)
    assert code == 0, stderr
    assert stderr == ""  # --no-progress: nothing on stderr
    d = json.loads(out.read_text())
    assert d["status"] == "ok" and d["steps_run"] == 30 and d["model"] == "dlrm"
    assert len(d["loss_curve"]) == 3 and d["curve_steps"] == [10, 20, 30]
    assert d["eval_count"] == 2048 and 0 < d["eval_logloss"] < 2 and 0 < d["eval_auc"] < 1
    assert d["step_time_s"] > 0 and d["num_params"] > d["num_sparse_params"] > 0
    assert d["config"]["steps"] == 30 and d["device"] == "cpu"
    for label in ("train loss", "eval logloss", "eval NE", "eval AUC", "examples/s", "step time", "status"):
        assert label in stdout
    assert f"{d['eval_ne']:.4f}" in stdout
    # the same command again: bit-identical curve and metrics (seeded init + data order)
    out2 = tmp_path / "out2.json"
    assert main(argv[:-1] + [str(out2)]) == 0
    d2 = json.loads(out2.read_text())
    assert d2["loss_curve"] == d["loss_curve"] and d2["eval_logloss"] == d["eval_logloss"]


def test_model_args_override_the_preset(tmp_path, capsys):
    out = tmp_path / "o.json"
    base = ["train", "--model", "dcnv2", "--data", "synthetic:num_sparse=3,cardinality=100,eval_examples=256",
            "--steps", "5", "--no-progress", "--json", str(out)]
    assert main(base) == 0
    n_default = json.loads(out.read_text())["num_params"]
    assert main(base + ["--model-arg", "embedding_dim=4"]) == 0
    d = json.loads(out.read_text())
    assert d["model_args"] == {"embedding_dim": 4} and d["num_params"] < n_default
    capsys.readouterr()


def test_nonfinite_exits_1(tmp_path, capsys):
    out = tmp_path / "o.json"
    code, stdout, _ = run_cli(
        ["train", "--model", "dlrm", "--data", "synthetic:num_sparse=3,cardinality=100,eval_examples=256",
         "--steps", "20", "--lr-dense", "1e30", "--lr-sparse", "1e30", "--no-progress", "--json", str(out)],
        capsys,
    )
    d = json.loads(out.read_text())
    assert code == 1 and d["status"] == "nonfinite" and d["nonfinite_step"] is not None
    assert d["eval_logloss"] is None and "non-finite at step" in stdout


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--steps", "0"], "argument --steps: expected a number of steps >= 1, got '0'"),  # parse time
        (["--lr-dense", "-1"], "argument --lr-dense: expected a learning rate > 0, got '-1'"),
        (["--lr-warmup-steps", "-2"], "argument --lr-warmup-steps: expected a number of steps >= 0, got '-2'"),
        (["--data", "criteo:/nonexistent/train.tsv"], "nonexistent"),
        (["--data", "parquet:x"], "parquet:x"),
        (["--model-arg", "no_such_option=3"], "no_such_option"),
        (["--config", "/nonexistent/best.json"], "best.json"),
        (["--device", "cpu", "--cuda-graphs"], "cuda_graphs"),  # TrainConfig.cuda_graphs: CUDA only
    ],
)
def test_user_errors_exit_2(extra, needle, capsys):
    argv = ["train", "--model", "dlrm", "--data", "synthetic:num_sparse=2,cardinality=50,eval_examples=64",
            "--steps", "2", "--no-progress", *extra]
    code, _, stderr = run_cli(argv, capsys)
    assert code == 2 and needle in stderr and "error" in stderr


def test_bad_model_arg_syntax_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--model", "dlrm", "--model-arg", "embedding_dim"])
    assert e.value.code == 2 and "KEY=VALUE" in capsys.readouterr().err


def test_help_is_accurate(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert e.value.code == 0
    for needle in ("--model {dlrm,dcnv2,wukong,interformer}", "--preset {tiny,paper,large}", "criteo:PATH",
                   "avazu:PATH", "amazon:PATH", "seq_len", "--lr-sparse", "--config", "--json", "--no-progress", "--cuda-graphs",
                   "examples:", "loka-tune train --model dlrm"):
        assert needle in text, needle


def test_precision_config_is_applied(tmp_path, capsys):
    from loka_tune.applier import export
    from loka_tune.config import PrecisionConfig, SitePrecision

    cfg_path = tmp_path / "best.json"
    export(PrecisionConfig(default=SitePrecision.parse("e4m3.row.emulated")), cfg_path)
    out = tmp_path / "o.json"
    code, stdout, stderr = run_cli(
        ["train", "--model", "dlrm", "--data", "synthetic:num_sparse=3,cardinality=100,eval_examples=512",
         "--steps", "10", "--no-progress", "--config", str(cfg_path), "--json", str(out)],
        capsys,
    )
    assert code == 0, stderr
    d = json.loads(out.read_text())
    assert d["precision_config"] == str(cfg_path) and d["status"] == "ok"
    assert len(d["precision_replaced"]) > 0 and "linear layers replaced" in stdout
    # the FP8 run differs from the plain run (same seed, same batches)
    plain = tmp_path / "p.json"
    assert main(["train", "--model", "dlrm", "--data", "synthetic:num_sparse=3,cardinality=100,eval_examples=512",
                 "--steps", "10", "--no-progress", "--json", str(plain)]) == 0
    assert json.loads(plain.read_text())["loss_curve"] != d["loss_curve"]
    capsys.readouterr()


@pytest.mark.parametrize("dataset", ["criteo", "avazu"])
@pytest.mark.parametrize("model", ["dlrm", "dcnv2", "wukong", "interformer"])
def test_real_sample_beats_the_click_rate(model, dataset, shared_data, tmp_path, capsys):
    """Acceptance: held-out NE < 1 on the real Criteo and Avazu samples after one epoch."""
    fname, opts = REAL_RUNS[dataset]
    out = tmp_path / "o.json"
    code, _, stderr = run_cli(
        ["train", "--model", model, "--preset", "tiny", "--data", f"{dataset}:{shared_data / fname}",
         *opts, "--no-progress", "--json", str(out)],
        capsys,
    )
    assert code == 0, stderr
    d = json.loads(out.read_text())
    assert d["status"] == "ok" and d["eval_count"] > 300
    assert math.isfinite(d["eval_ne"]) and d["eval_ne"] < 1.0, d["eval_ne"]
    assert d["eval_auc"] > 0.6
    assert d["steps_run"] <= 110  # about one epoch of the small sample, not 300 steps


def test_interformer_trains_on_synthetic_sequences(tmp_path, capsys):
    out = tmp_path / "o.json"
    code, _, stderr = run_cli(
        ["train", "--model", "interformer", "--data",
         "synthetic:num_sparse=4,cardinality=500,eval_examples=1024,seq_len=8",
         "--steps", "20", "--window", "10", "--no-progress", "--json", str(out)],
        capsys,
    )
    assert code == 0, stderr
    d = json.loads(out.read_text())
    assert d["status"] == "ok" and d["model"] == "interformer" and math.isfinite(d["eval_logloss"])


def test_default_schedule_is_one_epoch_on_small_files_and_300_steps_otherwise():
    from types import SimpleNamespace

    from loka_tune.commands.train import default_schedule

    assert default_schedule(SimpleNamespace(), None, None) == (256, 300)  # synthetic: no row count
    assert default_schedule(SimpleNamespace(num_train_rows=1605), None, None) == (16, 101)
    assert default_schedule(SimpleNamespace(num_train_rows=6491), None, None) == (64, 102)
    assert default_schedule(SimpleNamespace(num_train_rows=10_000_000), None, None) == (256, 300)
    assert default_schedule(SimpleNamespace(num_train_rows=1605), 32, None) == (32, 51)
    assert default_schedule(SimpleNamespace(num_train_rows=1605), None, 7) == (16, 7)


def test_train_loss_is_a_full_window_mean_and_says_over_how_many_steps(tmp_path, capsys):
    out = tmp_path / "o.json"
    argv = ["train", "--model", "dlrm", "--data", "synthetic:num_sparse=3,cardinality=100,eval_examples=256",
            "--steps", "12", "--window", "5", "--no-progress", "--json", str(out)]
    code, stdout, stderr = run_cli(argv, capsys)
    assert code == 0, stderr
    d = json.loads(out.read_text())
    assert d["curve_steps"] == [5, 10, 12]  # the last curve point covers the 2 leftover steps only
    assert d["train_logloss"] != d["loss_curve"][-1]  # ... while the train loss is the last 5 steps' mean
    assert "(mean of the last 5 steps)" in stdout


def test_steps_over_several_epochs_of_a_small_file_warn(shared_data, tmp_path, capsys):
    data = f"criteo:{shared_data / 'criteo_kaggle_head1k_truncated_rows.tsv'}"
    base = ["train", "--model", "dlrm", "--data", data, "--batch-size", "256", "--no-progress"]
    code, _, stderr = run_cli(base + ["--steps", "8"], capsys)  # 8 x 256 rows: about 2.5 passes
    assert code == 0, stderr
    assert "epochs over the" in stderr and "overfits" in stderr and "one epoch is" in stderr
    code, _, stderr = run_cli(base + ["--steps", "2"], capsys)  # under one epoch: quiet
    assert code == 0 and "epochs" not in stderr
