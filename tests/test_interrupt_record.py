"""An interrupted trial is recorded even when the interrupt broke the storage's session.

A Ctrl-C that lands inside a SQLite commit can leave the storage's session (and its pooled
connection) mid-transaction: every later write on it fails, and the interrupted trial stayed
RUNNING and un-queued ("could not record it", seen in CI). ``_tell_interrupted`` now drops the
sessions and retries each step it has not done yet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

optuna = pytest.importorskip("optuna")

import loka_tune.tuner.loop as loop  # noqa: E402

DISTS = {"x": optuna.distributions.CategoricalDistribution(["a", "b", "c"])}


def _study(tmp_path: Path) -> Any:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(study_name="s", storage=f"sqlite:///{tmp_path / 's.db'}")


def _interrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, fails: int = 0,
                 told: bool = False) -> tuple[Any, Any, list[str], dict[str, int]]:
    """A study with one running trial (``told``: already told COMPLETE), ``_tell_interrupted`` run
    on it with the storage's writes failing ``fails`` times; ``(study, trial, logged lines, counts)``."""
    study = _study(tmp_path)
    trial = study.ask(fixed_distributions=DISTS)
    if told:
        study.tell(trial, 1.0)
    lines: list[str] = []
    monkeypatch.setattr(loop, "log", lines.append)
    seen = _broken_writes(monkeypatch, fails=fails)
    loop._tell_interrupted(None, study, trial, tracker=None)  # type: ignore[arg-type]  # never raises
    return study, trial, lines, seen


def _broken_writes(monkeypatch: pytest.MonkeyPatch, fails: int) -> dict[str, int]:
    """The storage's user-attribute writes fail ``fails`` times (a session the interrupt broke);
    counts the writes tried and the session resets."""
    seen = {"writes": 0, "resets": 0}
    real_set = optuna.storages.RDBStorage.set_trial_user_attr
    real_reset = loop.reset_storage_sessions

    def set_attr(self: Any, *a: Any, **k: Any) -> None:
        seen["writes"] += 1
        if seen["writes"] <= fails:
            raise optuna.exceptions.StorageInternalError("An exception is raised during the commit (broken session)")
        real_set(self, *a, **k)

    def reset(storage: Any) -> None:
        seen["resets"] += 1
        real_reset(storage)

    monkeypatch.setattr(optuna.storages.RDBStorage, "set_trial_user_attr", set_attr)
    monkeypatch.setattr(loop, "reset_storage_sessions", reset)
    monkeypatch.setattr(loop.time, "sleep", lambda s: None)
    return seen


def test_an_interrupted_trial_is_failed_and_requeued_after_a_broken_session(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    study, trial, lines, seen = _interrupted(tmp_path, monkeypatch, fails=1)
    assert seen["resets"] == 1
    trials = study.get_trials(deepcopy=False)
    assert trials[0].state.name == "FAIL" and trials[0].user_attrs["status"] == "failed"
    waiting = [t for t in trials if t.state.name == "WAITING"]
    assert len(waiting) == 1 and waiting[0].system_attrs["fixed_params"] == trial.params  # re-queued once
    assert lines == [f"[loka-tune] trial {trial.number}: interrupted; marked failed, its configuration re-queued"]


def test_a_storage_that_stays_broken_is_reported_and_the_interrupt_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, lines, seen = _interrupted(tmp_path, monkeypatch, fails=10**6)
    assert seen["resets"] == loop.INTERRUPT_ATTEMPTS
    assert len(lines) == 1 and "could not record it after 3 attempts" in lines[0] and "broken session" in lines[0]


def test_an_interrupt_after_the_trial_was_told_changes_nothing(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    study, trial, lines, seen = _interrupted(tmp_path, monkeypatch, told=True)
    assert seen == {"writes": 0, "resets": 0}  # nothing written, nothing to retry
    assert [t.state.name for t in study.get_trials(deepcopy=False)] == ["COMPLETE"]
    assert lines == [f"[loka-tune] trial {trial.number}: interrupted after it was recorded (COMPLETE)"]
