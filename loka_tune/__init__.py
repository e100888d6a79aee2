"""loka-tune: autotuning FP8 precision configurations for large recommendation models.

The top-level API is imported lazily so that ``import loka_tune`` is fast and never touches
CUDA, triton, fbgemm, torchao or mlflow:

>>> import loka_tune
>>> summary = loka_tune.apply(model, "best.json")   # doctest: +SKIP
"""

from __future__ import annotations

from loka_tune._lazy import lazy_module

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


__getattr__, __dir__ = lazy_module(__name__, _LAZY)
