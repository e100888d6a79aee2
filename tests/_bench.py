"""Loading a benchmark script (``benchmarks/<name>.py``, not a package) as a module, for its tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_bench(script: str, name: str | None = None, *, register: bool = False) -> ModuleType:
    """``benchmarks/<script>`` executed as a fresh module named ``name`` (default: the script's stem
    + ``"_bench"``). ``register``: put it in ``sys.modules`` before running it (a script whose
    dataclasses or pickling look their module up there)."""
    path = REPO / "benchmarks" / script
    spec = importlib.util.spec_from_file_location(name or f"{path.stem}_bench", path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
