"""Data sources: synthetic CTR data with realistic distributions, Criteo, Avazu and Amazon files.

Every source yields :class:`Batch` (dense float32 (B, num_dense), sparse int64
(B, num_sparse), labels float32 (B,), and behaviour sequences ``seq`` / ``seq_mask`` (B, L)
where the data has them: ``synthetic:seq_len=32``, ``amazon:PATH``) through
``batches(split, batch_size, seed, device)``; see :class:`DataSource` and
:func:`model_inputs`. :func:`parse_data_spec` builds one from a string such as
``"synthetic"``, ``"synthetic:base_rate=0.1,num_sparse=8,cardinality=1000"``,
``"criteo:/data/train.txt"``, ``"avazu:/data/train.gz?eval_fraction=0.1"``,
``"amazon:/data/local_train_splitByUser?seq_len=50"`` or
``"my_pkg.my_module:make_source"``.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any, Callable

from ..errors import ConfigError
from .amazon import AmazonSource
from .avazu import AvazuSource
from .base import Batch, DataSource, model_inputs
from .criteo import CriteoSource
from .files import FileSource
from .hashing import mix_seed, split_uniform, stable_id
from .synthetic import DEFAULT_CARDINALITIES, SyntheticCTR, synthetic_for

__all__ = [
    "Batch",
    "DataSource",
    "SyntheticCTR",
    "synthetic_for",
    "DEFAULT_CARDINALITIES",
    "CriteoSource",
    "AvazuSource",
    "AmazonSource",
    "model_inputs",
    "FileSource",
    "stable_id",
    "mix_seed",
    "split_uniform",
    "parse_data_spec",
    "SPEC_FORMS",
]

SPEC_FORMS = (
    "'synthetic', 'synthetic:key=value,...' (keys: the SyntheticCTR arguments, plus "
    "num_sparse and cardinality for equal-size features; lists as 1000/2000/...), "
    "'criteo:PATH', 'avazu:PATH', 'amazon:PATH' (options as 'PATH?key=value,...'), or "
    "'package.module:function' (a function returning a DataSource)"
)
_FACTORY = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


def parse_data_spec(spec: str, **kw: Any) -> DataSource:
    """Build the data source a spec string names (forms: :data:`SPEC_FORMS`).

    ``kw`` are extra constructor arguments (e.g. ``eval_fraction=0.2``); options written in
    the spec win over ``kw``. Raises :class:`~loka_tune.errors.ConfigError` for a malformed
    spec, naming it and the accepted forms; file problems raise ``DataError``.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"empty data spec {spec!r}; accepted forms: {SPEC_FORMS}", key="data")
    spec = spec.strip()
    head, sep, rest = spec.partition(":")
    if head == "synthetic":
        opts = {**kw, **_options(rest, spec)} if sep else dict(kw)
        return _build_synthetic(opts, spec)
    if head in ("criteo", "avazu", "amazon"):
        path, _, opt_text = rest.rpartition("?") if "?" in rest else (rest, "", "")
        if not path:
            raise ConfigError(
                f"data spec {spec!r} has no file path; write '{head}:PATH'; accepted forms: {SPEC_FORMS}",
                key="data",
            )
        cls = {"criteo": CriteoSource, "avazu": AvazuSource, "amazon": AmazonSource}[head]
        opts = {**kw, **_options(opt_text, spec)}
        return _call(cls, opts, spec, path)
    if _FACTORY.match(spec):
        return _user_factory(head, rest, kw, spec)
    raise ConfigError(f"unknown data spec {spec!r}; accepted forms: {SPEC_FORMS}", key="data")


def _options(text: str, spec: str) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(
                f"option {item!r} in data spec {spec!r} is not key=value; accepted forms: {SPEC_FORMS}",
                key="data",
            )
        opts[key.strip()] = _value(value.strip())
    return opts


def _value(text: str) -> Any:
    """'12' -> 12, '0.5' -> 0.5, 'true'/'false'/'none', '10/20/30' -> (10, 20, 30), else text."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    if "/" in text:
        parts = [_value(p) for p in text.split("/")]
        if all(isinstance(p, int) for p in parts):
            return tuple(parts)
        return text
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def _build_synthetic(opts: dict[str, Any], spec: str) -> SyntheticCTR:
    if "num_sparse" in opts or "cardinality" in opts:
        if "cardinalities" in opts:
            raise ConfigError(
                f"data spec {spec!r}: give either cardinalities or num_sparse/cardinality, not both",
                key="data",
            )
        num_sparse = opts.pop("num_sparse", 26)
        cardinality = opts.pop("cardinality", 100_000)
        return _call(synthetic_for, opts, spec, num_sparse, cardinality)
    return _call(SyntheticCTR, opts, spec)


def _call(fn: Callable[..., Any], opts: dict[str, Any], spec: str, *args: Any) -> Any:
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    accepted = sorted(n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY
                      or (p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and n != "path"))
    if fn is synthetic_for:  # its **kwargs go to SyntheticCTR
        accepted = sorted(set(accepted) | set(inspect.signature(SyntheticCTR).parameters) - {"cardinalities"})
        takes_any = False
    unknown = sorted(set(opts) - set(accepted)) if not takes_any else []
    if unknown:
        raise ConfigError(
            f"data spec {spec!r}: unknown option(s) {unknown}; accepted: {accepted}", key="data"
        )
    return fn(*args, **opts)


def _user_factory(module_name: str, attr: str, kw: dict[str, Any], spec: str) -> DataSource:
    from loka_tune._io import cwd_importable

    cwd_importable()  # as `python -m` users expect: a module in the working directory imports
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"data spec {spec!r}: cannot import module {module_name!r} ({e}); make it importable "
            f"(installed or on PYTHONPATH); accepted forms: {SPEC_FORMS}",
            key="data",
        ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(
            f"data spec {spec!r}: module {module_name!r} has no callable {attr!r}", key="data"
        )
    source = fn(**kw)
    if not isinstance(source, DataSource):
        raise ConfigError(
            f"data spec {spec!r}: {module_name}.{attr}() returned {type(source).__name__}, not a "
            "DataSource (needs name, num_dense, cardinalities and batches(split, batch_size, "
            "seed, device))",
            key="data",
        )
    return source
