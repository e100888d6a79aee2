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
