"""Scale-out and resilience: killed workers, concurrent workers on SQLite and on PostgreSQL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.test_tune import write_study

REPO = Path(__file__).resolve().parents[1]

WORKER_SPACE = 'roundings = ["exact", "pow2"]\nmods = ["no_bias"]'  # a space with room for distinct trials
GRACE_S = 8  # long enough for a loaded 2-core CI machine, short enough for a quick test
FAST_HEARTBEAT = f"\n[storage]\nheartbeat_s = 1\ngrace_s = {GRACE_S}\n"


def _study_file(tmp_path: Path, n_trials: int, storage: str = "") -> Path:
    p = write_study(tmp_path, n_trials=n_trials, space_extra=WORKER_SPACE)
    extra = FAST_HEARTBEAT + (f'url = "{storage}"\n' if storage else "")
    p.write_text(p.read_text() + extra)
    return p


# Runs the real CLI; with a delay, every trial evaluation first sleeps, so that a fast machine cannot finish the
# whole study between two polls of the test (the kill test needs a trial that is still running when it looks).
_SLOW_CLI = """
import sys, time
import loka_tune.tuner.loop as loop
_evaluate = loop.evaluate_config
def _slow(*a, **k):
    time.sleep(DELAY)
    return _evaluate(*a, **k)
loop.evaluate_config = _slow
from loka_tune.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _worker(study: Path, *extra: str, trial_delay_s: float = 0.0) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    launcher = ["-c", _SLOW_CLI.replace("DELAY", repr(trial_delay_s))] if trial_delay_s else ["-m", "loka_tune"]
    return subprocess.Popen([sys.executable, "-W", "ignore", *launcher, "tune", str(study), "--no-tracking",
                             *extra], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _load(study: Path, storage: str | None = None):  # noqa: ANN202
    import optuna

    from loka_tune.tuner.optuna_setup import load_storage
    from loka_tune.tuner.study import load_study

    cfg = load_study(study)
    return optuna.load_study(study_name=cfg.name, storage=load_storage(storage or cfg.storage.url))


def _finished(study):  # noqa: ANN001, ANN202
    return [t for t in study.get_trials(deepcopy=False) if t.state.name in ("COMPLETE", "PRUNED")
            or (t.state.name == "FAIL" and "fail_reason" in t.user_attrs)]


def _evaluated(study):  # noqa: ANN001, ANN202
    """The finished trials that count toward n_trials: cache copies are recorded, not counted."""
    return [t for t in _finished(study) if not t.user_attrs.get("cache_hit")]


def _assert_no_duplicate_evaluations(study) -> None:  # noqa: ANN001
    keys = Counter(t.user_attrs["config_key"] for t in _finished(study) if not t.user_attrs.get("cache_hit"))
    dup = [k for k, c in keys.items() if c > 1]
    assert not dup, f"configurations evaluated more than once: {dup}"


@pytest.mark.slow
def test_kill_9_mid_study_then_rerun_loses_and_repeats_nothing(tmp_path: Path) -> None:
    study_file = _study_file(tmp_path, n_trials=6)
    proc = _worker(study_file, trial_delay_s=3.0)
    db = tmp_path / "runs" / "t" / "optuna.db"
    deadline = time.time() + 240
    snapshot = None
    while time.time() < deadline:  # wait for 2 finished trials and a running one, then kill -9
        if db.is_file():
            try:
                s = _load(study_file)
            except Exception:  # the study is still being created
                time.sleep(0.5)
                continue
            fin = _finished(s)
            running = [t for t in s.get_trials(deepcopy=False) if t.state.name == "RUNNING"]
            if len(fin) >= 2 and running:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                snapshot = {t.number: (t.state.name, t.value, t.user_attrs["config_key"]) for t in _finished(s)}
                killed = [t.number for t in running]
                break
        if proc.poll() is not None:
            pytest.fail(f"worker ended before it could be killed:\n{proc.stdout.read()}")
        time.sleep(0.2)
    assert snapshot is not None, "the worker never reached the kill point"
    time.sleep(GRACE_S + 0.5)  # past the grace period: the killed trial's heartbeat is stale
    rerun = _worker(study_file)
    out, _ = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, out
    s = _load(study_file)
    after = {t.number: (t.state.name, t.value, t.user_attrs["config_key"]) for t in _finished(s)}
    for n, v in snapshot.items():
        assert after[n] == v  # no completed trial lost or changed
    assert len(_evaluated(s)) == 6
    for n in killed:  # the killed trial was failed by the heartbeat check and re-queued
        t = s.trials[n]
        assert t.state.name == "FAIL" and "fail_reason" not in t.user_attrs
        assert any(r.system_attrs.get("failed_trial") == n for r in s.trials)
    _assert_no_duplicate_evaluations(s)


def _two_workers(study_file: Path, n_trials: int, storage: str | None = None) -> list[str]:
    extra = ["--storage", storage] if storage else []
    procs = [_worker(study_file, *extra, "--worker-index", str(i), trial_delay_s=1.0)  # both get trials
             for i in range(2)]
    outs = [p.communicate(timeout=400)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    s = _load(study_file, storage)
    fin = _finished(s)
    assert n_trials <= len(_evaluated(s)) <= n_trials + 1  # at most one trial of overshoot between workers
    assert len({t.user_attrs["worker"] for t in fin}) == 2  # both did work
    _assert_no_duplicate_evaluations(s)
    assert s.user_attrs["loka.space"]  # one shared space
    return outs


@pytest.mark.slow
def test_two_workers_on_one_sqlite_study(tmp_path: Path) -> None:
    _two_workers(_study_file(tmp_path, n_trials=6), 6)


# ------------------------------------------------------------------------------ PostgreSQL

def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-W", "ignore", "-m", "loka_tune", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_two_workers_on_the_documented_postgresql_url(tmp_path: Path, postgres_url: str) -> None:
    """The README's scale-out command on a real server, through the CLI: `loka-tune tune STUDY
    --storage postgresql://USER@HOST:PORT/DB` in two processes (as on two machines), which share
    the study; then `export` and `report` read it back from the same URL."""
    assert postgres_url.startswith("postgresql://")  # the documented form: no driver in the URL
    study_file = _study_file(tmp_path, n_trials=5)
    _two_workers(study_file, 5, storage=postgres_url)
    assert not (tmp_path / "runs" / "t" / "optuna.db").exists()  # nothing went to the default SQLite file
    out = tmp_path / "best.json"
    r = _cli("export", "t", "--storage", postgres_url, "--out", str(out))
    assert r.returncode == 0 and out.is_file(), r.stdout + r.stderr
    r = _cli("report", str(study_file), "--storage", postgres_url, "--no-plots")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "trial" in r.stdout


def test_orphan_trial_without_heartbeat_is_failed_and_requeued(tmp_path: Path) -> None:
    """A worker killed between ask() and its first heartbeat leaves a RUNNING trial that
    Optuna's heartbeat check never calls stale; fail_stale fails and re-queues it."""
    import optuna
    from optuna.storages import RDBStorage, RetryFailedTrialCallback
    from optuna.trial import TrialState

    from loka_tune.tuner._workers import fail_stale

    storage = RDBStorage(f"sqlite:///{tmp_path / 'o.db'}", heartbeat_interval=1, grace_period=2,
                         heartbeat_stale_trial_callback=RetryFailedTrialCallback(max_retry=2))
    study = optuna.create_study(study_name="o", storage=storage)
    dist = {"x": optuna.distributions.CategoricalDistribution(["a", "b"])}
    orphan = study.ask(fixed_distributions=dist)  # RUNNING, no heartbeat, no "worker" attribute
    alive = study.ask(fixed_distributions=dist)
    alive.set_user_attr("worker", "w1")  # a live worker's trial is left alone
    fail_stale(study, grace_s=1e9)  # too young: nothing happens
    assert study.trials[orphan.number].state == TrialState.RUNNING
    fail_stale(study, grace_s=0.0)
    trials = study.get_trials(deepcopy=False)
    assert trials[orphan.number].state == TrialState.FAIL
    assert trials[alive.number].state == TrialState.RUNNING
    retry = [t for t in trials if t.state == TrialState.WAITING]
    assert len(retry) == 1 and retry[0].system_attrs.get("failed_trial") == orphan.number
    assert retry[0].params == orphan.params
