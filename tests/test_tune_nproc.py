"""Studies whose every training run is data-parallel (issue 16): ``[regime] nproc = N``.

The key is checked at parse time; every run of the tuner goes through one funnel that
announces it to the follower ranks; and the real CLI under 2 processes (torchrun, gloo)
gives the same trials as one process at the same global batch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loka_tune.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
N_TRIALS = 2  # the two starts (all-bf16, bf16 + Mods): every trial runs twice below, once per process count


def _study_text(tmp_path: Path, name: str, regime: str) -> str:
    text = (REPO / "studies" / "quickstart.toml").read_text()
    for pattern, repl in ((r"(?m)^n_trials = \d+", f"n_trials = {N_TRIALS}"), (r"(?m)^samples = \d+", "samples = 2"),
                          (r"(?m)^steps = \d+", "steps = 20"), (r'(?m)^name = "quickstart"', f'name = "{name}"')):
        text, n = re.subn(pattern, repl, text)
        assert n == 1, f"studies/quickstart.toml has no {pattern!r} line any more: update this test"
    return text + f"\n[tracking]\nenabled = false\n\n[confirm]\nn_best = 1\n\n[regime]\n{regime}\n"


def _study(tmp_path: Path, name: str, regime: str) -> Path:
    text = _study_text(tmp_path, name, regime)
    text = text.replace("[study]\n", f'[study]\noutput_dir = "{tmp_path / name}"\n', 1)
    p = tmp_path / f"{name}.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("value, match", [
    ("0", r"regime\.nproc.*got 0.*integer >= 1"),
    ('"2"', r"regime\.nproc.*got '2'.*integer >= 1"),
    ("true", r"regime\.nproc.*got True"),
])
def test_nproc_must_be_a_positive_integer(tmp_path: Path, value: str, match: str) -> None:
    from loka_tune.tuner.study import load_study

    with pytest.raises(ConfigError, match=match):
        load_study(_study(tmp_path, "bad", f"nproc = {value}"))


def test_nproc_needs_a_batch_that_splits_and_no_cuda_graphs(tmp_path: Path) -> None:
    from loka_tune.tuner.study import load_study

    with pytest.raises(ConfigError, match=r"global batch of 128 with \[regime\] nproc = 3.*multiple of 3"):
        load_study(_study(tmp_path, "odd", "nproc = 3"))
    with pytest.raises(ConfigError, match=r"regime\.batch_size.*global batch of 100.*nproc = 8"):
        load_study(_study(tmp_path, "odd2", "nproc = 8\nbatch_size = 100"))
    with pytest.raises(ConfigError, match="nproc = 2 with cuda_graphs = true.*one-process"):
        load_study(_study(tmp_path, "graphs", "nproc = 2\ncuda_graphs = true"))
    cfg = load_study(_study(tmp_path, "ok", "nproc = 4"))
    assert cfg.regime.nproc == 4 and cfg.to_dict()["regime"]["nproc"] == 4
    one = load_study(_study(tmp_path, "one", ""))
    assert one.regime.nproc == 1 and "nproc" not in one.to_dict()["regime"]  # summaries as before the key


def test_workers_and_nproc_do_not_combine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from loka_tune.cli import main

    assert main(["tune", str(_study(tmp_path, "both", "nproc = 2")), "--workers", "2"]) == 2
    assert "drop --workers" in capsys.readouterr().err


def test_every_run_is_announced_and_a_follower_rebuilds_the_same_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The funnel: rank 0's ``train_in_study`` sends the job (then each pruning answer) before training;
    the follower's model from that job has rank 0's weights and structure."""
    import torch

    from loka_tune.config import ModsConfig, PrecisionConfig
    from loka_tune.tuner import parallel
    from loka_tune.tuner.build import make_model, make_source, train_config
    from loka_tune.tuner.parallel import train_in_study
    from loka_tune.tuner.study import load_study

    cfg = load_study(_study(tmp_path, "funnel", "nproc = 2"))
    sent: list[Any] = []
    monkeypatch.setattr(parallel, "_send", sent.append)
    source = make_source(cfg)
    config = PrecisionConfig(mods=ModsConfig(no_bias=True))
    from loka_tune.applier import apply

    model = make_model(cfg, source, seed=1)
    apply(model, config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tcfg = train_config(cfg, 1, device="cpu")
    from dataclasses import replace

    tcfg = replace(tcfg, steps=10, window=5, eval_batches=1)
    with parallel.leading():
        res = train_in_study(model, source, tcfg, seed=1, config=config, on_step=lambda step, loss: step >= 10)
    assert res.status == "pruned" and res.steps_run == 10
    job = sent[0]
    assert isinstance(job, parallel.TrainJob) and (job.seed, job.config, job.tcfg, job.prune) == (1, config, tcfg, True)
    assert sent[1:] == [False, True, None]  # the pruner's answers at steps 5 and 10, then the stop
    again = make_model(cfg, source, seed=job.seed)
    apply(again, job.config)
    assert sorted(again.state_dict()) == sorted(before)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in before.items())
    sent.clear()
    train_in_study(model, source, tcfg, seed=1, config=config)  # not leading: one process, nothing sent
    assert sent == []


def _tune(tmp_path: Path, name: str, nproc: int) -> dict[str, Any]:
    study = _study(tmp_path, name, f"nproc = {nproc}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-m", "loka_tune", "tune", str(study)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=450)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import optuna

    from loka_tune.tuner.study import load_study

    cfg = load_study(study)
    stored = optuna.load_study(study_name=cfg.name, storage=cfg.storage.url)
    # the N_TRIALS configurations evaluated, in order (a cache copy of one is a trial too, not counted;
    # an enqueued start the budget left waiting is not run)
    trials = [dict(t.user_attrs) for t in stored.get_trials(deepcopy=False)
              if t.state.is_finished() and not t.user_attrs.get("cache_hit")]
    assert len(trials) == N_TRIALS
    best = tmp_path / f"{name}-best.json"
    rc = subprocess.run([sys.executable, "-m", "loka_tune", "export", str(study), "--out", str(best)], cwd=tmp_path,
                        env=env, capture_output=True, text=True, timeout=300)
    assert rc.returncode == 0, rc.stderr[-3000:]
    return {"trials": trials, "best": json.loads(best.read_text())["provenance"], "stderr": proc.stderr}


@pytest.mark.slow
def test_a_study_of_nproc_2_matches_one_process(tmp_path: Path) -> None:
    """The real CLI, 2 processes under torchrun (gloo) vs 1, the same global batch: the
    baseline, every trial (its stored record) and the exported confirmation agree within 0.5%
    of the log loss."""
    one = _tune(tmp_path, "one", 1)
    two = _tune(tmp_path, "two", 2)
    for n in range(N_TRIALS):  # for the record (pytest -s)
        print(f"trial {n}: rel. log loss {one['trials'][n]['rel_logloss_pct']:+.4f}% (1 process)"
              f" {two['trials'][n]['rel_logloss_pct']:+.4f}% (2), eval log loss {one['trials'][n]['eval_logloss']:.6f}"
              f" {two['trials'][n]['eval_logloss']:.6f}")
    assert two["best"]["regime"]["nproc"] == 2 and "nproc" not in one["best"]["regime"]
    assert abs(two["best"]["baseline_logloss"] - one["best"]["baseline_logloss"]) / one["best"]["baseline_logloss"] < 5e-3
    for n in range(N_TRIALS):
        a, b = one["trials"][n], two["trials"][n]
        assert abs(b["eval_logloss"] - a["eval_logloss"]) / a["eval_logloss"] < 5e-3, (n, a, b)
        assert abs(b["rel_logloss_pct"] - a["rel_logloss_pct"]) < 0.5, (n, a["rel_logloss_pct"], b["rel_logloss_pct"])
    assert one["best"]["confirmed"] and two["best"]["confirmed"]
    assert abs(two["best"]["confirmed_rel_logloss_pct"] - one["best"]["confirmed_rel_logloss_pct"]) < 0.5
    assert "probe:" in two["stderr"]  # the probe ran on rank 0's baseline run
