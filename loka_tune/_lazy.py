"""One helper for the package faces that load their names on first access (PEP 562).

>>> _LAZY = {"LokaLinear": "loka_tune.kernels.linear"}   # public name -> module defining it
>>> __getattr__, __dir__ = lazy_module(__name__, _LAZY)  # doctest: +SKIP

``import loka_tune`` (and ``loka_tune.kernels``, ``loka_tune.models``) then stays cheap: a
name's module is imported when the name is first used, and the value is cached in the
package so later lookups are plain attribute reads. No loka_tune imports here.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Mapping

__all__ = ["lazy_module"]


def lazy_module(name: str, lazy: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the module ``name``: each attribute in ``lazy`` (attribute
    -> module that defines it) is imported on first access and cached in the module; any
    other unknown attribute raises ``AttributeError`` like a plain module."""

    def __getattr__(attr: str) -> Any:
        mod = lazy.get(attr)
        if mod is None:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")
        value = getattr(importlib.import_module(mod), attr)
        vars(sys.modules[name])[attr] = value  # the module's globals: next time no __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[name])) | set(lazy))

    return __getattr__, __dir__
