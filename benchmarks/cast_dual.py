"""Training with FP8 operands cast by one kernel that writes both layouts: the experiment behind
e2e.py's ``dualcast_tensorwise_filter`` variant (issue 21).

Why: on an H100 at B = 8192 (2026-12-06, ``e2e_static_h100_s27_*``), torchao's tensorwise line
and ours both give back 2.87 ms of the 5.03 ms their FP8 GEMMs save to inductor's quantization
kernels, about 2.6 times what the casts' traffic needs at the card's bandwidth. The FP8 GEMMs of
Hopper take both operands K-major, so each of ``x``, ``w`` and ``dy`` is needed in FP8 in two
layouts (``x`` for the forward and ``x^T`` for wgrad, ``dy`` for dgrad and ``dy^T`` for wgrad,
``w`` for the forward and ``w^T`` for dgrad), and inductor writes the transposed FP8 copies in
kernels of its own (named ``..._scaled_mm_..._t_...``). Here one Triton kernel reads each operand
once and writes both FP8 layouts, the transposed one through a tile transpose (``tl.trans``), as
TransformerEngine's cast-transpose does. The price: the kernel is an opaque op, so inductor can
no longer fuse the cast into the kernel that produces the operand (the operand is written in
bf16 first). Whether the sum pays is what this variant measures before the product grows it.

:class:`DualCastLinear` is an ``nn.Linear`` whose three GEMMs run in e4m3 tensorwise through
``torch._scaled_mm`` with each operand's own amax (the reference scale rule of
:func:`loka_tune.kernels.scaled.cast_to_fp8`, computed by torch ops that inductor may fuse into
the producer), fast accumulation in the forward GEMM only (torchao's tensorwise recipe), and the
casts done by ``torch.ops.loka.cast_dual`` (:mod:`loka_tune.kernels.dualcast`). The forward saves
``x^T`` and ``w^T`` in FP8 (what wgrad and dgrad take).

History: measured on 2026-12-06 (fourth session, ``e2e_dualcast_h100_s28_*``), this module had a
Triton kernel of its own that took contiguous operands only (``x.contiguous()`` first: 5 aten
copies a step, 0.68 ms at B = 8192, most likely strided operands); that kernel then moved into the
product, reading any strides, and this module calls it. The product's own path
(``loka_tune.apply``; e2e's ``scaled_mm_tensorwise_filter``) casts the same way and lets the
kernel read the fp32 weight; this one casts a bf16 copy of it.

Benchmark code, not the product: the product's path is ``loka_tune.apply`` with a config.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from loka_tune.config import Format
from loka_tune.kernels.dualcast import cast_dual_reference as product_reference

__all__ = ["DualCastLinear", "swap_dual", "cast_dual_reference", "cast_dual"]


def cast_dual_reference(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``(R, C)`` times ``scale`` (float32 ``()``), saturated at +-448, in e4m3: the data
    ``(R, C)`` and its transpose ``(C, R)``, both contiguous (the product's reference)."""
    return product_reference(x, scale, Format.E4M3)


def cast_dual(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both e4m3 layouts of ``x`` through the product's ``torch.ops.loka.cast_dual`` (its Triton
    kernel on CUDA: any strides, no copy first; the reference elsewhere)."""
    return torch.ops.loka.cast_dual(x, scale.to(torch.float32).reshape(()), "e4m3")


def _scale(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensorwise multiplier of ``t`` and its dequantization factor, by the product's rule."""
    from loka_tune.kernels.scaled import scale_from_amax as product_scale

    s = product_scale(t.detach().to(torch.float32).abs().amax(), Format.E4M3, False)  # ()
    return s, s.reciprocal()


class _DualFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # x (M, K), w (N, K), one dtype
        sx, x_inv = _scale(x)
        sw, w_inv = _scale(w)
        qx, qxt = cast_dual(x, sx)  # (M, K), (K, M)
        qw, qwt = cast_dual(w, sw)  # (N, K), (K, N)
        y = torch._scaled_mm(qx, qw.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=x.dtype, use_fast_accum=True)
        ctx.save_for_backward(qxt, qwt, x_inv, w_inv)
        ctx.dtypes = (x.dtype, w.dtype)
        return y  # (M, N)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        qxt, qwt, x_inv, w_inv = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        dy = dy.to(x_dtype)
        sg, g_inv = _scale(dy)
        qg, qgt = cast_dual(dy, sg)  # (M, N), (N, M)
        dx = torch._scaled_mm(qg, qwt.t(), scale_a=g_inv, scale_b=w_inv, out_dtype=x_dtype)  # (M, K)
        dw = torch._scaled_mm(qgt, qxt.t(), scale_a=g_inv, scale_b=x_inv, out_dtype=torch.float32)  # (N, K)
        return dx, dw.to(w_dtype)


class DualCastLinear(nn.Linear):
    """``nn.Linear`` in e4m3 tensorwise, each operand cast once into both layouts (module doc)."""

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> "DualCastLinear":
        new = cls(lin.in_features, lin.out_features, lin.bias is not None, device="meta")
        new.weight = lin.weight
        new.bias = lin.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., K) -> (..., N)
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(dtype)  # (M, K)
        with torch.autocast(dev, enabled=False):
            y = _DualFn.apply(x2, self.weight.to(dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)


def swap_dual(model: nn.Module, names: Iterable[str]) -> list[str]:
    """Replace the named ``nn.Linear`` modules of ``model`` by :class:`DualCastLinear` (weights
    shared, in place); returns the names swapped, sorted."""
    wanted = set(names)
    done = []
    for name, mod in list(model.named_modules()):
        if name in wanted and type(mod) is nn.Linear:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, DualCastLinear.from_linear(mod))
            done.append(name)
    missing = wanted - set(done)
    if missing:
        raise ValueError(f"no plain nn.Linear named {sorted(missing)} in the model")
    return sorted(done)
