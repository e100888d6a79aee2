"""FP8 quantization and ``torch._scaled_mm`` GEMMs in plain, traceable torch ops.

Under ``torch.compile`` every op here is visible to inductor: the amax reduction, the scale
and the saturating cast become generated kernels that inductor fuses with the producer of the
operand (the ReLU or norm before a Linear, the gradient of the op after it), exactly as
torchao's float8 training does, and ``torch._scaled_mm`` stays the aten op it is (cuBLASLt
picks the kernel). Nothing runs Python per call once a graph is compiled: no custom op, no
registry look-up, no host sync.

Semantics are the reference ones of :mod:`loka_tune.kernels.quant` (tensor- and rowwise):
``scale = fmax / amax`` per tile (clamped finite, ``1`` for an all-zero tile), optionally
rounded down to a power of two, ``data = clamp(x * scale, +-fmax)`` cast with round to nearest
even; the GEMM takes the dequantization factors ``1 / scale``. The power-of-two rounding clears
the mantissa bits of the float32 scale, which equals the reference's ``frexp`` rounding for
every positive normal scale (all finite scales are: see :func:`quant.compute_scale`) and is a
plain bit operation for inductor.

Layouts: ``torch._scaled_mm(A, B)`` takes A row-major ``(m, k)`` and B column-major ``(k, n)``.
The canonical operands arrive as ``a (m, k)`` and ``b (n, k)`` with any strides (dgrad's
``W^T`` and wgrad's ``dY^T``, ``X^T`` are transposed views); the FP8 copies are written
K-contiguous, so a transposed view is quantized and transposed in one generated kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loka_tune.config import Format, GemmChoice, Granularity, ScaleRounding
from loka_tune.kernels.quant import F32_MAX, FMAX, FP8_DTYPE

__all__ = ["cast_to_fp8", "scale_from_amax", "scaled_mm_gemm", "scaled_mm_static", "SCALED_MM_GRANULARITIES", "SharePlan", "share_plan", "mm_quantized",
           "transposed"]

SCALED_MM_GRANULARITIES = frozenset({Granularity.TENSOR, Granularity.ROW})
_EXP_MASK = 0x7F800000  # float32 exponent bits: clearing the mantissa rounds down to 2**e


def scale_from_amax(amax: torch.Tensor, fmt: Format, pow2: bool) -> torch.Tensor:
    """Reference scales from float32 amaxes (see :func:`loka_tune.kernels.quant.compute_scale`)."""
    fmax = FMAX[fmt]
    # a tensor over a tensor: a true IEEE division (a Python scalar over a tensor may become
    # reciprocal-times-scalar, one ulp off the reference)
    scale = (torch.full_like(amax, fmax) / amax.clamp(min=fmax / F32_MAX)).clamp(max=F32_MAX)
    if pow2:
        rounded = (scale.view(torch.int32) & _EXP_MASK).view(torch.float32)
        # inf amax gives scale 0 and NaN amax NaN: the reference keeps those as they are
        scale = torch.where(torch.isfinite(scale) & (scale > 0), rounded, scale)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def cast_to_fp8(
    x: torch.Tensor, fmt: Format, gran: Granularity, rounding: ScaleRounding
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a canonical operand ``x`` ``(rows, red)``: ``(data, inv_scale)``.

    ``data`` is ``(rows, red)`` row-major (K-contiguous) in ``FP8_DTYPE[fmt]``; ``inv_scale``
    is float32, ``()`` for ``tensor`` and ``(rows, 1)`` for ``row`` (one scale per row along
    the reduction dimension).
    """
    x32 = x.to(torch.float32)  # (rows, red)
    if gran == Granularity.TENSOR:
        amax = x32.abs().amax()  # ()
    elif gran == Granularity.ROW:
        amax = x32.abs().amax(dim=1, keepdim=True)  # (rows, 1)
    else:
        raise ValueError(f"cast_to_fp8 runs 'tensor' and 'row' scaling, got {gran.value!r}")
    scale = scale_from_amax(amax, fmt, rounding == ScaleRounding.POW2)
    fmax = FMAX[fmt]
    data = (x32 * scale).clamp(-fmax, fmax).to(FP8_DTYPE[fmt])  # (rows, red), layout of x
    if data.stride(-1) != 1:
        data = data.contiguous()  # K-contiguous for the tensor cores (one fused pass when compiled)
    return data, scale.reciprocal()


def scaled_mm_gemm(a: torch.Tensor, b: torch.Tensor, choice: GemmChoice) -> torch.Tensor:
    """``a @ b.T`` (``a`` ``(m, k)``, ``b`` ``(n, k)``) through ``torch._scaled_mm``, in ``a.dtype``.

    ``tensor``: one dequantization factor per operand, output in ``a.dtype`` (bf16 / fp16 /
    fp32, else bf16 then cast); ``row``: ``(m, 1)`` and ``(1, n)`` factors, bf16 output (torch's
    rowwise kernel) cast to ``a.dtype``. ``fast_accum`` is ``use_fast_accum``.
    """
    qb, sb = cast_to_fp8(b, choice.b_format, choice.granularity, choice.rounding)  # (n, k), () or (n, 1)
    return scaled_mm_static(a, qb, sb, choice)


def scaled_mm_static(a: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor, choice: GemmChoice) -> torch.Tensor:
    """:func:`scaled_mm_gemm` with ``b`` already quantized (``cast_to_fp8``: ``qb`` ``(n, k)``
    K-contiguous, ``sb`` its dequantization factors ``()`` or ``(n, 1)``): only ``a`` is
    quantized here. The serving forward's GEMM (a static weight)."""
    g, r = choice.granularity, choice.rounding
    qa, sa = cast_to_fp8(a, choice.a_format, g, r)  # (m, k), () or (m, 1)
    if g == Granularity.TENSOR:
        out_dtype = a.dtype if a.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16
    else:
        sb = sb.t()  # (1, n)
        out_dtype = torch.bfloat16
    out = torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype,
                           use_fast_accum=choice.fast_accum)  # (m, n)
    return out if out.dtype == a.dtype else out.to(a.dtype)


def scaled_mm_calibrated(a: torch.Tensor, act_scale: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor,
                         choice: GemmChoice, act_inv: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`scaled_mm_static` (tensorwise) with the activation's scale fixed ahead of time:
    ``act_scale`` (float32 ``()``, the multiplier ``fmax / amax`` of a calibration). The cast is
    elementwise (no amax reduction per call), so under ``torch.compile`` it fuses into the kernel
    that produces ``a``. With the scale of ``a``'s own amax it is :func:`scaled_mm_static`.
    ``act_inv`` is ``act_scale.reciprocal()`` computed ahead of time (the GEMM's dequantization
    factor; given, no reciprocal kernel runs per call)."""
    fmax = FMAX[choice.a_format]
    x32 = a.to(torch.float32)
    qa = (x32 * act_scale).clamp(-fmax, fmax).to(FP8_DTYPE[choice.a_format])  # (m, k), layout of a
    if qa.stride(-1) != 1:
        qa = qa.contiguous()
    out_dtype = a.dtype if a.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16
    out = torch._scaled_mm(qa, qb.t(), scale_a=act_scale.reciprocal() if act_inv is None or act_inv.numel() != 1 else act_inv,
                           scale_b=sb, out_dtype=out_dtype,
                           use_fast_accum=choice.fast_accum)  # (m, n)
    return out if out.dtype == a.dtype else out.to(a.dtype)


# ------------------------------------------------------------------ quantize once, use twice
@dataclass(frozen=True)
class SharePlan:
    """Which operands of a linear layer are quantized once and reused by two of its GEMMs.

    With tensorwise scaling one scale covers a whole tensor, so a transpose of its FP8 copy is
    the FP8 copy of its transpose (bit for bit): ``W`` quantized for fwd serves dgrad (as
    ``W^T``), ``X`` quantized for fwd serves wgrad (``X^T``, saved for backward in FP8, half
    the bytes of bf16), ``dY`` quantized for dgrad serves wgrad (``dY^T``). Torchao's
    tensorwise training does the same. Each flag needs both GEMMs on ``torch_scaled_mm``,
    tensorwise, with the operand in one format and one scale rounding.

    ``dual``: the shared operands are cast by ``torch.ops.loka.cast_dual`` (one read, both
    layouts, :mod:`loka_tune.kernels.dualcast`) instead of a cast and a transposing copy.
    """

    x: bool = False
    w: bool = False
    dy: bool = False
    dual: bool = False

    @property
    def any(self) -> bool:
        return self.x or self.w or self.dy


NO_SHARE = SharePlan()


def _tensorwise(c: GemmChoice) -> bool:
    return c.backend == "torch_scaled_mm" and c.granularity == Granularity.TENSOR


def share_plan(fwd: GemmChoice, dgrad: GemmChoice, wgrad: GemmChoice) -> SharePlan:
    """The :class:`SharePlan` of a layer's three choices (fwd ``(X, W)``, dgrad ``(dY, W^T)``,
    wgrad ``(dY^T, X^T)``)."""
    def same(c1: GemmChoice, f1: Format, c2: GemmChoice, f2: Format) -> bool:
        return _tensorwise(c1) and _tensorwise(c2) and f1 == f2 and c1.rounding == c2.rounding

    return SharePlan(
        x=same(fwd, fwd.a_format, wgrad, wgrad.b_format),
        w=same(fwd, fwd.b_format, dgrad, dgrad.b_format),
        dy=same(dgrad, dgrad.a_format, wgrad, wgrad.a_format),
    )


def transposed(q: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensorwise FP8 copy of ``x.T`` from that of ``x``: the data transposed K-contiguous
    (a 1-byte copy), the same scale."""
    data, inv_scale = q
    return data.t().contiguous(), inv_scale


def mm_quantized(qa: tuple[torch.Tensor, torch.Tensor], qb: tuple[torch.Tensor, torch.Tensor],
                 choice: GemmChoice, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T`` of tensorwise operands already in FP8 (``(data, inv_scale)`` pairs, ``a``
    ``(m, k)`` and ``b`` ``(n, k)`` K-contiguous), through ``torch._scaled_mm``."""
    dt = out_dtype if out_dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16
    out = torch._scaled_mm(qa[0], qb[0].t(), scale_a=qa[1], scale_b=qb[1], out_dtype=dt,
                           use_fast_accum=choice.fast_accum)  # (m, n)
    return out if out.dtype == out_dtype else out.to(out_dtype)
