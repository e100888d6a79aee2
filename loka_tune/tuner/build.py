"""Building blocks of a study's runs: its data source, a fresh model, the trainer's config, the device.

Every trial starts from :func:`trial_model`: a fresh model under the training seed (the
baseline's init), on the study's device, with the trial's precision config applied.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from loka_tune._io import cwd_importable
from loka_tune.config import PrecisionConfig
from loka_tune.errors import ConfigError
from loka_tune.tuner.study import StudyConfig

if TYPE_CHECKING:
    from loka_tune.objectives.trainer import OnStep, TrainConfig, TrainResult

__all__ = ["import_function", "call_model_factory", "make_source", "make_model", "meta_model", "train_config", "resolve_device", "speed_source",
           "trial_model", "first_batch", "run_train"]


def import_function(spec: str, *, key: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function, with errors naming ``key`` and the fix. The
    working directory is searched too (after the installed packages)."""
    mod_name, _, fn_name = spec.partition(":")
    cwd_importable()
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"cannot import module {mod_name!r} of {spec!r} ({e}); run from the folder that holds"
                          " it or put that folder on PYTHONPATH", key=key) from None
    fn: object = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"module {mod_name!r} has no function {fn_name!r} (from {spec!r})", key=key)
    return fn


#: the model factory's calling convention, quoted by every error about it
FACTORY_CONVENTION = ("a model factory is called as function(num_dense=int, cardinalities=list[int], **overrides)"
                      " and returns an nn.Module whose forward(dense, sparse) takes (B, num_dense) float and"
                      " (B, len(cardinalities)) int64 tensors and returns (B,) logits")
_DENSE_NAMES = ("num_dense", "n_dense", "dense_dim", "num_dense_features", "n_dense_features", "dense_features",
                "dense_in", "in_dense")
_CARD_NAMES = ("cardinalities", "cards", "cardinality", "table_sizes", "vocab_sizes", "num_embeddings",
               "embedding_sizes", "sparse_cardinalities")


def _factory_kwargs(fn: Callable[..., Any], spec: str, num_dense: int, cardinalities: list[int],
                    overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments to call ``fn`` with: ``num_dense`` and ``cardinalities`` under the
    names its signature uses for them (``n_dense``, ``table_sizes``, ...), then ``overrides``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C function: no signature to read
        return {"num_dense": num_dense, "cardinalities": cardinalities, **overrides}
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items()
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]

    dense = next((n for n in _DENSE_NAMES if n in named), "num_dense" if var_kw else None)
    cards = next((n for n in _CARD_NAMES if n in named), "cardinalities" if var_kw else None)
    if dense is None or cards is None:
        raise ConfigError(f"{spec}{inspect.signature(fn)} takes no {'num_dense' if dense is None else 'cardinalities'}"
                          f" parameter: {FACTORY_CONVENTION}", key="model.name")
    unknown = [k for k in overrides if k not in named and not var_kw]
    if unknown:
        raise ConfigError(f"{spec}{inspect.signature(fn)} takes no parameter {unknown[0]!r}; [model.overrides]"
                          f" are passed as keyword arguments: {FACTORY_CONVENTION}", key=f"model.overrides.{unknown[0]}")
    return {dense: num_dense, cards: cardinalities, **overrides}


def _check_forward(model: nn.Module, spec: str) -> None:
    """``model.forward`` takes ``(dense, sparse)``: two positional arguments."""
    try:
        inspect.signature(model.forward).bind(None, None)
    except TypeError:
        raise ConfigError(f"{spec} returned a {type(model).__name__} whose forward{inspect.signature(model.forward)}"
                          f" does not take (dense, sparse): {FACTORY_CONVENTION}", key="model.name") from None
    except ValueError:  # no signature to read: let the first batch tell
        pass


def _short(v: Any) -> str:
    if isinstance(v, list) and len(v) > 4:
        return f"[{', '.join(map(repr, v[:3]))}, ... ({len(v)} items)]"
    return f"{v!r:.60}"


def call_model_factory(spec: str, num_dense: int, cardinalities: list[int], overrides: Mapping[str, Any],
                       *, key: str = "model.name") -> nn.Module:
    """Build a user's model from ``"package.module:function"``: the function called by its
    signature (:data:`FACTORY_CONVENTION`), its result checked. Every failure is one
    :class:`ConfigError` line naming the factory and the convention."""
    fn = import_function(spec, key=key)
    kw = _factory_kwargs(fn, spec, num_dense, cardinalities, overrides)
    try:
        model = fn(**kw)
    except Exception as e:  # the user's code: one line, not a traceback through the tuner
        shown = ", ".join(f"{k}={_short(v)}" for k, v in kw.items())
        raise ConfigError(f"{spec}({shown}) raised {type(e).__name__}: {e}. Call it so yourself to debug it;"
                          f" {FACTORY_CONVENTION}", key=key) from e
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{spec!r} returned {type(model).__name__}, not an nn.Module: {FACTORY_CONVENTION}",
                          key=key)
    _check_forward(model, spec)
    return model


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


#: fresh built-in models kept per (model settings, data shape, seed), with the CPU generator's
#: state after their build: :func:`make_model` returns a copy of one instead of building it
#: again (every baseline, twin, trial and confirmation run starts from one; the large Wukong's
#: 279M parameters took 3.4 s to build and 1.2 s to copy on a 2-core CPU, and the H200 study's
#: site discovery, which builds one, went from 2.0 to 0.2 s)
_PRISTINE: OrderedDict[tuple[Any, ...], tuple[nn.Module, torch.Tensor]] = OrderedDict()
PRISTINE_MODELS = 2  # the seeds a study uses: its training seed and the confirmation's second
PRISTINE_MAX_BYTES = 4 << 30  # larger models are built every time (a copy would double their host memory)


def _pristine_key(cfg: StudyConfig, source: Any, seed: int) -> tuple[Any, ...] | None:
    if cfg.model.is_function:  # a user's factory may read state of its own: always call it
        return None
    return (cfg.model.name, cfg.model.preset, repr(sorted(dict(cfg.model.overrides).items())), int(source.num_dense),
            tuple(int(c) for c in source.cardinalities), getattr(source, "base_rate", None), int(seed))


def make_model(cfg: StudyConfig, source: Any, *, seed: int | None = None) -> nn.Module:
    """A fresh model of the study, initialized under ``seed`` (default: the training seed).

    A built-in model is built once per seed and copied after that (:data:`PRISTINE_MODELS`): the
    copy has the same weights, and the global random state is left as the build leaves it."""
    s = cfg.training.seed if seed is None else seed
    key = _pristine_key(cfg, source, s)
    if key is not None and key in _PRISTINE:
        _PRISTINE.move_to_end(key)
        kept, rng = _PRISTINE[key]
        torch.manual_seed(s)  # every generator as the build's seeding leaves it (the build draws on the CPU's only)
        torch.set_rng_state(rng)
        return copy.deepcopy(kept)
    model = _build_model(cfg, source, s)
    if key is not None and sum(t.numel() * t.element_size() for t in model.state_dict().values()) <= PRISTINE_MAX_BYTES:
        _PRISTINE[key] = (copy.deepcopy(model), torch.get_rng_state())
        while len(_PRISTINE) > PRISTINE_MODELS:
            _PRISTINE.popitem(last=False)
    return model


def meta_model(cfg: StudyConfig, source: Any) -> nn.Module:
    """The study's model built on the ``meta`` device: its structure, without memory or kernels
    (what :func:`loka_tune.apply` makes of a config, at no cost: :mod:`loka_tune.tuner.runkey`).
    Every random generator is left as it was (the build seeds them)."""
    with torch.random.fork_rng(), torch.device("meta"):
        return _build_model(cfg, source, cfg.training.seed)


def _build_model(cfg: StudyConfig, source: Any, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    kw: dict[str, Any] = {"num_dense": int(source.num_dense), "cardinalities": list(source.cardinalities)}
    if cfg.model.is_function:
        try:
            return call_model_factory(cfg.model.name, kw["num_dense"], kw["cardinalities"], cfg.model.overrides)
        except ConfigError as e:
            raise (e if cfg.source_path is None else e.in_file(cfg.source_path)) from e.__cause__
    from loka_tune.models import build_model

    try:
        model = build_model(cfg.model.name, cfg.model.preset, **kw, base_rate=getattr(source, "base_rate", None),
                            **dict(cfg.model.overrides))  # the head's bias starts at logit(base rate)
    except ConfigError as e:
        raise ConfigError(e.message, key=f"model.overrides.{e.key}" if e.key not in (None, "model", "preset")
                          else "model.name") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{cfg.model.name!r} returned {type(model).__name__}, not an nn.Module", key="model.name")
    return model


def train_config(cfg: StudyConfig, seed: int | None = None, *, device: str | None = None) -> TrainConfig:
    """The trainer's :class:`TrainConfig` for one short run of the study, in its production
    ``[regime]`` (compile, CUDA graphs, batch size, autocast: :mod:`loka_tune.tuner.regime`)."""
    tcfg = cfg.training.to_train_config(seed, device=device)
    return cfg.regime.apply(tcfg, resolve_device(tcfg.device))


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


def first_batch(source: Any, cfg: StudyConfig, device: str = "cpu", *, max_rows: int | None = None) -> Any:
    """The study's first training batch (its batch size, at most ``max_rows`` rows, its training seed)."""
    bs = cfg.batch_size if max_rows is None else min(max_rows, cfg.batch_size)
    return next(iter(source.batches("train", bs, seed=cfg.training.seed, device=device)))


def run_train(model: nn.Module, source: Any, tcfg: TrainConfig, on_step: OnStep | None = None,
              after_step: Callable[[int], None] | None = None,
              progress: Callable[[int, float], None] | bool = False,
              on_batch: Callable[[int, Any], None] | None = None) -> TrainResult:
    """``train()`` of one run of this process (compiled runs: a fresh dynamo, strict)."""
    from loka_tune.objectives.trainer import train

    if not tcfg.compile:
        return train(model, source, tcfg, on_step=on_step, progress=progress, after_step=after_step,
                     on_batch=on_batch)
    from loka_tune.objectives.compiled import strict_compile

    with strict_compile():  # a fresh dynamo per run (inductor's disk cache stays), no silent eager fallback
        return train(model, source, tcfg, on_step=on_step, progress=progress, after_step=after_step,
                     on_batch=on_batch)
