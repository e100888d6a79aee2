"""Ctrl-C and SIGTERM through the real CLI: a failed, re-queued trial, MLflow runs KILLED, exit
130, no private preparation folder left behind, and a resume that neither waits nor miscounts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_tune import write_study

REPO = Path(__file__).resolve().parents[1]

# The real CLI, with sleeps in the preparation's baseline and in every trial evaluation, so that a
# signal reliably lands inside the phase the test aims at (a tiny study is otherwise done in seconds).
_SLOW_CLI = """
import signal, sys, time
# Ctrl-C's default action, as in a terminal: a runner started in the background (`cmd &`, as a CI
# may be) passes SIGINT on ignored, and Python then installs no KeyboardInterrupt handler
signal.signal(signal.SIGINT, signal.default_int_handler)
import loka_tune.tuner.loop as loop
import loka_tune.tuner.prepare as prepare
_evaluate, _baseline = loop.evaluate_config, prepare.run_baseline
def _slow_eval(*a, **k):
    time.sleep(TRIAL_DELAY)
    return _evaluate(*a, **k)
def _slow_baseline(*a, **k):
    time.sleep(PREP_DELAY)
    return _baseline(*a, **k)
loop.evaluate_config, prepare.run_baseline = _slow_eval, _slow_baseline
from loka_tune.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _tune(study: Path, *extra: str, trial_delay_s: float = 0.0, prep_delay_s: float = 0.0) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    code = _SLOW_CLI.replace("TRIAL_DELAY", repr(trial_delay_s)).replace("PREP_DELAY", repr(prep_delay_s))
    return subprocess.Popen([sys.executable, "-W", "ignore", "-c", code, "tune", str(study), *extra], env=env,
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _load(study: Path):  # noqa: ANN202
    import optuna

    from loka_tune.tuner.study import load_study

    cfg = load_study(study)
    return optuna.load_study(study_name=cfg.name, storage=cfg.storage.url)


def _wait(pred, proc: subprocess.Popen, what: str, limit_s: float = 240.0) -> None:  # noqa: ANN001
    deadline = time.time() + limit_s
    while time.time() < deadline:
        try:
            if pred():
                return
        except Exception:  # noqa: BLE001 - the study or its database is still being created
            pass
        if proc.poll() is not None:
            pytest.fail(f"loka-tune ended before {what}:\n{proc.stdout.read()}")
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"timed out waiting for {what}")


def _mlflow_runs(out: Path) -> dict[str, str]:
    """run name -> status of every run in the study's MLflow store."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name("loka-tune")
    return {r.info.run_name: r.info.status for r in client.search_runs([exp.experiment_id])}


@pytest.mark.slow
def test_sigterm_in_preparation_then_ctrl_c_in_a_trial_then_resume(tmp_path: Path) -> None:
    study_file = write_study(tmp_path, n_trials=2, tracking="true")
    out = tmp_path / "runs" / "t"

    # 1. SIGTERM while preparing: exit 130, and the private .prepare-<pid>/ folder is gone
    proc = _tune(study_file, prep_delay_s=60.0)
    _wait(lambda: any(out.glob(".prepare-*")), proc, "the preparation started")
    proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, text
    assert "interrupted" in text
    assert not list(out.glob(".prepare-*")), "an interrupted preparation left its private folder behind"

    # 2. Ctrl-C (SIGINT) inside a trial: that trial FAILs (not counted), is re-queued, MLflow runs KILLED
    proc = _tune(study_file, trial_delay_s=120.0)

    def running() -> bool:
        return any(t.state.name == "RUNNING" and "worker" in t.user_attrs for t in _load(study_file).trials)

    _wait(running, proc, "a trial started")
    proc.send_signal(signal.SIGINT)
    text, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, text
    s = _load(study_file)
    (stopped,) = [t for t in s.trials if t.state.name == "FAIL"
                  and t.user_attrs["reason"].startswith("interrupted")]
    assert "fail_reason" not in stopped.user_attrs
    waiting = [t for t in s.trials if t.state.name == "WAITING"]
    # re-queued, and first in the queue: ahead of the start that waited behind it
    assert waiting[0].system_attrs.get("fixed_params") == stopped.params, "not re-queued first"
    assert all("fail_reason" not in t.user_attrs for t in s.trials if t.state.name == "FAIL")  # none counted
    assert not [t for t in s.trials if t.state.name == "RUNNING"]
    runs = _mlflow_runs(out)
    assert runs[f"trial-{stopped.number:04d}"] == "KILLED"
    assert runs["study-t"] == "KILLED"

    # 3. the resume does not wait on the interrupted trial and counts 2 of 2, numbering as Optuna does
    t0 = time.time()
    proc = _tune(study_file)
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, text
    assert time.time() - t0 < 200
    lines = re.findall(r"trial (\d+) \((\d+)/(\d+) done\)", text)
    assert [(int(c), int(n)) for _, c, n in lines] == [(1, 2), (2, 2)], text
    s = _load(study_file)
    assert [int(num) for num, _, _ in lines] == [t.number for t in s.trials if t.state.name == "COMPLETE"
                                                or t.state.name == "PRUNED"]
    runs = _mlflow_runs(out)
    assert runs["study-t"] == "FINISHED"
    for num, _, _ in lines:
        assert runs[f"trial-{int(num):04d}"] in ("FINISHED", "KILLED")

    # what the preparation left: the probe report (with the study's own thresholds), no raw statistics
    import json

    report = json.loads((out / "probe_report.json").read_text())
    assert (report["max_error"], report["min_speedup"]) == (0.2, 0.0)  # TINY: the default, and 0.0
    assert not list(out.glob("probe_stats*")) and not list(out.glob(".prepare-*"))


def test_report_on_a_study_whose_preparation_failed_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from loka_tune.cli import main

    study_file = write_study(tmp_path, model='name = "dlrm"\npreset = "tiny"\n[model.overrides]\nno_such_knob = 3')
    assert main(["tune", str(study_file), "--no-tracking"]) == 2  # the model cannot be built: preparation fails
    assert "no_such_knob" in capsys.readouterr().err
    assert not list((tmp_path / "runs" / "t").glob(".prepare-*"))
    assert main(["report", str(study_file)]) == 1
    err = capsys.readouterr().err
    assert "preparation failed" in err and "no_such_knob" in err and "loka-tune tune" in err
