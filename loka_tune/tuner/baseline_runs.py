"""The bf16 baseline runs of a preparation that did not finish, kept for the next preparation.

The baselines (every seed's bf16 run and its noise twins) and the probe's measurement are most of a
study's preparation: 85.9 s of its 92.1 s at B = 32768 on the H200 (2026-12-04). A preparation
that stopped after them would lose them: the budget refused on the noise floor (the fix is often a
larger ``objective.budget_pct`` or ``--force``, neither of which changes a run), an interrupt while
the prices are timed, an error in the space. So as soon as both are done, :func:`save_runs` writes them
to ``<output_dir>/baseline_runs.json`` (atomically): the :class:`Baseline`, the loss curves, the
probe's report, and the key they were made under (:func:`runs_key`: every setting the study's
stored baseline is checked against except ``objective.budget_pct``; the device's name; torch's and
loka-tune's versions). The next preparation of the study with the same key reuses them
(:func:`load_runs`) and says so; with another key it runs them again. A finished preparation
stores them in the study and removes the file (:func:`drop_runs`); ``--fresh`` removes it too.

The model's code is trusted as a stored study's is: a resumed study reuses its stored baseline
when the settings match, whatever the model factory now builds; after an edit of a model's code,
``--fresh`` runs the baselines again. On a CPU a study refused on its noise floor has not measured
its probe yet (it is measured after the budget check there), so nothing is kept; its runs take
seconds there.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loka_tune._io import atomic_write_text
from loka_tune.tuner.baseline import Baseline
from loka_tune.tuner.study import StudyConfig, settings_changes

__all__ = ["RUNS_FILE", "KEY_IGNORES", "runs_key", "runs_file", "save_runs", "load_runs", "drop_runs", "Reused"]

RUNS_FILE = "baseline_runs.json"
#: the settings a change of which does not change a baseline run or the probe's measurement, and
#: that a noise-floor refusal names as its fix: the next preparation reuses the runs across them
KEY_IGNORES = ("objective.budget_pct",)
_KIND = "loka-tune baseline runs"
_VERSION = 1


def runs_key(cfg: StudyConfig, device: str) -> dict[str, Any]:
    """What a preparation's baseline runs were made under: the study's settings but
    :data:`KEY_IGNORES`, the device's name and torch's and loka-tune's versions (JSON values)."""
    import torch

    from loka_tune.version import __version__

    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    settings = {k: v for k, v in cfg.settings().items() if k not in KEY_IGNORES}
    key: dict[str, Any] = json.loads(json.dumps({"settings": settings, "device": name, "torch": torch.__version__,
                                                  "loka_tune": __version__}, sort_keys=True, default=str))
    return key


def runs_file(cfg: StudyConfig) -> Path:
    """Where a study keeps the runs of a preparation that did not finish."""
    return cfg.output_dir / RUNS_FILE


def save_runs(cfg: StudyConfig, device: str, baseline: Baseline, curves: Mapping[int, Any], report: Any,
              seconds: float) -> Path:
    """Write the finished baseline runs (``seconds``: what they took) with their key."""
    doc = {"kind": _KIND, "version": _VERSION, "key": runs_key(cfg, device), "saved": time.strftime("%Y-%m-%d %H:%M:%S"),
           "seconds": float(seconds), "baseline": baseline.to_dict(),
           "curves": {str(s): [float(x) for x in c] for s, c in curves.items()},
           "probe_report": None if report is None else report.to_dict()}
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(runs_file(cfg), json.dumps(doc, default=str) + "\n")


@dataclass(frozen=True)
class Reused:
    """Baseline runs read back: ``baseline``, ``curves`` (seed -> losses), ``report`` (the probe's
    :class:`~loka_tune.probe.report.ProbeReport`, or None: the probe was off), ``seconds`` (what
    they took when they ran) and ``saved`` (when)."""

    baseline: Baseline
    curves: dict[int, tuple[float, ...]]
    report: Any
    seconds: float
    saved: str

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> Reused:
        from loka_tune.probe.report import ProbeReport

        rep = doc.get("probe_report")
        return cls(baseline=Baseline.from_dict(doc["baseline"]),
                   curves={int(s): tuple(float(x) for x in c) for s, c in doc["curves"].items()},
                   report=None if rep is None else ProbeReport.from_dict(rep, source=RUNS_FILE),
                   seconds=float(doc["seconds"]), saved=str(doc["saved"]))


def load_runs(cfg: StudyConfig, device: str) -> tuple[Reused | None, str]:
    """The kept runs if their key is this study's now, with a line saying why (or why not): ``(None,
    "")`` when there is no file. A file that cannot be read, of another version or key is not
    reused (the line names the first setting that differs)."""
    path = runs_file(cfg)
    if not path.is_file():
        return None, ""
    try:
        doc = json.loads(path.read_text())
        if doc.get("kind") != _KIND or doc.get("version") != _VERSION:
            return None, f"{path} is of another kind or version: its runs are not reused"
        old, new = doc["key"], runs_key(cfg, device)
        if old != new:
            return None, f"{path} was made under other settings ({_first_change(old, new)}): its runs are not reused"
        if cfg.probe.enabled and doc.get("probe_report") is None:
            return None, f"{path} has no probe measurement and the probe is on: its runs are not reused"
        return Reused.from_doc(doc), ""
    except (OSError, ValueError, KeyError, TypeError) as e:  # a damaged file: the runs are made again
        return None, f"{path} could not be read ({type(e).__name__}: {e}): its runs are not reused"


def _first_change(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    for k in ("device", "torch", "loka_tune"):
        if old.get(k) != new.get(k):
            return f"{k}: {old.get(k)!r} -> {new.get(k)!r}"
    changes = settings_changes(old.get("settings") or {}, new.get("settings") or {})
    return changes[0] if changes else "a setting added or removed"


def drop_runs(cfg: StudyConfig) -> bool:
    """Remove the kept runs (a finished preparation stored them in the study; ``--fresh``); whether
    there were any."""
    try:
        runs_file(cfg).unlink()
        return True
    except FileNotFoundError:
        return False
