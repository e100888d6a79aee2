"""Numerics and execution: reference FP8 quantization, the GEMM backend registry, the
``loka::gemm`` custom op and :class:`LokaLinear`.

Importing this package is cheap (no torch import): the names below load their module on
first access. Modules: :mod:`~loka_tune.kernels.quant` (reference quantization),
:mod:`~loka_tune.kernels.registry` (backends), :mod:`~loka_tune.kernels.emulated` (the oracle
backend), :mod:`~loka_tune.kernels.ops` (the custom op), :mod:`~loka_tune.kernels.linear`
(the module), :mod:`~loka_tune.kernels.chain` (FP8 chains: MLPs whose norms write the next GEMM's
FP8 operands, with delayed scales; not yet wired into ``apply``). GPU backends live in
:mod:`loka_tune.kernels.backends` and load lazily.
"""

from __future__ import annotations

from loka_tune._lazy import lazy_module

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
