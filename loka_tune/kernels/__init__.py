"""Numerics and execution: reference FP8 quantization, the GEMM backend registry, the
``loka::gemm`` custom op and :class:`LokaLinear`.

Importing this package is cheap (no torch import): the names below load their module on
first access. Modules: :mod:`~loka_tune.kernels.quant` (reference quantization),
:mod:`~loka_tune.kernels.registry` (backends), :mod:`~loka_tune.kernels.emulated` (the oracle
backend), :mod:`~loka_tune.kernels.ops` (the custom op), :mod:`~loka_tune.kernels.linear`
(the module). GPU backends live in :mod:`loka_tune.kernels.backends` and load lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loka_tune._lazy import lazy_module

if TYPE_CHECKING:  # the real objects behind the lazy names, for type checkers; never run
    from loka_tune.kernels.linear import LokaLinear as LokaLinear
    from loka_tune.kernels.linear import find_linears as find_linears
    from loka_tune.kernels.quant import QTensor as QTensor
    from loka_tune.kernels.quant import dequantize as dequantize
    from loka_tune.kernels.quant import fake_quantize as fake_quantize
    from loka_tune.kernels.quant import mere as mere
    from loka_tune.kernels.quant import quantize as quantize
    from loka_tune.kernels.quant import sqnr_db as sqnr_db
    from loka_tune.kernels.registry import Backend as Backend
    from loka_tune.kernels.registry import candidate_choices as candidate_choices
    from loka_tune.kernels.registry import check_supported as check_supported
    from loka_tune.kernels.registry import get_backend as get_backend
    from loka_tune.kernels.registry import list_backends as list_backends
    from loka_tune.kernels.registry import register_backend as register_backend

# public name -> module that defines it
_LAZY = {
    "QTensor": "loka_tune.kernels.quant",
    "quantize": "loka_tune.kernels.quant",
    "dequantize": "loka_tune.kernels.quant",
    "fake_quantize": "loka_tune.kernels.quant",
    "sqnr_db": "loka_tune.kernels.quant",
    "mere": "loka_tune.kernels.quant",
    "Backend": "loka_tune.kernels.registry",
    "register_backend": "loka_tune.kernels.registry",
    "get_backend": "loka_tune.kernels.registry",
    "list_backends": "loka_tune.kernels.registry",
    "check_supported": "loka_tune.kernels.registry",
    "candidate_choices": "loka_tune.kernels.registry",
    "LokaLinear": "loka_tune.kernels.linear",
    "find_linears": "loka_tune.kernels.linear",
}

__all__ = list(_LAZY)


__getattr__, __dir__ = lazy_module(__name__, _LAZY)
