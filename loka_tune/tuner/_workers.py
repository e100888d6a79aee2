"""Several workers on one study: heartbeats, dead workers' trials, the shared trial budget and
configurations evaluated once (a repeated one waits for, or copies, the earlier trial).

Private to the loop (:mod:`loka_tune.tuner.loop`). Optuna is imported inside the functions.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import signal
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, Self

from loka_tune.tuner.build import _log
from loka_tune.tuner.results import TrialRecord


class _Heartbeat:
    """Records the trial's heartbeat every ``interval`` seconds while a trial runs (``with``)."""

    def __init__(self, storage: Any, trial_id: int, interval: float) -> None:
        self.storage, self.trial_id, self.interval = storage, trial_id, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            try:
                self.storage.record_heartbeat(self.trial_id)
            except Exception:  # a transient DB error must not kill the trial; the next beat retries
                pass
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> Self:
        if hasattr(self.storage, "record_heartbeat") and self.storage.get_heartbeat_interval():
            try:  # synchronously first: from here on a killed worker leaves a stale trial
                self.storage.record_heartbeat(self.trial_id)
            except Exception:  # noqa: BLE001 - the thread retries
                pass
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Inside: SIGTERM raises ``KeyboardInterrupt`` as Ctrl-C does, so that both end a trial the
    same way (failed, re-queued, its MLflow run KILLED). The main thread only (signals are
    delivered there); the previous handler is restored on leaving."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _dead_here(worker: str | None) -> bool:
    """Whether ``worker`` ("host:pid", as the loop writes it) is a process of this host that is gone."""
    host, _, pid = (worker or "").rpartition(":")
    if host != platform.node() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    return not _pid_alive(int(pid))


def _fail_dead_local(study: Any) -> None:
    """Fail (and re-queue) RUNNING trials whose worker ran on this host and has exited (killed,
    or a crashed terminal): a resumed study need not wait ``grace_s`` for their heartbeat to go
    stale. Other hosts' trials are left to the heartbeat check."""
    from optuna.trial import TrialState

    storage = study._storage
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if not _dead_here(TrialRecord.of(t).worker):
            continue
        _fail_and_requeue(study, storage, t, "its worker process is gone")


def _fail_and_requeue(study: Any, storage: Any, t: Any, why: str) -> None:
    import optuna
    from optuna.trial import TrialState

    try:
        if not storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL):
            return
    except optuna.exceptions.UpdateFinishedTrialError:  # another worker failed it first
        return
    get_cb = getattr(storage, "get_heartbeat_stale_trial_callback", None)  # as Optuna's stale check
    callback = get_cb() if get_cb is not None else None
    if callback is not None:
        callback(study, storage.get_trial(t._trial_id))
    else:
        study.enqueue_trial(t.params)
    _log(f"[loka-tune] trial {t.number}: {why}; failed and re-queued")


def _fail_stale(study: Any, grace_s: float | None = None) -> None:
    """Fail (and re-queue) the trials of dead workers.

    Optuna fails RUNNING trials whose heartbeat is older than the grace period. A worker killed
    between asking a trial and its first heartbeat leaves a RUNNING trial with no heartbeat at
    all, which Optuna never calls stale: such an orphan (no ``worker`` attribute, which is set
    right after the first heartbeat, and started more than ``grace_s`` ago) is failed here and
    its parameters are enqueued again, so no worker waits for it forever.
    """
    import optuna
    from optuna.trial import TrialState

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    _fail_dead_local(study)
    if grace_s is None:
        return
    now = datetime.datetime.now()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if TrialRecord.of(t).worker is not None or t.datetime_start is None:
            continue
        if (now - t.datetime_start).total_seconds() <= grace_s:
            continue
        _fail_and_requeue(study, study._storage, t, "its worker died before its first heartbeat")


def _n_counted(trials: Iterable[Any]) -> tuple[int, int]:
    """(finished trials that count toward n_trials, running trials)."""
    from optuna.trial import TrialState

    done = running = 0
    for t in trials:
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
            done += 1
        elif t.state == TrialState.FAIL and TrialRecord.of(t).counts:
            done += 1  # failed by its config (stale trials of dead workers are re-queued, not counted)
        elif t.state == TrialState.RUNNING:
            running += 1
    return done, running


def _find_duplicate(study: Any, key: str, number: int) -> Any:
    """An earlier trial with the same config key: finished (copy it) or running (wait for it)."""
    from optuna.trial import TrialState

    best = None
    for t in study.get_trials(deepcopy=False):
        r = TrialRecord.of(t)
        if t.number == number or r.config_key != key:
            continue
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED) or (t.state == TrialState.FAIL and r.counts):
            if not r.cache_hit:
                return t
            best = best or t
        elif t.state == TrialState.RUNNING and t.number < number and best is None:
            best = t
    return best


def _wait_for(study: Any, trial_number: int, poll_s: float, limit_s: float, grace_s: float | None = None) -> Any:
    """Poll until the running trial ``trial_number`` finishes; its frozen trial, or None (it died)."""
    from optuna.trial import TrialState

    t_end = time.time() + limit_s
    while time.time() < t_end:
        _fail_stale(study, grace_s=grace_s)
        t = study.get_trials(deepcopy=False)[trial_number]
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
            return t
        if t.state == TrialState.FAIL:
            return t if TrialRecord.of(t).counts else None
        time.sleep(poll_s)
    return None
