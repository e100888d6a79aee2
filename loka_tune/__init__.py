"""loka-tune: autotuning FP8 precision configurations for large recommendation models.

The workflow, in order (every name is imported lazily: ``import loka_tune`` is fast and never
touches CUDA, triton, fbgemm, torchao or mlflow):

>>> import loka_tune
>>> study = loka_tune.run_study(loka_tune.load_study("study.toml"))     # doctest: +SKIP
>>> loka_tune.export_best(study, "best.json")                         # doctest: +SKIP
>>> summary = loka_tune.apply(model, "best.json")                     # doctest: +SKIP

Or without a study, a named recipe: ``loka_tune.apply(model,
loka_tune.PrecisionConfig.from_recipe("rowwise"))`` (or ``loka_tune.recipe_config("dispatch",
report=probe_report)``: LoKA's per-GEMM plan).

What is public is listed in ``__all__`` below. Everything else (modules, their helpers, any
name with a leading underscore) is internal and may change between releases; the
sub-packages' ``__all__`` lists say what a user of each one calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loka_tune._lazy import lazy_module
from loka_tune.version import __version__ as __version__

if TYPE_CHECKING:
    # What a type checker reads: the real objects behind the lazy names below (the ``as``
    # form marks each as re-exported). Never run, so ``import loka_tune`` stays light.
    from loka_tune.applier import apply as apply
    from loka_tune.applier import export as export
    from loka_tune.applier import load_config as load_config
    from loka_tune.config import Format as Format
    from loka_tune.config import GemmChoice as GemmChoice
    from loka_tune.config import GemmRole as GemmRole
    from loka_tune.config import Granularity as Granularity
    from loka_tune.config import ModsConfig as ModsConfig
    from loka_tune.config import PrecisionConfig as PrecisionConfig
    from loka_tune.config import ServingPlan as ServingPlan
    from loka_tune.config import SitePrecision as SitePrecision
    from loka_tune.dispatch import build_plan as build_plan
    from loka_tune.dispatch import recipe_config as recipe_config
    from loka_tune.errors import BackendError as BackendError
    from loka_tune.errors import ConfigError as ConfigError
    from loka_tune.errors import DataError as DataError
    from loka_tune.errors import LokaError as LokaError
    from loka_tune.errors import ModError as ModError
    from loka_tune.errors import ProbeError as ProbeError
    from loka_tune.errors import ServingError as ServingError
    from loka_tune.errors import StudyError as StudyError
    from loka_tune.errors import UnsupportedChoiceError as UnsupportedChoiceError
    from loka_tune.kernels.linear import LokaLinear as LokaLinear
    from loka_tune.kernels.serving import ServingLinear as ServingLinear
    from loka_tune.models.registry import build_model as build_model
    from loka_tune.objectives.trainer import TrainConfig as TrainConfig
    from loka_tune.objectives.trainer import train as train
    from loka_tune.probe.collector import Probe as Probe
    from loka_tune.probe.measure import measure as measure
    from loka_tune.serving import plan_serving as plan_serving
    from loka_tune.serving import serve_buckets as serve_buckets
    from loka_tune.tuner.loop import run_study as run_study
    from loka_tune.tuner.results import export_best as export_best
    from loka_tune.tuner.study import StudyConfig as StudyConfig
    from loka_tune.tuner.study import load_study as load_study

# public name -> module that defines it
_LAZY = {
    # configuration: what a precision choice is, per GEMM, per layer, per model; the study file
    "PrecisionConfig": "loka_tune.config",
    "SitePrecision": "loka_tune.config",
    "GemmChoice": "loka_tune.config",
    "ModsConfig": "loka_tune.config",
    "Format": "loka_tune.config",
    "Granularity": "loka_tune.config",
    "GemmRole": "loka_tune.config",
    "ServingPlan": "loka_tune.config",
    "StudyConfig": "loka_tune.tuner.study",
    # the workflow: a study file in, the fastest feasible config out, applied to your model
    "load_study": "loka_tune.tuner.study",
    "run_study": "loka_tune.tuner.loop",
    "export_best": "loka_tune.tuner.results",
    "load_config": "loka_tune.applier",
    "apply": "loka_tune.applier",
    "export": "loka_tune.applier",
    # serving: apply(model, config, serving=True, batch=B) with a plan priced per batch bucket
    "plan_serving": "loka_tune.serving",
    "serve_buckets": "loka_tune.serving",
    # the method's pieces, for your own loop: probe, measure, dispatch; models, training
    "Probe": "loka_tune.probe.collector",
    "measure": "loka_tune.probe.measure",
    "build_plan": "loka_tune.dispatch",
    "recipe_config": "loka_tune.dispatch",
    "build_model": "loka_tune.models.registry",
    "TrainConfig": "loka_tune.objectives.trainer",
    "train": "loka_tune.objectives.trainer",
    # types: what apply puts in place of an nn.Linear (for training; for serving)
    "LokaLinear": "loka_tune.kernels.linear",
    "ServingLinear": "loka_tune.kernels.serving",
    # errors: every error loka-tune raises on purpose derives from LokaError
    "LokaError": "loka_tune.errors",
    "ConfigError": "loka_tune.errors",
    "DataError": "loka_tune.errors",
    "BackendError": "loka_tune.errors",
    "UnsupportedChoiceError": "loka_tune.errors",
    "ProbeError": "loka_tune.errors",
    "StudyError": "loka_tune.errors",
    "ModError": "loka_tune.errors",
    "ServingError": "loka_tune.errors",
}

__all__ = ["__version__", *_LAZY]


__getattr__, __dir__ = lazy_module(__name__, _LAZY)
