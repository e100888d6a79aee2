"""Study files: a TOML description of one tuning study, validated into a frozen :class:`StudyConfig`.

A study says what to tune (model + data), how to measure quality (short paired training runs)
and speed (measured on a GPU, modeled on a CPU), under which loss budget, over which space
(formats, granularities, backends, Mods), with which trial budget, and where results go
(Optuna storage, MLflow tracking). Every key is checked: an unknown key (a typo) or a bad
value raises :class:`~loka_tune.errors.ConfigError` whose ``key`` is the dotted path
(``"training.steps"``) and whose message quotes the value and names the fix.

Every table and key, with its type, default and meaning, is in ``docs/study-schema.md``
(``loka-tune tune --help-schema`` prints it), generated from the sections' fields
(:mod:`loka_tune.tuner.sections`, :mod:`loka_tune.tuner.regime`) by
:mod:`loka_tune.tuner.schema`. Every table but ``[model]`` and ``[data]`` is optional; a short
study file::

    [study]
    name = "quickstart"          # results in runs/quickstart/

    [model]
    name = "dlrm"                # a built-in model, or "package.module:function"
    preset = "tiny"

    [data]
    source = "synthetic"         # or "criteo:PATH", "avazu:PATH", "package.module:function"

    [objective]
    budget_pct = 1.0             # max relative log loss vs the bf16 baseline, in percent

    [trials]
    n_trials = 12
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from loka_tune._toml import Table
from loka_tune.errors import ConfigError
from loka_tune.tuner.regime import RegimeSection
from loka_tune.tuner.sections import (
    MOD_NAMES,
    ConfirmSection,
    DataSection,
    ModelSection,
    ObjectiveSection,
    ProbeSection,
    SpaceSection,
    StorageSection,
    StudySection,
    TrackingSection,
    TrainingSection,
    TrialsSection,
    Where,
)

__all__ = [
    "StudyConfig",
    "StudySection",
    "ModelSection",
    "DataSection",
    "TrainingSection",
    "ObjectiveSection",
    "SpaceSection",
    "ProbeSection",
    "TrialsSection",
    "StorageSection",
    "TrackingSection",
    "load_study",
    "parse_study",
    "settings_of",
    "settings_changes",
    "MOD_NAMES",
]


@dataclass(frozen=True)
class StudyConfig:
    """A whole study, validated. Build it with :func:`load_study` or :func:`parse_study`."""

    study: StudySection
    model: ModelSection
    data: DataSection
    training: TrainingSection
    objective: ObjectiveSection
    space: SpaceSection
    probe: ProbeSection
    trials: TrialsSection
    storage: StorageSection
    tracking: TrackingSection
    regime: RegimeSection = RegimeSection()
    confirm: ConfirmSection = ConfirmSection()
    source_path: Path | None = None

    @property
    def name(self) -> str:
        return self.study.name

    @property
    def output_dir(self) -> Path:
        return self.study.output_dir

    @property
    def batch_size(self) -> int:
        """The production batch size the study's runs use (``[regime]``, else ``[training]``)."""
        return self.regime.batch_size or self.training.batch_size

    @property
    def cost_batch_size(self) -> int:
        return self.objective.cost_batch_size or self.batch_size

    def with_overrides(self, **sections: Any) -> StudyConfig:
        """A copy with whole sections replaced (``with_overrides(trials=TrialsSection(...))``)."""
        return replace(self, **sections)

    def with_output_dir(self, path: str | Path) -> StudyConfig:
        """A copy whose files go to ``path`` (resolved against the working directory): the storage
        and tracking URLs move with it where they are the defaults (databases in the output dir)."""
        out, old = Path(path).resolve(), self.output_dir
        storage, tracking = self.storage, self.tracking
        if storage.url == StorageSection.default_url(old):
            storage = replace(storage, url=StorageSection.default_url(out))
        if tracking.uri == TrackingSection.default_uri(old):
            tracking = replace(tracking, uri=TrackingSection.default_uri(out))
        return replace(self, study=replace(self.study, output_dir=out), storage=storage, tracking=tracking)

    def settings(self) -> dict[str, Any]:
        """The settings a study's baseline, space and trials depend on, flat (``"training.steps"``:
        value), JSON values: what a resumed study must still have (:func:`settings_of`)."""
        return settings_of(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able summary (for MLflow params and provenance)."""
        d = asdict(self)
        d["study"]["output_dir"] = str(self.study.output_dir)
        d["training"] = self.training.to_dict()
        if d["regime"]["nproc"] == 1:  # one process, the default: summaries (and exports) as before the key
            del d["regime"]["nproc"]
        d["source_path"] = None if self.source_path is None else str(self.source_path)
        return d


#: the sections whose settings a study's stored baseline, space and trials depend on ([regime]:
#: the trials' and baselines' step times were taken compiled or not, at its batch and process
#: count); [study] (name, output dir, sampler seed), [trials] (budget, pruner), [confirm],
#: [storage] and [tracking] may change between runs of one study
SETTINGS_SECTIONS = ("model", "data", "training", "objective", "space", "probe", "regime")
#: settings a summary leaves out at their default (so older summaries read the same)
_SUMMARY_DEFAULTS = {"regime": {"nproc": 1}}


def settings_of(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The settings (see :meth:`StudyConfig.settings`) of a study summary (``StudyConfig.to_dict()``,
    as stored in a study's attributes), flat and JSON-normalized (tuples as lists)."""
    import json

    flat = {f"{sec}.{k}": v for sec in SETTINGS_SECTIONS
            for k, v in {**(_SUMMARY_DEFAULTS.get(sec, {}) if sec in summary else {}), **(summary.get(sec) or {})}.items()}
    settings: dict[str, Any] = json.loads(json.dumps(flat, sort_keys=True, default=str))
    return settings


def settings_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """``"key: old -> new"`` for each setting present in both with another value (a key only one
    side has is a field another loka-tune version added or removed, at its default: not a change)."""
    return [f"{k}: {old[k]!r} -> {new[k]!r}" for k in sorted(set(old) & set(new)) if old[k] != new[k]]


# ---------------------------------------------------------------------------------------------
# parsing

_SECTIONS: dict[str, Any] = {
    "study": StudySection, "model": ModelSection, "data": DataSection, "training": TrainingSection,
    "objective": ObjectiveSection, "space": SpaceSection, "probe": ProbeSection, "trials": TrialsSection,
    "storage": StorageSection, "tracking": TrackingSection, "regime": RegimeSection, "confirm": ConfirmSection,
}
_REQUIRED = {  # sections without defaults: what the message says to add
    "model": "missing section; add [model] with name = \"dlrm\" (or \"package.module:function\")",
    "data": "missing section; add [data] with source = \"synthetic\" (or \"criteo:PATH\")",
}


def parse_study(doc: Mapping[str, Any], *, base_dir: Path | None = None, source_path: Path | None = None,
                cwd: Path | None = None) -> StudyConfig:
    """Validate a parsed TOML document into a :class:`StudyConfig`.

    ``base_dir`` (the study file's folder) anchors relative data paths; ``cwd`` (default: the
    working directory) anchors a relative ``study.output_dir``. Each section reads and checks
    its own table (``*Section.from_table``), in the order of :data:`_SECTIONS`.
    """
    if not isinstance(doc, Mapping):
        raise ConfigError(f"got {type(doc).__name__}; a study is a TOML document", key="(top level)")
    unknown = [k for k in doc if k not in _SECTIONS]
    if unknown:
        k = unknown[0]
        close = difflib.get_close_matches(k, list(_SECTIONS), n=1)
        hint = f"; did you mean [{close[0]}]?" if close else ""
        raise ConfigError(f"unknown section [{k}]{hint} (valid sections: {', '.join(_SECTIONS)})", key=k)
    where = Where(cwd=Path.cwd() if cwd is None else Path(cwd), base_dir=base_dir, source_path=source_path)
    sections: dict[str, Any] = {}
    for name, section in _SECTIONS.items():
        if name in _REQUIRED and name not in doc:
            raise ConfigError(_REQUIRED[name], key=name)
        sections[name] = section.from_table(Table(doc.get(name, {}), name), where)
        if name == "study":
            where = replace(where, output_dir=sections[name].output_dir)
    cfg = StudyConfig(**sections, source_path=source_path)
    n = cfg.regime.nproc
    if cfg.batch_size % n:
        key = "regime.batch_size" if cfg.regime.batch_size else "training.batch_size"
        raise ConfigError(f"got a global batch of {cfg.batch_size} with [regime] nproc = {n}; the batch must split"
                          f" evenly over the processes: use a multiple of {n}", key=key)
    return cfg


def load_study(path: str | Path, *, cwd: Path | None = None) -> StudyConfig:
    """Read and validate a study TOML file (errors name the file and the dotted key)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no such study file {str(path)!r}; see studies/quickstart.toml for an example")
    try:
        doc = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"not valid TOML: {e}", path=str(path)) from None
    try:
        return parse_study(doc, base_dir=path.resolve().parent, source_path=path.resolve(), cwd=cwd)
    except ConfigError as e:
        raise e.in_file(path) from None
