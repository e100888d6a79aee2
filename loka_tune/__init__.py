"""loka-tune: autotuning FP8 precision configurations for large recommendation models.

The top-level API is imported lazily so that ``import loka_tune`` is fast and never touches
CUDA, triton, fbgemm, torchao or mlflow:

>>> import loka_tune
>>> summary = loka_tune.apply(model, "best.json")   # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "apply": "loka_tune.applier",
    "export": "loka_tune.applier",
    "load_config": "loka_tune.applier",
    "GemmChoice": "loka_tune.config",
    "SitePrecision": "loka_tune.config",
    "PrecisionConfig": "loka_tune.config",
    "ModsConfig": "loka_tune.config",
    "Format": "loka_tune.config",
    "Granularity": "loka_tune.config",
    "GemmRole": "loka_tune.config",
    "LokaLinear": "loka_tune.kernels.linear",
    "build_model": "loka_tune.models",
    "Probe": "loka_tune.probe",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'loka_tune' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
