"""Resume that keeps the answer, through the real CLI: a study interrupted twice (Ctrl-C during
an enqueued start while the next start waits, then ``kill -9`` during a trial the sampler drew)
and resumed evaluates the same configurations in the same order as the same study run without
interruption, and exports the same config from the same trial."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_tune import write_study

REPO = Path(__file__).resolve().parents[1]
SPACE = 'roundings = ["exact", "pow2"]\nmods = ["no_bias"]'  # room for distinct trials beyond the starts
N_TRIALS = 6

# The real CLI; with a delay, every trial evaluation first sleeps, so that a signal lands inside
# the trial the test aims at (a tiny study is otherwise done between two polls).
_SLOW_CLI = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a terminal, even if started in the background
import loka_tune.tuner.loop as loop
_evaluate = loop.evaluate_config
def _slow(*a, **k):
    time.sleep(DELAY)
    return _evaluate(*a, **k)
loop.evaluate_config = _slow
from loka_tune.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _cli(*argv: str, delay_s: float = 0.0) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    code = _SLOW_CLI.replace("DELAY", repr(delay_s))
    return subprocess.Popen([sys.executable, "-W", "ignore", "-c", code, *argv], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out
    return out


def _load(study_file: Path):  # noqa: ANN202
    import optuna

    from loka_tune.tuner.study import load_study

    cfg = load_study(study_file)
    return optuna.load_study(study_name=cfg.name, storage=cfg.storage.url)


def _requeued(t) -> bool:  # noqa: ANN001
    """A trial that stands for nothing in an uninterrupted study: failed by an interruption or a
    dead worker (and re-queued), not by its configuration."""
    return t.state.name == "FAIL" and "fail_reason" not in t.user_attrs


def _history(study_file: Path) -> list[tuple]:
    """What the study evaluated, in order, without the trials interruptions added: per trial its
    state, configuration, step time, relative log loss and cache source (as a position)."""
    trials = _load(study_file).get_trials(deepcopy=False)
    position = {}
    for t in trials:
        if not _requeued(t):
            position[t.number] = len(position)
    return [(t.state.name, t.user_attrs.get("config_key"), t.value, t.user_attrs.get("rel_logloss_pct"),
             position.get(t.user_attrs.get("cached_from"))) for t in trials if t.number in position]


def _interrupt(proc: subprocess.Popen, study_file: Path, *, after: int, sig: int) -> None:
    """Send ``sig`` while the trial after ``after`` finished ones (interrupted ones not counted) runs."""
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            trials = _load(study_file).get_trials(deepcopy=False)
        except Exception:  # noqa: BLE001 - the study or its database is still being created
            trials = []
        done = [t for t in trials if t.state.name in ("COMPLETE", "PRUNED", "FAIL") and not _requeued(t)]
        running = [t for t in trials if t.state.name == "RUNNING" and "worker" in t.user_attrs]
        if len(done) > after:
            proc.kill()
            pytest.fail(f"the study passed trial {after} before it could be interrupted")
        if len(done) == after and running:
            os.kill(proc.pid, sig)
            out, _ = proc.communicate(timeout=120)
            if sig == signal.SIGINT:  # the clean stop: the trial is failed and re-queued by the loop itself
                assert proc.returncode == 130, out
                assert "interrupted; marked failed, its configuration re-queued" in out, out
            else:
                assert proc.returncode == -sig
            return
        if proc.poll() is not None:
            pytest.fail(f"loka-tune ended before the interruption:\n{proc.stdout.read()}")
        time.sleep(0.1)
    proc.kill()
    pytest.fail("timed out waiting for the interruption point")


def _export(study_file: Path, out: Path) -> tuple[dict, dict]:
    proc = _cli("export", str(study_file), "--out", str(out))
    _finish(proc)
    d = json.loads(out.read_text())
    return {k: v for k, v in d.items() if k != "provenance"}, d["provenance"]


@pytest.mark.slow
def test_a_study_interrupted_twice_exports_what_the_uninterrupted_one_does(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    (tmp_path / "cut").mkdir()
    plain = write_study(tmp_path / "plain", n_trials=N_TRIALS, space_extra=SPACE)
    cut = write_study(tmp_path / "cut", n_trials=N_TRIALS, space_extra=SPACE)

    _finish(_cli("tune", str(plain), "--no-tracking"))

    # 1. Ctrl-C during trial 0 (the enqueued all-bf16 start) while the next start waits in the queue
    _interrupt(_cli("tune", str(cut), "--no-tracking", delay_s=3.0), cut, after=0, sig=signal.SIGINT)
    waiting = [t for t in _load(cut).get_trials(deepcopy=False) if t.state.name == "WAITING"]
    assert [t.user_attrs.get("seeded") for t in waiting] == ["all-bf16", "bf16+mods:nobias"]  # in their order
    # 2. kill -9 during the 5th trial, one the sampler drew (TPE: after the 2 starts and 2 more)
    _interrupt(_cli("tune", str(cut), "--no-tracking", delay_s=3.0), cut, after=4, sig=signal.SIGKILL)
    # 3. the same command again finishes the study
    _finish(_cli("tune", str(cut), "--no-tracking"))

    trials = _load(cut).get_trials(deepcopy=False)
    assert sum(_requeued(t) for t in trials) >= 2  # both interruptions left their mark
    assert _history(cut) == _history(plain)  # the same configurations, results and order
    evaluated = [h for h in _history(plain) if h[4] is None and h[0] != "FAIL"]
    assert len(evaluated) == N_TRIALS  # n_trials distinct configurations: cache copies are not counted

    cfg_plain, prov_plain = _export(plain, tmp_path / "plain.json")
    cfg_cut, prov_cut = _export(cut, tmp_path / "cut.json")
    assert cfg_cut == cfg_plain
    position = [t.number for t in trials if not _requeued(t)]
    assert position.index(prov_cut["trial"]) == prov_plain["trial"]  # the same trial, renumbered by the interruptions
    for k in ("step_time_s", "speedup", "rel_logloss_pct", "confirmed", "confirmed_speedup"):
        assert prov_cut[k] == prov_plain[k], k


# ------------------------------------------------------------------ the pieces, without the CLI

def _categorical_study(storage: str, sampler):  # noqa: ANN001, ANN202
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(study_name="s", storage=storage, sampler=sampler, load_if_exists=True)


DISTS = {f"x{i}": ["a", "b", "c", "d"] for i in range(4)}


def _run(study, n: int) -> None:  # noqa: ANN001
    import optuna

    dists = {k: optuna.distributions.CategoricalDistribution(v) for k, v in DISTS.items()}
    for _ in range(n):
        t = study.ask(fixed_distributions=dists)
        study.tell(t, sum(ord(v) * (i + 1) for i, v in enumerate(t.params.values())) % 7)


def _sampler(seed: int = 3):  # noqa: ANN202
    import optuna

    from loka_tune.tuner._sampler import TrialSeededSampler

    return TrialSeededSampler(seed, lambda s: optuna.samplers.TPESampler(seed=s, n_startup_trials=3,
                                                                          multivariate=True, constant_liar=True))


def test_a_restarted_sampler_draws_what_the_uninterrupted_one_did(tmp_path: Path) -> None:
    """The bug: a fresh TPESampler(seed) in a resumed process repeats the first process's first
    draws. Seeded per trial position, a new sampler (a new process) draws what one process did."""
    one = _categorical_study(f"sqlite:///{tmp_path / 'one.db'}", _sampler())
    _run(one, 10)
    url = f"sqlite:///{tmp_path / 'two.db'}"
    _run(_categorical_study(url, _sampler()), 4)  # stopped after 4 trials (random ones and TPE's) ...
    two = _categorical_study(url, _sampler())  # ... and resumed by a new process
    _run(two, 6)
    assert [t.params for t in two.trials] == [t.params for t in one.trials]
    other = _categorical_study(f"sqlite:///{tmp_path / 'other.db'}", _sampler(seed=4))
    _run(other, 10)
    assert [t.params for t in other.trials] != [t.params for t in one.trials]  # the seed does matter


def test_a_trials_position_leaves_out_the_trials_interruptions_added(tmp_path: Path) -> None:
    import optuna
    from optuna.trial import TrialState

    from loka_tune.tuner._workers import trial_position

    study = _categorical_study(f"sqlite:///{tmp_path / 'p.db'}", optuna.samplers.RandomSampler(seed=0))
    d = {"x": optuna.distributions.CategoricalDistribution(["a", "b"])}
    states = []
    for state, attrs in [("COMPLETE", {}), ("FAIL", {}), ("FAIL", {"fail_reason": "nan loss"}), ("PRUNED", {})]:
        t = study.ask(fixed_distributions=d)
        for k, v in attrs.items():
            t.set_user_attr(k, v)
        study.tell(t, 1.0 if state == "COMPLETE" else None, state=TrialState[state])
        states.append(state)
    trials = study.get_trials(deepcopy=False)
    # trial 1 failed without a reason (an interruption): no position; a config's failure keeps its own
    assert [trial_position(trials, n) for n in range(5)] == [0, 1, 1, 2, 3]


def test_cache_copies_do_not_spend_the_trial_budget(tmp_path: Path) -> None:
    import optuna
    from optuna.trial import TrialState

    from loka_tune.tuner._workers import copies_in_a_row, n_counted

    study = _categorical_study(f"sqlite:///{tmp_path / 'c.db'}", optuna.samplers.RandomSampler(seed=0))
    d = {"x": optuna.distributions.CategoricalDistribution(["a", "b"])}

    def trial(key: str, state: str | None, **attrs: object) -> None:
        t = study.ask(fixed_distributions=d)
        t.set_user_attr("config_key", key)
        for k, v in attrs.items():
            t.set_user_attr(k, v)
        if state is not None:
            study.tell(t, 1.0 if state == "COMPLETE" else None, state=TrialState[state])

    trial("A", "COMPLETE")
    trial("B", "PRUNED")
    trial("A", "COMPLETE", cache_hit=True, cached_from=0)  # a copy: recorded, not counted
    trial("C", "FAIL", fail_reason="non-finite loss")  # its config failed it: counted
    trial("D", "FAIL")  # interrupted and re-queued: not counted
    trial("B", "PRUNED", cache_hit=True, cached_from=1)
    trial("E", None)  # running, a new config: will count
    trial("E", None)  # running, the same config: will be a copy
    assert n_counted(study.get_trials(deepcopy=False)) == (3, 1)
    trial("B", "PRUNED", cache_hit=True, cached_from=1)
    # back to trial 3, the last evaluated one: the running and the re-queued trials are passed over
    assert copies_in_a_row(study.get_trials(deepcopy=False)) == 2
    study2 = _categorical_study(f"sqlite:///{tmp_path / 'c2.db'}", optuna.samplers.RandomSampler(seed=0))
    study = study2
    trial("A", "COMPLETE")
    trial("A", "COMPLETE", cache_hit=True, cached_from=0)
    trial("X", "FAIL")  # an interruption between them does not break the run of copies
    trial("A", "COMPLETE", cache_hit=True, cached_from=0)
    assert copies_in_a_row(study.get_trials(deepcopy=False)) == 2


def test_the_queue_keeps_the_order_of_the_trials_it_stands_for(tmp_path: Path) -> None:
    """A trial interrupted while later starts wait runs first again, as in an uninterrupted study."""
    import optuna
    from optuna.trial import TrialState

    from loka_tune.tuner._workers import ATTR_REQUEUED_FROM, keep_queue_order

    study = _categorical_study(f"sqlite:///{tmp_path / 'q.db'}", optuna.samplers.RandomSampler(seed=0))
    d = {"x": optuna.distributions.CategoricalDistribution(["a", "b", "c"])}
    for label, x in (("first", "a"), ("second", "b"), ("third", "c")):
        study.enqueue_trial({"x": x}, user_attrs={"seeded": label})
    t = study.ask(fixed_distributions=d)  # trial 0: "first", interrupted
    study.tell(t, state=TrialState.FAIL)
    study.enqueue_trial({"x": "a"}, user_attrs={"seeded": "first", ATTR_REQUEUED_FROM: 0})  # behind 1 and 2
    keep_queue_order(study)
    waiting = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.WAITING]
    assert [(t.user_attrs["seeded"], t.system_attrs["fixed_params"]) for t in waiting] == [
        ("first", {"x": "a"}), ("second", {"x": "b"}), ("third", {"x": "c"})]
    assert [t.user_attrs[ATTR_REQUEUED_FROM] for t in waiting] == [0, 1, 2]
    moved = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.FAIL][1:]
    assert len(moved) == 3 and all("fail_reason" not in t.user_attrs for t in moved)  # not counted
    before = [t.number for t in study.get_trials(deepcopy=False)]
    keep_queue_order(study)  # in order now: nothing to do
    assert [t.number for t in study.get_trials(deepcopy=False)] == before
    assert [study.ask(fixed_distributions=d).params["x"] for _ in range(3)] == ["a", "b", "c"]
