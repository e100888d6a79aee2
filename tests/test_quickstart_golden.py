"""The quickstart study's export does not change: a golden file, recorded before the tuner was
split into ``loka_tune/tuner/`` (issue 12), compared on every run.

The study is ``studies/quickstart.toml`` with 4 trials instead of 12 and 2 probe samples
instead of 4 (CI time: about a minute on 2 idle cores), run through the CLI (``loka-tune
tune`` without tracking, then ``loka-tune export``). The first three trials are the enqueued
starts and the fourth is TPE's first startup draw (random under the study's seed), so the
configs evaluated do not depend on the measured numbers. What is compared: the exported
config (mods, default, per-site choices) and its provenance, every trial's record (state,
value, parameters, user attributes), the stored baseline and the probe-pruned search space,
minus what is not deterministic (timestamps, wall-clock times, worker names, paths, library
versions).

Re-record (only when a change of behaviour is intended, and say so in the commit):
``LOKA_UPDATE_GOLDEN=1 python3 -m pytest tests/test_quickstart_golden.py``.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "data" / "quickstart_export.json"
N_TRIALS = 4
PROBE_SAMPLES = 2

# provenance / attribute keys that vary from run to run or machine to machine
_VOLATILE = {"exported_at", "versions", "wall_s", "worker", "measured_step_time_s"}
# floats from the CPU training runs: bit-identical on one machine (the trainer is deterministic
# there), compared with a tolerance so that another CPU's float rounding does not fail the test
_REL_TOL = 1e-6


def _study_file(tmp_path: Path) -> Path:
    text = (REPO / "studies" / "quickstart.toml").read_text()
    text, n = re.subn(r"(?m)^n_trials = \d+", f"n_trials = {N_TRIALS}", text)
    assert n == 1, "studies/quickstart.toml has no 'n_trials = ...' line any more: update this test"
    text, n = re.subn(r"(?m)^samples = \d+", f"samples = {PROBE_SAMPLES}", text)
    assert n == 1, "studies/quickstart.toml has no 'samples = ...' line any more: update this test"
    text, n = re.subn(r"(?m)^\[study\]\n", f'[study]\noutput_dir = "{tmp_path / "runs"}"\n', text)
    assert n == 1
    p = tmp_path / "quickstart.toml"
    p.write_text(text)
    return p


def _normalize(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _normalize(x) for k, x in sorted(v.items()) if k not in _VOLATILE}
    if isinstance(v, (list, tuple)):
        return [_normalize(x) for x in v]
    return v


def _trial_records(study: Any) -> list[dict[str, Any]]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        rows.append({"number": t.number, "state": t.state.name, "value": t.value, "params": dict(t.params),
                     "user_attrs": dict(t.user_attrs)})
    return _normalize(rows)


def _run_quickstart(tmp_path: Path) -> dict[str, Any]:
    import optuna

    from loka_tune.cli import main
    from loka_tune.tuner.study import load_study

    study_file = _study_file(tmp_path)
    assert main(["tune", str(study_file), "--no-tracking"]) == 0
    out = tmp_path / "best.json"
    assert main(["export", str(study_file), "--out", str(out)]) == 0
    cfg = load_study(study_file)
    study = optuna.load_study(study_name=cfg.name, storage=cfg.storage.url)
    attrs = study.user_attrs
    return {"export": _normalize(json.loads(out.read_text())), "trials": _trial_records(study),
            "baseline": _normalize(attrs["loka.baseline"]), "space": _normalize(attrs["loka.space"])}


def _assert_same(got: Any, want: Any, path: str = "$") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), f"{path}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            _assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{path}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, float) and not isinstance(got, bool) and isinstance(got, (int, float)):
        assert math.isclose(got, want, rel_tol=_REL_TOL, abs_tol=1e-12), f"{path}: {got!r} != {want!r}"
    else:
        assert got == want and type(got) is type(want), f"{path}: {got!r} != {want!r}"


@pytest.mark.slow
def test_quickstart_export_matches_the_golden_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    got = _run_quickstart(tmp_path)
    capsys.readouterr()
    if os.environ.get("LOKA_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert len(want["trials"]) == N_TRIALS and want["export"]["sites"], "the golden study found no FP8 config"
    _assert_same(got, want)
