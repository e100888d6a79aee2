"""The tuner: a study file in, the fastest feasible precision config out.

``study`` is the study file's schema (``sections`` holds its tables). The names below are
imported lazily, so ``import loka_tune.tuner`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it
_LAZY = {
    # the study file
    "StudyConfig": "loka_tune.tuner.study",
    "load_study": "loka_tune.tuner.study",
    "parse_study": "loka_tune.tuner.study",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'loka_tune.tuner' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
