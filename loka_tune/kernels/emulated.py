"""The ``emulated`` backend: the numerics oracle, on CPU and GPU.

Each operand is quantized and dequantized with the reference semantics of
:mod:`loka_tune.kernels.quant` (A as an activation / gradient; B as a weight, i.e. 128x128
blocks, in fwd and dgrad), then multiplied in float32 (float32 accumulation) and the result
is cast back to ``a.dtype``. It runs every FP8 format, granularity and scale rounding, and
bf16 choices (``bf16.emulated``: a float32 matmul of the unquantized operands).

Serving (a static weight, ``apply(..., serving=True)``): :meth:`EmulatedBackend.quantize_weight`
keeps the reference :class:`~loka_tune.kernels.quant.QTensor`'s FP8 data and its *multipliers*
``scale`` (the dequantization divides by them, as :func:`~loka_tune.kernels.quant.dequantize`
does), so the served GEMM equals :func:`emulated_gemm` on the same weight bit for bit.

``fast_accum`` is accepted and ignored: the emulation always accumulates in float32, so
``...fa.emulated`` is numerically the same as without ``fa`` (real kernels with fast
accumulation may be slightly less accurate than this oracle).
"""

from __future__ import annotations

from typing import Callable

import torch

from loka_tune.config import FP8_FORMATS, GemmChoice, GemmRole, Granularity
from loka_tune.kernels.quant import FMAX, FP8_DTYPE, QTensor, dequantize, fake_quantize, quantize, tile_shape
from loka_tune.kernels.registry import Backend, register_backend

__all__ = ["EmulatedBackend", "emulated_gemm", "emulated_static_gemm"]


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


def emulated_static_gemm(a: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, choice: GemmChoice) -> torch.Tensor:
    """:func:`emulated_gemm`'s fwd GEMM on a weight quantized ahead of time: ``data`` ``(n, k)``
    FP8 and ``scale`` its reference multipliers (128x128 tiles for ``block``). Returns ``(m, n)``
    in ``a.dtype``."""
    g, r = choice.granularity, choice.rounding
    qa = fake_quantize(a, choice.a_format, g, r, is_weight=False, dtype=torch.float32)  # (m, k)
    n, k = data.shape
    qw = QTensor(data, scale, choice.b_format, g, r, True, tile_shape(g, n, k, is_weight=True))
    return (qa @ dequantize(qw, torch.float32).t()).to(a.dtype)  # (m, n)


def emulated_calibrated_gemm(a: torch.Tensor, act_scale: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                             choice: GemmChoice) -> torch.Tensor:
    """:func:`emulated_static_gemm` with the activation's tensorwise scale fixed: ``act_scale``
    (float32 ``()``, a reference multiplier ``fmax / amax``) instead of ``a``'s own amax."""
    fmax = FMAX[choice.a_format]
    x = a.to(torch.float32)  # (m, k)
    qa = (x * act_scale).clamp(-fmax, fmax).to(FP8_DTYPE[choice.a_format]).to(torch.float32) / act_scale
    n, k = data.shape
    qw = QTensor(data, scale, choice.b_format, choice.granularity, choice.rounding, True,
                 tile_shape(choice.granularity, n, k, is_weight=True))
    return (qa @ dequantize(qw, torch.float32).t()).to(a.dtype)  # (m, n)


@register_backend("emulated")
class EmulatedBackend(Backend):
    """Quantize-dequantize with the reference semantics, then a float32 GEMM (see module doc)."""

    fast_accum_modes = (False, True)  # accepted; ignored by the emulation
    enumerated_fast_accum = (False,)  # 'fa' changes nothing here: do not list duplicates
    install_hint = "nothing: it is part of loka-tune"
    static_granularities = frozenset({Granularity.TENSOR, Granularity.ROW, Granularity.BLOCK, Granularity.MX})
    calibrated_granularities = frozenset({Granularity.TENSOR})

    def quantize_weight(self, w: torch.Tensor, choice: GemmChoice) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference quantization of the fwd weight (``is_weight``: 128x128 blocks):
        ``(data (N, K), scale multipliers)``."""
        assert choice.b_format in FP8_FORMATS, choice
        q = quantize(w, choice.b_format, choice.granularity, choice.rounding, is_weight=True)
        return q.data, q.scale

    def static_gemm(self, choice: GemmChoice) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        def fn(a: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return emulated_static_gemm(a, data, scale, choice)

        return fn

    def calibrated_gemm(self, choice: GemmChoice) -> Callable[..., torch.Tensor]:
        def fn(a: torch.Tensor, act_scale: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
               act_inv: torch.Tensor | None = None) -> torch.Tensor:
            # the emulation divides by act_scale as the reference dequantizes: act_inv is not needed
            return emulated_calibrated_gemm(a, act_scale, data, scale, choice)

        return fn

    def gemm(self, a: torch.Tensor, b: torch.Tensor, choice: GemmChoice, role: GemmRole) -> torch.Tensor:
        return emulated_gemm(a, b, choice, role)
