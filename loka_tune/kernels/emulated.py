"""The ``emulated`` backend: the numerics oracle, on CPU and GPU.

Each operand is quantized and dequantized with the reference semantics of
:mod:`loka_tune.kernels.quant` (A as an activation / gradient; B as a weight, i.e. 128x128
blocks, in fwd and dgrad), then multiplied in float32 (float32 accumulation) and the result
is cast back to ``a.dtype``. It runs every FP8 format, granularity and scale rounding, and
bf16 choices (``bf16.emulated``: a float32 matmul of the unquantized operands).

``fast_accum`` is accepted and ignored: the emulation always accumulates in float32, so
``...fa.emulated`` is numerically the same as without ``fa`` (real kernels with fast
accumulation may be slightly less accurate than this oracle).
"""

from __future__ import annotations

import torch

from loka_tune.config import GemmChoice, GemmRole
from loka_tune.kernels.quant import fake_quantize
from loka_tune.kernels.registry import Backend, register_backend

__all__ = ["EmulatedBackend", "emulated_gemm"]


def emulated_gemm(a: torch.Tensor, b: torch.Tensor, choice: GemmChoice, role: GemmRole | str) -> torch.Tensor:
    """``fake_quantize(a) @ fake_quantize(b).T`` in float32, returned in ``a.dtype``.

    ``a``: ``(m, k)``, ``b``: ``(n, k)``; the reduction is the last dim of both.
    """
    role = GemmRole(role)
    b_is_weight = role in (GemmRole.FWD, GemmRole.DGRAD)
    if choice.is_bf16:
        qa, qb = a.to(torch.float32), b.to(torch.float32)
    else:
        g, r = choice.granularity, choice.rounding
        qa = fake_quantize(a, choice.a_format, g, r, is_weight=False, dtype=torch.float32)  # (m, k)
        qb = fake_quantize(b, choice.b_format, g, r, is_weight=b_is_weight, dtype=torch.float32)  # (n, k)
    return (qa @ qb.t()).to(a.dtype)  # (m, n)


@register_backend("emulated")
class EmulatedBackend(Backend):
    """Quantize-dequantize with the reference semantics, then a float32 GEMM (see module doc)."""

    fast_accum_modes = (False, True)  # accepted; ignored by the emulation
    enumerated_fast_accum = (False,)  # 'fa' changes nothing here: do not list duplicates
    install_hint = "nothing: it is part of loka-tune"

    def gemm(self, a: torch.Tensor, b: torch.Tensor, choice: GemmChoice, role: GemmRole) -> torch.Tensor:
        return emulated_gemm(a, b, choice, role)
