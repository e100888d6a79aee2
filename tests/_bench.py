"""Loading a benchmark script (``benchmarks/<name>.py``, not a package) as a module, for its tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

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


def linear_grads64(w: torch.Tensor, b: torch.Tensor | None, x: torch.Tensor, dy: torch.Tensor,
                   clamp: float | None = None) -> tuple[torch.Tensor, ...]:
    """y, dx, dw of ``x @ w.T + b`` in float64 (the reference of the FP8 Linears the benchmark
    scripts build); ``clamp``: x saturated at +-clamp first."""
    x64 = x.double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    xin = x64 if clamp is None else x64.clamp(-clamp, clamp)
    y = xin @ w64.t()
    if b is not None:
        y = y + b.detach().double()
    y.backward(dy.double())
    return y.detach(), x64.grad, w64.grad
