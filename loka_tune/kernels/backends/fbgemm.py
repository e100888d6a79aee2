"""``fbgemm``: FBGEMM GenAI (``fbgemm-gpu-genai``) FP8 GEMMs (CUTLASS, sm90).

- ``row``: ``quantize_fp8_per_row`` (FBGEMM's own quantizer, exact scales) +
  ``f8f8bf16_rowwise``; ``tensor``: ``quantize_fp8_per_tensor`` + ``f8f8bf16`` (the combined
  scale stays on the device: no host sync, CUDA-graph safe). FBGEMM's quantizers need
  contiguous inputs, so dgrad's ``W^T`` and wgrad's ``dY^T``, ``X^T`` are copied first (a
  transpose pass each).
- ``block``: ``f8f8bf16_groupwise`` (DeepGEMM-style: A in 1x128 groups, B in 128x128
  blocks), quantized by our fused Triton kernels (FBGEMM's block quantizers are Triton
  kernels too, and its Triton GEMMs fail under Triton 3.6). Its B must be a weight
  (128x128), so it serves fwd and dgrad only; wgrad's 1x128 x 1x128 is the ``triton``
  backend's.

Serving (a static weight): the weight is quantized once by the same quantizers (FBGEMM's for
row / tensor, ours for block, scales MN-major as the groupwise GEMM takes them), each call
quantizes only the activation; one custom op per GEMM (``loka_tune::fp8_gemm_static``).

e4m3 only (the kernels are instantiated for e4m3). Exact scales only for tensor/row (the
quantize ops have no power-of-two rounding); block takes both.
"""

from __future__ import annotations

import torch

from loka_tune.config import Format, GemmChoice, GemmRole, Granularity, ScaleRounding
from loka_tune.errors import BackendError
from loka_tune.kernels.backends import GPUBackend, quantize_operand
from loka_tune.kernels.registry import Shape, register_backend

__all__ = ["FBGEMMBackend"]

try:  # registers torch.ops.fbgemm.* (quantize_fp8_per_row, f8f8bf16_rowwise, ...)
    import fbgemm_gpu.experimental.gen_ai  # noqa: F401
except ImportError:
    raise
except Exception as e:  # a broken build (ABI mismatch with torch): say so, as an ImportError
    raise ImportError(f"fbgemm_gpu.experimental.gen_ai failed to load: {e}") from e


@register_backend("fbgemm")
class FBGEMMBackend(GPUBackend):
    formats = frozenset({Format.E4M3})
    granularities = frozenset({Granularity.TENSOR, Granularity.ROW, Granularity.BLOCK})
    fast_accum_modes = (False, True)
    alignment = 16
    min_capability = (9, 0)
    max_capability = (9, 0)  # sm90 CUTLASS kernels
    install_hint = "fbgemm-gpu-genai (`pip install fbgemm-gpu-genai`)"
    runtime_shape_check = True  # a launch limit at large k (below): checked at the real shape
    static_granularities = frozenset({Granularity.TENSOR, Granularity.ROW, Granularity.BLOCK})

    def extra_reason(self, choice: GemmChoice, role: GemmRole, shape: Shape | None) -> str | None:
        g = choice.granularity
        if g == Granularity.BLOCK:
            if role == GemmRole.WGRAD:
                return ("f8f8bf16_groupwise scales B in 128x128 weight blocks; wgrad's B (X^T) is an"
                        " activation scaled 1x128: use the 'triton' backend for blockwise wgrad")
            if choice.fast_accum:
                return "blockwise GEMMs promote every 128 elements: 'fa' does not apply"
            if shape is not None:
                m, k, n = shape
                for dim, v, mult in (("m", m, 16), ("k", k, 128), ("n", n, 128)):
                    if v is not None and v % mult:
                        # m=777 crashed the kernel on the H200 (illegal instruction): its TMA
                        # loads of the MN-major scales need 16-byte aligned rows
                        return f"f8f8bf16_groupwise needs {dim} to be a multiple of {mult}, got {v}"
            return None
        if choice.rounding != ScaleRounding.EXACT:
            return "FBGEMM's quantize ops compute exact scales (no power-of-two rounding)"
        if g == Granularity.ROW and shape is not None and shape[1] is not None and shape[1] >= 32768:
            # seen on the H200 (fbgemm-gpu-genai 1.6.0): "CUDA kernel launch failed: invalid argument"
            # for the wgrad of a Linear over 32768 rows (k = 32768; k = 16384 runs), and over a
            # whole Wukong step at B=32768; checked at the real shape of every call
            return f"f8f8bf16_rowwise fails to launch for k={shape[1]} >= 32768 (wgrad over a large batch)"
        return None

    def gemm_impl(self, a: torch.Tensor, b: torch.Tensor, choice: GemmChoice, role: GemmRole) -> torch.Tensor:
        g = choice.granularity
        ops = torch.ops.fbgemm
        if g == Granularity.BLOCK:
            qa = quantize_operand(a, choice.a_format, g, choice.rounding, is_weight=False, scale_mn_major=True)
            qb = quantize_operand(b, choice.b_format, g, choice.rounding, is_weight=True, scale_mn_major=True)
            # FBGEMM wants MN-major scales: x (k/128, m), w (k/128, n/128) contiguous
            out = ops.f8f8bf16_groupwise(qa.data, qb.data, qa.inv_scale.t(), qb.inv_scale.t())
        elif g == Granularity.ROW:
            xq, xs = ops.quantize_fp8_per_row(a.contiguous())  # (m, k) fp8, (m,) dequant factors
            wq, ws = ops.quantize_fp8_per_row(b.contiguous())
            out = ops.f8f8bf16_rowwise(xq, wq, xs, ws, use_fast_accum=choice.fast_accum)
        elif g == Granularity.TENSOR:
            xq, xs = ops.quantize_fp8_per_tensor(a.contiguous())
            wq, ws = ops.quantize_fp8_per_tensor(b.contiguous())
            out = ops.f8f8bf16(xq, wq, (xs * ws).reshape(1), use_fast_accum=choice.fast_accum)
        else:  # pragma: no cover - supports() rejects it
            raise BackendError(f"fbgemm cannot run {choice.short_str()}")
        return out if out.dtype == a.dtype else out.to(a.dtype)

    def quantize_weight(self, w: torch.Tensor, choice: GemmChoice) -> tuple[torch.Tensor, torch.Tensor]:
        """The fwd weight as :meth:`gemm_impl` quantizes it: block ``(data, MN-major scales
        (K/128, N/128))``, row ``(data, (N,))``, tensor ``(data, ())`` (dequantization factors)."""
        g = choice.granularity
        if g == Granularity.BLOCK:
            qb = quantize_operand(w, choice.b_format, g, choice.rounding, is_weight=True, scale_mn_major=True)
            return qb.data, qb.inv_scale.t().contiguous()
        if g == Granularity.ROW:
            return torch.ops.fbgemm.quantize_fp8_per_row(w.contiguous())
        return torch.ops.fbgemm.quantize_fp8_per_tensor(w.contiguous())

    def static_gemm_impl(self, a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                         choice: GemmChoice) -> torch.Tensor:
        g = choice.granularity
        ops = torch.ops.fbgemm
        if g == Granularity.BLOCK:
            qa = quantize_operand(a, choice.a_format, g, choice.rounding, is_weight=False, scale_mn_major=True)
            out = ops.f8f8bf16_groupwise(qa.data, w, qa.inv_scale.t(), w_scale)
        elif g == Granularity.ROW:
            xq, xs = ops.quantize_fp8_per_row(a.contiguous())  # (m, k) fp8, (m,) dequant factors
            out = ops.f8f8bf16_rowwise(xq, w, xs, w_scale, use_fast_accum=choice.fast_accum)
        elif g == Granularity.TENSOR:
            xq, xs = ops.quantize_fp8_per_tensor(a.contiguous())
            out = ops.f8f8bf16(xq, w, (xs * w_scale).reshape(1), use_fast_accum=choice.fast_accum)
        else:  # pragma: no cover - static_reason rejects it
            raise BackendError(f"fbgemm cannot serve {choice.short_str()}")
        return out if out.dtype == a.dtype else out.to(a.dtype)
