"""``triton``: our fused Triton quantization + our Triton FP8 GEMMs.

Every granularity of the reference semantics except ``mx``: tensorwise, rowwise (one scale
per row along each operand's reduction dimension: for wgrad that is per *column* of dY and
X, computed from the transposed views in the same pass that writes the transposed FP8
copy), and blockwise (1x128 activations / gradients, 128x128 weights; wgrad 1x128 on both
operands). e4m3 and e5m2 operands (mixed too), exact or power-of-two scales, fast
accumulation on or off (off: promotion to fp32 every 128 elements; block always promotes).
See :mod:`loka_tune.kernels.triton_quant` and :mod:`loka_tune.kernels.triton_gemm`.

Serving (a static weight): the weight is quantized once by the same kernels (128x128 blocks,
scales MN-major for ``block``), each call quantizes only the activation; one custom op per
GEMM (``loka_tune::fp8_gemm_static``). A rowwise static weight also feeds the fused
Linear -> BlockNorm -> Hard Swish epilogue (:mod:`loka_tune.kernels.serving`).
"""

from __future__ import annotations

import torch

from loka_tune.config import Format, GemmChoice, GemmRole, Granularity
from loka_tune.kernels import triton_gemm, triton_quant  # noqa: F401 - needs triton
from loka_tune.kernels.backends import GPUBackend, quantize_operand
from loka_tune.kernels.registry import Shape, register_backend

__all__ = ["TritonBackend"]


_GRID_Y = 65535  # CUDA's limit on a grid's y dimension


@register_backend("triton")
class TritonBackend(GPUBackend):
    formats = frozenset({Format.E4M3, Format.E5M2})
    granularities = frozenset({Granularity.TENSOR, Granularity.ROW, Granularity.BLOCK})
    fast_accum_modes = (False, True)
    min_capability = (9, 0)  # tuned for Hopper's wgmma; Ada would run but untested
    install_hint = "triton (`pip install triton`)"
    runtime_shape_check = True  # grid limits at very long reductions (below): checked at the real shape
    static_granularities = frozenset({Granularity.TENSOR, Granularity.ROW, Granularity.BLOCK})

    def extra_reason(self, choice: GemmChoice, role: GemmRole, shape: Shape | None) -> str | None:
        if choice.granularity == Granularity.BLOCK and choice.fast_accum:
            return "blockwise GEMMs promote every 128 elements: 'fa' does not apply"
        k = None if shape is None else shape[1]
        # the quantization kernels put tiles of the reduction dimension on the grid's y axis,
        # which CUDA caps at 65535 programs: rowwise on a transposed operand tiles it by 64,
        # blockwise by 128 (seen on the H200: "Triton Error [CUDA]: invalid argument" for the
        # wgrad of Wukong's feature-axis Linears at B=32768, k = 8.4M)
        limit = {Granularity.ROW: _GRID_Y * 64, Granularity.BLOCK: _GRID_Y * 128}.get(choice.granularity)
        if k is not None and limit is not None and k > limit:
            return f"our Triton {choice.granularity.value}wise quantization launches at most {limit} reduction elements, got k={k}"
        return None

    def gemm_impl(self, a: torch.Tensor, b: torch.Tensor, choice: GemmChoice, role: GemmRole) -> torch.Tensor:
        g, r = choice.granularity, choice.rounding
        b_weight = g == Granularity.BLOCK and role in (GemmRole.FWD, GemmRole.DGRAD)
        # block scales MN-major: the GEMM's per-k-step scale loads are then contiguous
        # (row-major 1x128 scales made wgrad's block GEMM 2.3x slower on the H200)
        mn = g == Granularity.BLOCK
        qa = quantize_operand(a, choice.a_format, g, r, is_weight=False, scale_mn_major=mn)  # (m, k)
        qb = quantize_operand(b, choice.b_format, g, r, is_weight=b_weight, scale_mn_major=mn)  # (n, k)
        out = triton_gemm.fp8_gemm(qa.data, qb.data, qa.inv_scale, qb.inv_scale, g, b_block128=b_weight,
                                   fast_accum=choice.fast_accum)
        return out if out.dtype == a.dtype else out.to(a.dtype)

    def quantize_weight(self, w: torch.Tensor, choice: GemmChoice) -> tuple[torch.Tensor, torch.Tensor]:
        """The fwd weight as :meth:`gemm_impl` quantizes it: ``(data (N, K), dequantization
        factors)``, 128x128 blocks with MN-major scales for ``block``."""
        blk = choice.granularity == Granularity.BLOCK
        q = quantize_operand(w, choice.b_format, choice.granularity, choice.rounding, is_weight=blk, scale_mn_major=blk)
        return q.data, q.inv_scale

    def static_gemm_impl(self, a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                         choice: GemmChoice) -> torch.Tensor:
        g, r = choice.granularity, choice.rounding
        blk = g == Granularity.BLOCK
        qa = quantize_operand(a, choice.a_format, g, r, is_weight=False, scale_mn_major=blk)  # (m, k)
        out = triton_gemm.fp8_gemm(qa.data, w, qa.inv_scale, w_scale, g, b_block128=blk,
                                   fast_accum=choice.fast_accum)
        return out if out.dtype == a.dtype else out.to(a.dtype)
