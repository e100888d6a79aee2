"""The model registry and the presets of the built-in models.

A preset is a plain dict of architecture hyperparameters and options (norm, activation,
bias, ...); the caller always gives the input spec (``num_dense``, ``cardinalities``).
``build_model(name, preset, num_dense=..., cardinalities=..., **overrides)`` merges the
overrides into the preset and calls the registered factory. Built-in factories import their
module only when called, so importing this module stays cheap.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from loka_tune.errors import ConfigError

__all__ = [
    "MODEL_NAMES",
    "PRESETS",
    "ModelSpec",
    "register_model",
    "build_model",
    "preset_config",
    "model_names",
]

MODEL_NAMES = ("dlrm", "dcnv2", "wukong", "interformer")  # the built-in models
PRESETS = ("tiny", "paper", "large")  # the built-in presets of every built-in model

# tiny: CPU tests train in seconds (widths 8-32, one or two layers).
# paper: the public configurations.
# large: production-like widths (hidden 2048-4096, embedding dim 256, for 40+ sparse
#   features) so that many GEMMs are big enough for FP8 to pay off; LayerNorm + SiLU as in
#   production LRMs, so that every Mods pass (No Bias, BlockNorm, Hard Swish) has work to do.
_BUILTIN_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "dlrm": {
        "tiny": dict(
            embedding_dim=8,  # small tables, fast CPU tests
            bottom_mlp=(32,),  # then -> embedding_dim
            top_mlp=(32,),
            norm="none",  # DLRM has no normalization
            activation="relu",
            bias=True,
        ),
        "paper": dict(
            embedding_dim=16,  # Criteo Kaggle config of the DLRM reference code
            bottom_mlp=(512, 256, 64),  # 13-512-256-64-16 with the appended -> 16
            top_mlp=(512, 256),  # 512-256-1 with the appended head
            norm="none",
            activation="relu",
            bias=True,
        ),
        "large": dict(
            embedding_dim=256,  # production-like embedding width
            bottom_mlp=(2048, 1024, 512),  # then -> 256
            top_mlp=(4096, 4096, 2048, 1024),  # input 256 + (n+1)n/2: 1076 at 40 features
            norm="layernorm",
            activation="silu",
            bias=True,
        ),
    },
    "dcnv2": {
        "tiny": dict(
            embedding_dim=8,
            dense_mlp=(),  # a single linear dense projection
            num_cross_layers=2,
            low_rank=None,  # full-rank W: D is tiny
            deep_mlp=(32,),
            structure="stacked",
            norm="none",  # DCN-V2 has no normalization
            activation="relu",
            bias=True,
        ),
        "paper": dict(
            # the public DLRM-DCNv2 config (MLPerf Training DLRMv2 / torchrec example)
            embedding_dim=128,
            dense_mlp=(512, 256),  # 13-512-256-128
            num_cross_layers=3,
            low_rank=512,
            deep_mlp=(1024, 1024, 512, 256),  # then -> 1
            structure="stacked",
            norm="none",
            activation="relu",
            bias=True,
        ),
        "large": dict(
            embedding_dim=256,  # D = (n+1) 256: 10496 at 40 features
            dense_mlp=(2048, 1024),
            num_cross_layers=4,
            low_rank=1024,  # D x 1024 and 1024 x D GEMMs
            deep_mlp=(4096, 4096, 2048, 1024),
            structure="stacked",
            norm="layernorm",
            activation="silu",
            bias=True,
        ),
    },
    "wukong": {
        "tiny": dict(
            embedding_dim=8,
            num_layers=2,
            num_fmb=4,
            num_lcb=4,
            fmb_rank=4,
            fmb_mlp=(32,),
            dense_mlp=(32,),
            dense_embeddings=1,
            head_mlp=(32,),
            norm="layernorm",  # Wukong normalizes each layer's output
            activation="relu",
            bias=True,
        ),
        "paper": dict(
            # the public config: 3 layers, d=128, nF=nL=16, k=24, MLPs 2x512
            embedding_dim=128,
            num_layers=3,
            num_fmb=16,
            num_lcb=16,
            fmb_rank=24,
            fmb_mlp=(512, 512),
            dense_mlp=(512, 512),
            dense_embeddings=1,  # our choice: the 13 Criteo dense features -> one row
            head_mlp=(512, 512),
            norm="layernorm",
            activation="relu",
            bias=True,
        ),
        "large": dict(
            embedding_dim=256,
            num_layers=4,
            num_fmb=32,
            num_lcb=32,
            fmb_rank=32,  # FMB input n*k: 1408 at 40 sparse + 4 dense rows, 2048 after
            fmb_mlp=(2048, 2048),  # then -> nF d = 8192
            dense_mlp=(2048, 2048),
            dense_embeddings=4,  # dense features get several rows in production models
            head_mlp=(4096, 2048),  # input (nF + nL) d = 16384
            norm="layernorm",
            activation="silu",
            bias=True,
        ),
    },
    "interformer": {
        "tiny": dict(
            embedding_dim=8,
            num_layers=2,
            num_heads=2,  # head width 4 (even, for the rotary embedding)
            num_cls=2,
            num_pma=2,
            num_recent=2,
            x_summary=4,
            pffn_rank=8,
            seq_ffn=(16,),
            interaction_mlp=(32,),
            dense_mlp=(16,),
            dense_embeddings=1,
            head_mlp=(32,),
            seq_feature=0,
            norm="layernorm",  # a Transformer's residual streams are normalized
            activation="relu",
            bias=True,
        ),
        "paper": dict(
            # the public-benchmark scale of the paper (Amazon / TaobaoAd / KuaiVideo runs: small
            # tokens, a few layers and summary tokens); the authors' code is not public, so the
            # widths below are our reading, not a copy of theirs
            embedding_dim=32,
            num_layers=3,
            num_heads=2,
            num_cls=4,
            num_pma=2,
            num_recent=2,
            x_summary=4,
            pffn_rank=32,
            seq_ffn=(128,),  # 4 d, the usual Transformer FFN ratio
            interaction_mlp=(256, 256),
            dense_mlp=(256,),
            dense_embeddings=1,
            head_mlp=(256, 128),
            seq_feature=0,
            norm="layernorm",
            activation="relu",
            bias=True,
        ),
        "large": dict(
            embedding_dim=256,  # 3-D GEMMs of (B T) x 256 x 256..1024 in the sequence arch
            num_layers=3,
            num_heads=4,
            num_cls=8,
            num_pma=8,
            num_recent=8,  # N = n + 24 rows in the interaction: 68 at 40 sparse + 4 dense rows
            x_summary=8,  # k d = 2048: the generated PFFN weight is 2048 x 256 r
            pffn_rank=32,
            seq_ffn=(1024,),
            interaction_mlp=(2048, 2048),  # input N d + N(N-1)/2: ~19.7k at 40 sparse + 4 dense rows
            dense_mlp=(2048, 2048),
            dense_embeddings=4,
            head_mlp=(4096, 2048),  # input 40 x 256 = 10240
            seq_feature=0,
            norm="layernorm",
            activation="silu",
            bias=True,
        ),
    },
}


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: its factory and its presets (preset name -> hyperparameters)."""

    name: str
    factory: Callable[..., Any]
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    open_presets: bool = False  # True: any preset name of PRESETS, all meaning "no hyperparameters"


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(
    name: str,
    *,
    presets: Mapping[str, Mapping[str, Any]] | None = None,
    overwrite: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator registering ``factory(*, num_dense, cardinalities, **hparams) -> nn.Module``.

    ``presets`` maps preset names to hyperparameter dicts; without it the model accepts each
    name of :data:`PRESETS` as an empty preset and every keyword its factory takes as an
    override. ``overwrite=True`` replaces an existing registration (else ``ConfigError``).

    >>> @register_model("mymodel")          # doctest: +SKIP
    ... def mymodel(*, num_dense, cardinalities, width=64): ...
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a model name must be a non-empty string, got {name!r}", key="model")

    def decorator(factory: Callable[..., Any]) -> Callable[..., Any]:
        if name in _REGISTRY and not overwrite:
            raise ConfigError(
                f"model {name!r} is already registered: pick another name or pass overwrite=True",
                key="model",
            )
        if presets is None:
            spec = ModelSpec(name, factory, {p: {} for p in PRESETS}, open_presets=True)
        else:
            spec = ModelSpec(name, factory, {p: dict(h) for p, h in presets.items()})
        _REGISTRY[name] = spec
        return factory

    return decorator


def model_names() -> tuple[str, ...]:
    """Every registered model name, built-ins first."""
    return tuple(_REGISTRY)


def _spec(name: str) -> ModelSpec:
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ConfigError(
            f"unknown model {name!r}: choose one of {', '.join(_REGISTRY)} "
            "(or register your own with register_model)",
            key="model",
        )
    return spec


def preset_config(name: str, preset: str) -> dict[str, Any]:
    """A copy of the hyperparameters of ``preset`` of model ``name`` (edit it freely)."""
    spec = _spec(name)
    if preset not in spec.presets:
        raise ConfigError(
            f"unknown preset {preset!r} for model {name!r}: choose one of {', '.join(spec.presets)}",
            key="preset",
        )
    return copy.deepcopy(dict(spec.presets[preset]))


def _allowed_overrides(spec: ModelSpec, preset_keys: Sequence[str]) -> set[str] | None:
    """Override keys a model accepts (``None``: any, the factory takes ``**kwargs``)."""
    if not spec.open_presets:
        return set(preset_keys)
    params = inspect.signature(spec.factory).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {
        p.name for p in params
        if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    } - {"num_dense", "cardinalities"}


def build_model(
    name: str,
    preset: str = "tiny",
    *,
    num_dense: int,
    cardinalities: Sequence[int],
    base_rate: float | None = None,
    **overrides: Any,
) -> Any:
    """Build model ``name`` from ``preset``, with ``overrides`` replacing preset entries.

    ``base_rate``: the training data's click rate (a data source's ``base_rate``); when given,
    the prediction head's bias starts at ``logit(base_rate)`` (:meth:`RecModel.init_output_bias`),
    so that the model starts at the base rate. The trainer's callers pass it (``loka-tune
    train``/``probe``, every study run); None leaves the head's default init.

    Raises :class:`ConfigError` for an unknown name, preset or override key (listing the valid
    choices) and for invalid values. Parameter init is deterministic under
    ``torch.manual_seed`` (the bias init draws no random numbers).
    """
    from loka_tune.models.base import check_inputs_spec

    hparams = preset_config(name, preset)
    spec = _REGISTRY[name]
    num_dense, cards = check_inputs_spec(num_dense, cardinalities)
    allowed = _allowed_overrides(spec, list(hparams))
    for key in overrides:
        if allowed is not None and key not in allowed:
            raise ConfigError(
                f"unknown option {key!r} for model {name!r}: choose among {', '.join(sorted(allowed))}",
                key=key,
            )
    hparams.update(overrides)
    model = spec.factory(num_dense=num_dense, cardinalities=list(cards), **hparams)
    if base_rate is not None and hasattr(model, "init_output_bias"):
        model.init_output_bias(base_rate)
    return model


# ---- built-ins: the factories import their module on first use ------------------------------


def _dlrm(*, num_dense: int, cardinalities: Sequence[int], **hparams: Any) -> Any:
    from loka_tune.models.dlrm import DLRM

    return DLRM(num_dense, cardinalities, **hparams)


def _dcnv2(*, num_dense: int, cardinalities: Sequence[int], **hparams: Any) -> Any:
    from loka_tune.models.dcnv2 import DCNv2

    return DCNv2(num_dense, cardinalities, **hparams)


def _wukong(*, num_dense: int, cardinalities: Sequence[int], **hparams: Any) -> Any:
    from loka_tune.models.wukong import Wukong

    return Wukong(num_dense, cardinalities, **hparams)


def _interformer(*, num_dense: int, cardinalities: Sequence[int], **hparams: Any) -> Any:
    from loka_tune.models.interformer import Interformer

    return Interformer(num_dense, cardinalities, **hparams)


for _name, _factory in (("dlrm", _dlrm), ("dcnv2", _dcnv2), ("wukong", _wukong), ("interformer", _interformer)):
    register_model(_name, presets=_BUILTIN_PRESETS[_name])(_factory)
