"""The probe's read-back and measurement beside the noise twin (issue 21's prepare_s on a GPU):
in a thread while the twin trains, with the same preparation as one after the other.

On a GPU the twin's compiled steps leave the host waiting, so the probe's work (8.6 s at B = 8192
on the H200, the twin 9.9 s) can run in that wait. That is only right if neither changes the
other: the twin must train and the statistics read as they would alone. These tests force the
thread on the CPU (``prepare.beside_twin``) and compare it with the sequential preparation."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from loka_tune.tuner import baseline, prepare
from loka_tune.tuner.baseline import Baseline
from loka_tune.tuner.loop import run_study
from loka_tune.tuner.results import ATTR_BASELINE, ATTR_PREPARE_PHASES, ATTR_PREPARE_S, ATTR_SPACE
from loka_tune.tuner.study import load_study
from tests.test_tune import write_study


def _prepare(tmp_path: Path, name: str) -> tuple[Any, Any]:
    cfg = load_study(write_study(tmp_path, name=name))
    return cfg, run_study(cfg, n_trials=0, confirm=False, tracking=False, progress=False)


def _results(cfg: Any) -> list[dict[str, Any]]:
    return json.loads((cfg.output_dir / "probe_report.json").read_text())["results"]


def spy_runs(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    runs: list[Any] = []
    real = baseline.train_in_study

    def spy(*a: Any, **kw: Any) -> Any:
        res = real(*a, **kw)
        runs.append(res)
        return res

    monkeypatch.setattr(baseline, "train_in_study", spy)
    return runs


@pytest.fixture(scope="module")
def sequential(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, list[Any]]:
    """The tiny study prepared on the CPU as a CPU prepares it: the probe's work after the twins.
    Its read-back and measurement are checked to leave torch's and numpy's global random state as
    they found it: nothing of them can then change what the twin draws when it runs beside them."""
    assert not prepare.beside_twin("cpu") and prepare.beside_twin("cuda")
    mp = pytest.MonkeyPatch()
    runs = spy_runs(mp)
    checked: list[bool] = []
    real_reader = baseline._reader

    def reader(*a: Any, **kw: Any) -> Any:
        read = real_reader(*a, **kw)

        def checked_read() -> Any:
            t, n = torch.get_rng_state(), np.random.get_state()[1].copy()
            out = read()
            checked.append(torch.equal(torch.get_rng_state(), t) and np.array_equal(np.random.get_state()[1], n))
            return out

        return checked_read

    real_report = prepare._probe_report

    def report(*a: Any, **kw: Any) -> Any:  # the measurement, after the budget check off a GPU
        t, n = torch.get_rng_state(), np.random.get_state()[1].copy()
        out = real_report(*a, **kw)
        checked.append(torch.equal(torch.get_rng_state(), t) and np.array_equal(np.random.get_state()[1], n))
        return out

    mp.setattr(baseline, "_reader", reader)
    mp.setattr(prepare, "_probe_report", report)
    try:
        cfg, study = _prepare(tmp_path_factory.mktemp("seq"), "seq")
    finally:
        mp.undo()
    assert checked == [True, True]  # read once, measured once, the global generators untouched
    return cfg, study, runs


def test_beside_the_twin_the_preparation_is_the_sequential_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sequential: tuple[Any, Any, list[Any]],
        caplog: pytest.LogCaptureFixture) -> None:
    cfg_a, a, runs_a = sequential
    monkeypatch.setattr(prepare, "beside_twin", lambda device: True)
    runs_b = spy_runs(monkeypatch)
    with caplog.at_level("INFO", logger="loka_tune"):
        cfg_b, b = _prepare(tmp_path, "beside")
    said = caplog.messages
    assert any(m.startswith("[loka-tune] probe: ") and m.endswith(" beside the noise twin") for m in said)
    assert any("noise twin 1 of seed 0 (" in m and m.endswith("; the probe's read-back and measurement beside it):"
                                                               " 8 steps ...") for m in said)
    assert not any("noise twin 1 of seed 1 (" in m and "beside" in m for m in said)  # seed 1's twin: alone
    assert "ran beside the noise twin" in next(m for m in said if "s to prepare: " in m)

    bl_a, bl_b = (Baseline.from_dict(s.user_attrs[ATTR_BASELINE]) for s in (a, b))
    # every run trained as it does alone: the same losses to the bit, twins included
    assert [r.eval_logloss for r in runs_b] == [r.eval_logloss for r in runs_a]
    assert bl_b.eval_logloss == bl_a.eval_logloss and bl_b.paired_logloss == bl_a.paired_logloss
    assert bl_b.noise_floor_pct == bl_a.noise_floor_pct
    # the statistics read and measured as they are alone: the same verdicts, the same space
    assert _results(cfg_b) == _results(cfg_a) and len(_results(cfg_a)) > 0
    assert b.user_attrs[ATTR_SPACE] == a.user_attrs[ATTR_SPACE]
    # the bf16 step time leaves out the twin that shared its GPU with the probe's work (seed 0's),
    # and only it: runs are seed 0, its twin, seed 1, its twin
    assert len(runs_b) == 4
    assert bl_b.measured_step_time_s == pytest.approx(statistics.median([runs_b[i].step_time_s for i in (0, 2, 3)]))
    assert bl_a.measured_step_time_s == pytest.approx(statistics.median([r.step_time_s for r in runs_a]))


def test_the_phases_still_add_up(sequential: tuple[Any, Any, list[Any]]) -> None:
    """The stored phases are wall laps that add up to prepare_s at most; off a GPU the probe's
    measurement runs after the budget check, as its own phase (a refused study never measures)."""
    _cfg, study, _runs = sequential
    phases, total = study.user_attrs[ATTR_PREPARE_PHASES], study.user_attrs[ATTR_PREPARE_S]
    assert list(phases) == ["baselines", "sites", "baseline_price", "probe", "prices"] and phases["probe"] > 0
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= total + 1e-6


def test_an_error_of_the_work_beside_the_twin_is_the_studys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prepare, "beside_twin", lambda device: True)

    def broken(*a: Any, **kw: Any) -> Any:
        raise RuntimeError("the probe's measurement broke")

    monkeypatch.setattr(prepare, "_probe_report", broken)
    with pytest.raises(RuntimeError, match="the probe's measurement broke"):
        _prepare(tmp_path, "broken")


def test_beside_returns_the_value_or_raises_the_error_in_the_callers_thread() -> None:
    assert baseline._Beside(lambda: 42).result() == 42
    with pytest.raises(ZeroDivisionError):
        baseline._Beside(lambda: 1 / 0).result()


@pytest.mark.gpu
def test_on_cuda_the_work_beside_runs_on_a_stream_of_its_own_and_sees_what_came_before() -> None:
    """On a GPU the thread queues on its own stream (its host reads never wait behind the twin's
    steps on the caller's), after what the caller had queued: a tensor still being written on
    the caller's stream when the thread starts is read whole, while the caller queues more."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(4096, 4096, device=dev, generator=g)
    b = a @ a  # queued on the caller's stream, perhaps not done when the thread starts
    seen: list[Any] = []

    def work() -> float:
        seen.append(torch.cuda.current_stream(dev))
        return float(b.double().sum().item())

    beside = baseline._Beside(work, dev)
    busy = a
    for _ in range(20):  # the caller's stream stays busy meanwhile, as the twin's steps keep it
        busy = torch.tanh(busy @ a * 1e-3)
    got = beside.result()
    assert seen and seen[0] != torch.cuda.default_stream(dev) and seen[0] != torch.cuda.current_stream(dev)
    torch.cuda.synchronize()
    assert got == float(b.double().sum().item())  # the whole product, as the caller reads it once done
    assert torch.isfinite(busy).all()
