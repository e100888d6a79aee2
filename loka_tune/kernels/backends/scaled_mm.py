"""``torch_scaled_mm``: cuBLASLt / CUTLASS FP8 GEMMs through ``torch._scaled_mm``.

Quantization: under ``torch.compile``, plain torch ops (:mod:`loka_tune.kernels.scaled`)
that inductor fuses with the operand's producer, as torchao does; in eager mode our fused
Triton kernels (one pass, transposed operands of dgrad and wgrad quantized and transposed
together) behind one custom op. Both have the reference semantics, bit for bit. GEMM:
``torch._scaled_mm(A, B^T)`` with A row-major and B column-major (the only FP8 layout
Hopper's tensor cores take: B is the canonical ``(n, k)`` K-contiguous operand, transposed as
a view).

- ``tensor``: one dequantization factor per operand (cuBLASLt), any output dtype;
- ``row``: ``scale_a (m, 1)``, ``scale_b (1, n)`` (torch's rowwise kernel, bf16 output only:
  other output dtypes are computed in bf16 and cast);
- ``fast_accum``: ``use_fast_accum``.

Serving (a static weight): the weight is quantized once by :func:`~loka_tune.kernels.scaled.cast_to_fp8`
(tensor- or rowwise, the reference semantics), and each call quantizes only the activation,
in traceable torch ops, then ``torch._scaled_mm`` (:func:`~loka_tune.kernels.scaled.scaled_mm_static`),
compiled or not. Tensorwise sites also take a calibrated activation scale
(:func:`~loka_tune.kernels.scaled.scaled_mm_calibrated`: an elementwise cast, no amax per call).

Not here: blockwise 1x128 / 128x128 scaling (use ``fbgemm`` or ``triton``), mxfp8 (Blackwell),
e5m2 x e5m2 (no such cuBLASLt kernel). k and n must be multiples of 16 (cuBLASLt FP8
leading-dimension rule).
"""

from __future__ import annotations

from typing import Callable

import torch

from loka_tune.config import Format, GemmChoice, GemmRole, Granularity
from loka_tune.errors import UnsupportedChoiceError
from loka_tune.kernels.backends import GPUBackend, quantize_operand
from loka_tune.kernels.registry import Shape, register_backend
from loka_tune.kernels.scaled import cast_to_fp8, scaled_mm_calibrated, scaled_mm_gemm, scaled_mm_static

__all__ = ["ScaledMMBackend"]


@register_backend("torch_scaled_mm")
class ScaledMMBackend(GPUBackend):
    formats = frozenset({Format.E4M3, Format.E5M2})
    granularities = frozenset({Granularity.TENSOR, Granularity.ROW})
    fast_accum_modes = (False, True)
    alignment = 16
    min_capability = (8, 9)
    install_hint = "a CUDA build of torch>=2.5 (torch._scaled_mm)"
    static_granularities = frozenset({Granularity.TENSOR, Granularity.ROW})
    static_traceable = True  # torch ops + the aten op, eager or compiled
    calibrated_granularities = frozenset({Granularity.TENSOR})

    def extra_reason(self, choice: GemmChoice, role: GemmRole, shape: Shape | None) -> str | None:
        if choice.a_format == Format.E5M2 and choice.b_format == Format.E5M2:
            return "cuBLASLt has no e5m2 x e5m2 FP8 GEMM (use e5m2+e4m3 or e4m3)"
        if choice.granularity == Granularity.ROW and Format.E5M2 in (choice.a_format, choice.b_format):
            return "torch's rowwise-scaled FP8 GEMM takes e4m3 operands only"
        return None

    def direct(self, choice: GemmChoice, role: GemmRole) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Traceable torch quantization + ``torch._scaled_mm`` while compiling; the fused Triton
        quantization (one custom op) in eager mode, where separate torch ops would cost ~6 passes."""
        eager = super().direct(choice, role)

        def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            if torch.compiler.is_compiling():
                return scaled_mm_gemm(a, b, choice)
            return eager(a, b)

        return fn

    def gemm_impl(self, a: torch.Tensor, b: torch.Tensor, choice: GemmChoice, role: GemmRole) -> torch.Tensor:
        g, r = choice.granularity, choice.rounding
        qa = quantize_operand(a, choice.a_format, g, r, is_weight=False)  # (m, k)
        qb = quantize_operand(b, choice.b_format, g, r, is_weight=False)  # (n, k)
        if g == Granularity.TENSOR:
            sa, sb = qa.inv_scale.reshape(()), qb.inv_scale.reshape(())
            out_dtype = a.dtype if a.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16
        else:
            sa, sb = qa.inv_scale, qb.inv_scale.t()  # (m, 1), (1, n)
            out_dtype = torch.bfloat16
        out = torch._scaled_mm(qa.data, qb.data.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype,
                               use_fast_accum=choice.fast_accum)  # (m, n)
        return out if out.dtype == a.dtype else out.to(a.dtype)

    def error_gemm(self, a: torch.Tensor, b: torch.Tensor, choice: GemmChoice, role: GemmRole) -> torch.Tensor:
        """The compiled step's own path, run eagerly (:func:`~loka_tune.kernels.scaled.scaled_mm_gemm`:
        torch ops and ``torch._scaled_mm``): the FP8 data of the Triton quantizer bit for bit
        (both are the reference's), without its Triton compilation at every new operand width
        (its row kernel's block is the width's next power of two, so each new width compiles
        anew: a few calls of each are what the probe makes)."""
        return scaled_mm_gemm(a, b, choice)

    def quantize_weight(self, w: torch.Tensor, choice: GemmChoice) -> tuple[torch.Tensor, torch.Tensor]:
        """``cast_to_fp8`` of the weight: ``(data (N, K), dequantization factors () or (N, 1))``."""
        return cast_to_fp8(w, choice.b_format, choice.granularity, choice.rounding)

    def static_gemm_impl(self, a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                         choice: GemmChoice) -> torch.Tensor:
        return scaled_mm_static(a, w, w_scale, choice)

    def calibrated_gemm(self, choice: GemmChoice) -> Callable[..., torch.Tensor]:
        """:func:`~loka_tune.kernels.scaled.scaled_mm_calibrated`: traceable, eager or compiled."""
        why = self.calibrated_reason(choice)
        if why is not None:
            raise UnsupportedChoiceError(f"{choice.short_str()!r}: {why}")

        def fn(a: torch.Tensor, act_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
               act_inv: torch.Tensor | None = None) -> torch.Tensor:
            return scaled_mm_calibrated(a, act_scale, w, w_scale, choice, act_inv)

        return fn
