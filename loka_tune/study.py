"""Compatibility: the study schema now lives in :mod:`loka_tune.tuner.study` (kept for a release;
new code imports from there)."""

from __future__ import annotations

from loka_tune.tuner.study import (
    MOD_NAMES,
    DataSection,
    ModelSection,
    ObjectiveSection,
    ProbeSection,
    SpaceSection,
    StorageSection,
    StudyConfig,
    StudySection,
    TrackingSection,
    TrainingSection,
    TrialsSection,
    load_study,
    parse_study,
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
    "MOD_NAMES",
]
