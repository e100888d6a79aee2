"""Reference large recommendation models in plain torch: DLRM, DCNv2, Wukong, Interformer.

Models know nothing of FP8: every weight GEMM is an ``nn.Linear`` that precision configs
swap later. Build one with :func:`build_model`; presets ``tiny`` / ``paper`` / ``large``
give the architecture, the caller gives the input spec:

>>> from loka_tune.models import build_model
>>> model = build_model("wukong", "tiny", num_dense=13, cardinalities=[1000] * 26)
>>> model.prediction_head
'head'

Importing this package is cheap: the model modules load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loka_tune._lazy import lazy_module
from loka_tune.models.registry import (
    MODEL_NAMES,
    PRESETS,
    ModelSpec,
    build_model,
    model_names,
    preset_config,
    register_model,
)

if TYPE_CHECKING:  # the real objects behind the lazy names, for type checkers; never run
    from loka_tune.models.base import RecModel as RecModel
    from loka_tune.models.dcnv2 import DCNv2 as DCNv2
    from loka_tune.models.dlrm import DLRM as DLRM
    from loka_tune.models.interformer import Interformer as Interformer
    from loka_tune.models.wukong import Wukong as Wukong

__all__ = [
    "MODEL_NAMES",
    "PRESETS",
    "ModelSpec",
    "build_model",
    "model_names",
    "preset_config",
    "register_model",
    "RecModel",
    "DLRM",
    "DCNv2",
    "Wukong",
    "Interformer",
]

_LAZY = {
    "RecModel": "loka_tune.models.base",
    "DLRM": "loka_tune.models.dlrm",
    "DCNv2": "loka_tune.models.dcnv2",
    "Wukong": "loka_tune.models.wukong",
    "Interformer": "loka_tune.models.interformer",
}


__getattr__, __dir__ = lazy_module(__name__, _LAZY)
