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


def assert_compiled_matches_eager_and_float64(block: torch.nn.Sequential, x: torch.Tensor, dy: torch.Tensor) -> None:
    """``block`` (a Hard Swish, then an FP8 Linear without bias) trained one step eagerly and compiled
    whole under bf16 autocast: the two agree to FP8's ulps (SQNR > 30 dB in y, dx, dw), and the
    compiled one is within FP8's error of float64 (> 22 dB in y and dw)."""
    from loka_tune.kernels.quant import sqnr_db

    grads = []
    for fn in (block, torch.compile(block, fullgraph=True)):
        xg = x.clone().requires_grad_(True)
        block.zero_grad()
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            y = fn(xg)
        y.float().backward(dy)
        grads.append((y.detach().float(), xg.grad.clone(), block[1].weight.grad.clone()))
    (ye, dxe, dwe), (yc, dxc, dwc) = grads
    assert sqnr_db(ye, yc) > 30.0 and sqnr_db(dxe, dxc) > 30.0 and sqnr_db(dwe, dwc) > 30.0
    y64, _, dw64 = linear_grads64(block[1].weight, None, torch.nn.functional.hardswish(x), dy)
    assert sqnr_db(y64, yc) > 22.0 and sqnr_db(dw64, dwc) > 22.0


def run_under_triton_interpreter(code: str, timeout: int = 300) -> None:
    """Run ``code`` in a fresh Python with ``TRITON_INTERPRET=1`` (Triton kernels on the CPU; the
    variable must be set before triton is imported) and assert it printed ``ok``; skips the calling
    test where triton is not installed (as in CI)."""
    import os
    import subprocess

    import pytest

    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton (the interpreter runs on the CPU)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
