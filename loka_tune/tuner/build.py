"""Building blocks of a study's runs: its data source, a fresh model, the trainer's config, the device.

Every trial starts from :func:`trial_model`: a fresh model under the training seed (the
baseline's init), on the study's device, with the trial's precision config applied.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from loka_tune.config import PrecisionConfig
from loka_tune.errors import ConfigError
from loka_tune.tuner.study import StudyConfig

if TYPE_CHECKING:
    from loka_tune.objectives.trainer import OnStep, TrainConfig, TrainResult

__all__ = ["import_function", "make_source", "make_model", "train_config", "resolve_device", "speed_source",
           "trial_model"]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def import_function(spec: str, *, key: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function, with errors naming ``key`` and the fix."""
    mod_name, _, fn_name = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"cannot import module {mod_name!r} of {spec!r} ({e}); is it on PYTHONPATH?",
                          key=key) from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"module {mod_name!r} has no function {fn_name!r} (from {spec!r})", key=key)
    return fn


def make_source(cfg: StudyConfig) -> Any:
    """The study's data source (``[data]``)."""
    from loka_tune.data import parse_data_spec

    src = parse_data_spec(cfg.data.source, **dict(cfg.data.params))
    for attr in ("num_dense", "cardinalities", "batches"):
        if not hasattr(src, attr):
            raise ConfigError(f"the data source {cfg.data.source!r} has no {attr!r}: a data source has"
                              " num_dense, cardinalities and batches(split, batch_size, seed, device)",
                              key="data.source")
    return src


def make_model(cfg: StudyConfig, source: Any, *, seed: int | None = None) -> nn.Module:
    """A fresh model of the study, initialized under ``seed`` (default: the training seed)."""
    torch.manual_seed(cfg.training.seed if seed is None else seed)
    kw: dict[str, Any] = {"num_dense": int(source.num_dense), "cardinalities": list(source.cardinalities)}
    if cfg.model.is_function:
        fn = import_function(cfg.model.name, key="model.name")
        model = fn(**kw, **dict(cfg.model.overrides))
    else:
        from loka_tune.models import build_model

        try:
            model = build_model(cfg.model.name, cfg.model.preset, **kw, base_rate=getattr(source, "base_rate", None),
                                **dict(cfg.model.overrides))
        except ConfigError as e:
            raise ConfigError(str(e), key=f"model.overrides.{e.key}" if e.key not in (None, "model", "preset")
                              else "model.name") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{cfg.model.name!r} returned {type(model).__name__}, not an nn.Module", key="model.name")
    return model


def train_config(cfg: StudyConfig, seed: int | None = None, *, device: str | None = None) -> TrainConfig:
    """The trainer's :class:`TrainConfig` for one short run of the study."""
    return cfg.training.to_train_config(seed, device=device)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def speed_source(cfg: StudyConfig, device: str) -> str:
    """"measured" or "modeled": the study's ``objective.speed``, "auto" meaning measured on CUDA."""
    s = cfg.objective.speed
    if s == "auto":
        return "measured" if device.startswith("cuda") else "modeled"
    if s == "measured" and not device.startswith("cuda"):
        warnings.warn("objective.speed = 'measured' on a CPU times the emulated FP8 kernels, which says"
                      " nothing about a GPU; use 'modeled' (or 'auto') on a CPU", stacklevel=2)
    return s


def trial_model(cfg: StudyConfig, source: Any, config: PrecisionConfig, *,
                device: str = "cpu") -> tuple[nn.Module, Any]:
    """A fresh model (same init seed as the baseline) on ``device`` with ``config`` applied
    (on that device: GPU-only kernels accept only CUDA layers); returns it and the summary."""
    from loka_tune.applier import apply

    model = make_model(cfg, source).to(resolve_device(device))
    summary = apply(model, config)
    return model, summary


def _first_batch(source: Any, cfg: StudyConfig, device: str = "cpu", *, max_rows: int | None = None) -> Any:
    bs = cfg.training.batch_size if max_rows is None else min(max_rows, cfg.training.batch_size)
    return next(iter(source.batches("train", bs, seed=cfg.training.seed, device=device)))


def _train(model: nn.Module, source: Any, tcfg: TrainConfig, on_step: OnStep | None = None) -> TrainResult:
    from loka_tune.objectives.trainer import train

    return train(model, source, tcfg, on_step=on_step, progress=False)
