"""Several workers on one study: heartbeats, dead workers' trials, the shared trial budget and
configurations evaluated once (a repeated one waits for, or copies, the earlier trial).

Interruptions and resumes: a trial failed by an interruption or a dead worker is re-queued and
stands for nothing in an uninterrupted study (:func:`_requeued`); a trial's *position* is its
number without those (:func:`trial_position`: what seeds the sampler's draws for it), and the queue
keeps the order of the trials its entries stand for (:func:`keep_queue_order`).

Private to the tuner package: its public names serve the loop (:mod:`loka_tune.tuner.loop`) and
the sampler (:mod:`loka_tune.tuner._sampler`). Optuna is imported inside the functions.
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

from loka_tune.tuner.log import log
from loka_tune.tuner.results import TrialRecord

__all__ = ["ATTR_REQUEUED_FROM", "Heartbeat", "sigterm_as_interrupt", "fail_stale", "trial_position", "requeue_attrs",
           "keep_queue_order", "n_counted", "copies_in_a_row", "find_duplicate", "wait_for"]

ATTR_REQUEUED_FROM = "requeued_from"  # trial user attr: the number of the trial a re-queued one stands for


class Heartbeat:
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
def sigterm_as_interrupt() -> Iterator[None]:
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
        study.enqueue_trial(t.params, user_attrs=requeue_attrs(t))
    log(f"[loka-tune] trial {t.number}: {why}; failed and re-queued")


def fail_stale(study: Any, grace_s: float | None = None) -> None:
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
    if grace_s is not None:
        now = datetime.datetime.now()
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if TrialRecord.of(t).worker is not None or t.datetime_start is None:
                continue
            if (now - t.datetime_start).total_seconds() <= grace_s:
                continue
            _fail_and_requeue(study, study._storage, t, "its worker died before its first heartbeat")
    keep_queue_order(study)


def _requeued(t: Any) -> bool:
    """A trial failed by an interruption or a dead worker, not by its configuration (no
    ``fail_reason``): re-queued, not counted, and no trial of an uninterrupted study."""
    from optuna.trial import TrialState

    return t.state == TrialState.FAIL and not TrialRecord.of(t).counts


def trial_position(trials: Iterable[Any], number: int) -> int:
    """Trial ``number``'s position: the trials before it that an uninterrupted study has too."""
    return sum(1 for t in trials if t.number < number and not _requeued(t))


def _origin(t: Any) -> int:
    """The number of the trial that ``t`` stands for: a re-queued trial's (ours record it in
    ``requeued_from``, Optuna's retry callback in the system attribute ``failed_trial``), else its own."""
    o = t.user_attrs.get(ATTR_REQUEUED_FROM)
    if o is None:
        o = t.system_attrs.get("failed_trial")
    return t.number if o is None else int(o)


def requeue_attrs(t: Any) -> dict[str, Any]:
    """The user attributes of ``t``'s configuration queued again: its start label and its origin."""
    attrs: dict[str, Any] = {ATTR_REQUEUED_FROM: _origin(t)}
    if t.user_attrs.get("seeded"):
        attrs["seeded"] = t.user_attrs["seeded"]
    return attrs


def keep_queue_order(study: Any) -> None:
    """Keep the queue in the order of the trials its entries stand for.

    Optuna runs waiting trials lowest number first, and a re-queued trial takes a new number: a
    trial interrupted while later enqueued ones waited (the starts) would run after them, and
    TPE, which reads the study's trials in number order, would then explore differently than an
    uninterrupted study. So when the waiting trials' origins are out of order, they are taken off
    the queue (failed, not counted: they stand for nothing) and queued again in the right order.
    Best effort with several workers: a trial another worker took meanwhile stays theirs."""
    import optuna
    from optuna.trial import TrialState

    waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    order = sorted(waiting, key=lambda t: (_origin(t), t.number))
    if [t.number for t in order] == [t.number for t in waiting]:
        return
    storage = study._storage
    taken = []
    for t in order:
        try:
            if storage.set_trial_state_values(t._trial_id, state=TrialState.RUNNING):
                taken.append(t)
        except optuna.exceptions.UpdateFinishedTrialError:
            continue
    for t in taken:
        storage.set_trial_user_attr(t._trial_id, "reason", "re-queued in its place behind an interrupted trial")
        storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL)
    for t in taken:
        params = {**t.system_attrs.get("fixed_params", {}), **t.params}
        study.enqueue_trial(params, user_attrs=requeue_attrs(t))


def n_counted(trials: Iterable[Any]) -> tuple[int, int]:
    """(finished trials that count toward n_trials, running trials that will).

    ``n_trials`` counts distinct configurations evaluated: a cache copy (a repeated
    configuration, given the earlier trial's result) is recorded but not counted, nor is a
    running trial whose configuration an earlier trial has (it will be one). A failed trial counts
    when its configuration failed it; one of an interruption or a dead worker is re-queued instead."""
    from optuna.trial import TrialState

    done = running = 0
    keys: set[str] = set()
    for t in sorted(trials, key=lambda t: t.number):
        r = TrialRecord.of(t)
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED) or (t.state == TrialState.FAIL and r.counts):
            if not r.cache_hit:
                done += 1
        elif t.state == TrialState.RUNNING:
            if r.trains_as is None or r.trains_as not in keys:
                running += 1
        else:
            continue
        if r.trains_as is not None:
            keys.add(r.trains_as)
    return done, running


def copies_in_a_row(trials: Iterable[Any]) -> int:
    """How many of the last finished trials are cache copies, back to the last evaluated one."""
    n = 0
    for t in sorted(trials, key=lambda t: t.number, reverse=True):
        if t.state.name not in ("COMPLETE", "PRUNED", "FAIL") or _requeued(t):
            continue
        if not TrialRecord.of(t).cache_hit:
            break
        n += 1
    return n


def find_duplicate(study: Any, key: str, number: int) -> Any:
    """An earlier trial that trains as ``key`` (:attr:`TrialRecord.trains_as`): finished (copy it)
    or running (wait for it)."""
    from optuna.trial import TrialState

    best = None
    for t in study.get_trials(deepcopy=False):
        r = TrialRecord.of(t)
        if t.number == number or r.trains_as != key:
            continue
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED) or (t.state == TrialState.FAIL and r.counts):
            if not r.cache_hit:
                return t
            best = best or t
        elif t.state == TrialState.RUNNING and t.number < number and best is None:
            best = t
    return best


def wait_for(study: Any, trial_number: int, poll_s: float, limit_s: float, grace_s: float | None = None) -> Any:
    """Poll until the running trial ``trial_number`` finishes; its frozen trial, or None (it died)."""
    from optuna.trial import TrialState

    t_end = time.time() + limit_s
    while time.time() < t_end:
        fail_stale(study, grace_s=grace_s)
        t = study.get_trials(deepcopy=False)[trial_number]
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
            return t
        if t.state == TrialState.FAIL:
            return t if TrialRecord.of(t).counts else None
        time.sleep(poll_s)
    return None
