"""FP8 chains: an MLP of ``linear -> BlockNorm(256) -> Hard Swish`` blocks (and the linear after
it) run as one autograd Function whose norms write the next GEMM's FP8 operands themselves, with
delayed scales (the last call's amax times a margin) and the amax for the next call taken in the
same pass. Measured as a benchmark variant on an H100 (2026-12-07, BENCHMARKS.md, "The FP8 chain on
an H100"): 1.0535x / 1.0544x torchao's tensorwise line on large Wukong at B = 8192, seeds 0 / 1.

Why: with inductor's casts or the dual cast, every FP8 operand is first written in bf16 by its
producer and read back to be cast. Inside a chain the operands between two FP8 GEMMs need no bf16
copy: forward, the next linear's input ``x = hswish(blocknorm(y))`` is read only as FP8, in two
layouts (``x`` for the forward GEMM, ``x^T`` for the wgrad); backward, the previous linear's output
gradient ``dy`` likewise (``dy`` for the dgrad, ``dy^T`` for the wgrad). One Triton kernel does
each: it reads the GEMM output ``y`` (and, backward, the gradient ``g``) once, takes the block
statistics, and writes both FP8 layouts with a delayed scale and an atomic max for the next amax.
The chain's input and the weights are cast by :func:`cast_dual_amax` (both layouts and the amax
in one read). Each GEMM is tensorwise through ``torch._scaled_mm`` (fast accumulation in the
forward only), e4m3 operands with the gradients in e5m2 (:data:`GRAD_FORMAT`): torchao's tensorwise recipe.

The Triton kernels saturate with ``tl.where``: saturated with ``tl.minimum`` / ``tl.maximum``,
values stored transposed in FP8 came out wrong on an H100 under Triton 3.6 in every tile tried
(``benchmarks/results/chain_qt_ab_h100_s33d.json``, by ``benchmarks/chain_qt_ab.py`` at commit 9068faf;
triton-lang/triton#11111). The norm kernels' ``eps`` is a
constexpr: inductor types a Python float argument fp64, whose square root Triton 3.6 failed to
lower. ``triton`` is imported on the first launch only; the ops (``torch.ops.loka.chain_*``,
``torch.library.triton_op`` s, which inductor launches from its own code) are registered outside
any trace, by :class:`ChainMLP`'s constructor. Where no kernel can run (a CPU tensor, unless
``TRITON_INTERPRET=1`` in eager mode) the torch references run instead.

:func:`loka_tune.apply` makes the chains under the ``fp8_chain`` Mod (:func:`swap_chain` on each
MLP a model names); ``TrainStep`` calibrates them before its first step. ``benchmarks/fp8_chain.py``
and ``benchmarks/delayed_scales.py`` (e2e.py's ``chain_tensorwise_filter`` and
``delayed_dualcast_tensorwise_filter``) use it too.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import torch
from torch import nn

__all__ = ["ChainMLP", "FP8Chain", "FoldedTail", "swap_chain", "unchain", "calibrate", "cast_dual_amax", "cast_dual_amax_reference",
           "norm_fwd_cast", "norm_bwd_cast", "norm_fwd_cast_reference", "norm_bwd_cast_reference",
           "prepare_kernels", "chain_start", "BLOCK", "MARGIN", "E4M3", "E5M2", "FMAX", "GRAD_FORMATS",
           "GRAD_FORMAT"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FMAX = float(torch.finfo(E4M3).max)  # 448
#: the formats a chain may cast its gradients (``dy``) to: e4m3 (this package's ``tensorwise``
#: recipe) or e5m2 (torchao's tensorwise recipe casts grad_output to e5m2: 14 more binades of range
#: below the scale's amax, one mantissa bit less)
GRAD_FORMATS: dict[str, torch.dtype] = {"e4m3": E4M3, "e5m2": E5M2}
#: the chains' gradient format unless told otherwise: e5m2. Large Wukong at B = 32768, seed 0, on an
#: H100 (2026-12-07, BENCHMARKS.md, "The B = 8192 study with the fp8_chain Mod"): e4m3 gradients
#: ended +0.83% / +0.88% in eval log loss over bf16 + Mods (two runs), e5m2 +0.39%, at the same step
#: time (109.6 ms); the amax trace showed one step where dense_mlp's dy grew 54x over its delayed
#: scale. A delayed scale's amax is the batch's largest gradient, which grows with the batch while
#: the typical one does not: e5m2's range keeps the small ones that e4m3 flushes to zero
GRAD_FORMAT = "e5m2"
_TINY = FMAX / float(torch.finfo(torch.float32).max)
#: headroom of a delayed scale over the amax it was taken from (an operand may grow by up to this
#: factor from one step to the next before its largest values saturate)
MARGIN = 2.0


def _fmax(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)  # e4m3 448, e5m2 57344


def _multiplier(amax: torch.Tensor, margin: float, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """``fmax / (margin * amax)`` (float32 ``()``; ``fmax`` of ``dtype``), ``1`` for a zero amax
    (scalar ops, inlined into the kernel that casts)."""
    a = amax.to(torch.float32) * margin
    return torch.where(a > 0, _fmax(dtype) / a.clamp(min=_TINY), torch.ones_like(a))



# ------------------------------------------------------------------ both layouts and the amax, one pass
def cast_dual_amax_reference(x: torch.Tensor, scale: torch.Tensor, via: torch.dtype | None = None,
                             out: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` ``(R, C)`` rounded through ``via`` (None: not), times ``scale`` (float32, one element),
    saturated at ``out``'s largest value (e4m3 +-448, e5m2 +-57344) in ``out``: ``(data (R, C),
    data_t (C, R), amax (1,))``, both layouts contiguous, ``amax`` the float32 max of ``|x|``
    after the rounding (what the next step's scale is taken from)."""
    xf = (x if via is None else x.to(via)).to(torch.float32)
    q = (xf * scale.reshape(())).clamp(-_fmax(out), _fmax(out)).to(out)  # (R, C)
    return q.contiguous(), q.t().contiguous(), xf.abs().amax().reshape(1)


@lru_cache(maxsize=1)
def _kernel() -> Any:
    """The Triton kernel (``triton`` imported on first use only)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _fp8cast_dual_amax_kernel(x_ptr, s_ptr, y_ptr, yt_ptr, amax_ptr, R, C, sxr, sxc, VIA: tl.constexpr,
                              BR: tl.constexpr, BC: tl.constexpr, E5: tl.constexpr = False):
        # one (BR, BC) tile of x (any strides): both FP8 layouts (e4m3; E5: e5m2) and an atomic max of
        # |x| (VIA 1: rounded through bfloat16 first, the compute dtype of an fp32 master weight)
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        m = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sxr + cols[None, :].to(tl.int64) * sxc, mask=m, other=0.0)
        if VIA == 1:
            xf = x.to(tl.bfloat16).to(tl.float32)
        else:
            xf = x.to(tl.float32)
        scale = tl.load(s_ptr)
        # saturated with tl.where, not tl.minimum / tl.maximum: clamped that way, a transposed FP8
        # store wrote wrong bytes on an H100 under Triton 3.6 (fp8_chain's A/B, 2026-12-07;
        # triton-lang/triton#11111); NaN stays NaN, as torch's clamp
        # (the e4m3 branch is the form the GPU checked bit for bit; E5 repeats it with e5m2's bound and an
        # explicit rounding, which Triton asks of an fp32 -> e5m2 cast: to nearest even, as torch's)
        if E5:
            v = xf * scale
            q = tl.where(v > 57344.0, 57344.0, tl.where(v < -57344.0, -57344.0, v)).to(tl.float8e5,
                                                                                     fp_downcast_rounding="rtne")
            tl.store(y_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], q, mask=m)
            mt = (cols[:, None] < C) & (rows[None, :] < R)
            vt = tl.trans(xf) * scale
            qt = tl.where(vt > 57344.0, 57344.0, tl.where(vt < -57344.0, -57344.0, vt)).to(tl.float8e5,
                                                                                          fp_downcast_rounding="rtne")
            tl.store(yt_ptr + cols[:, None].to(tl.int64) * R + rows[None, :], qt, mask=mt)
        else:
            v = xf * scale
            q = tl.where(v > 448.0, 448.0, tl.where(v < -448.0, -448.0, v)).to(tl.float8e4nv)
            tl.store(y_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], q, mask=m)
            mt = (cols[:, None] < C) & (rows[None, :] < R)
            vt = tl.trans(xf) * scale
            qt = tl.where(vt > 448.0, 448.0, tl.where(vt < -448.0, -448.0, vt)).to(tl.float8e4nv)
            tl.store(yt_ptr + cols[:, None].to(tl.int64) * R + rows[None, :], qt, mask=mt)
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(xf), axis=1), axis=0))  # |x| >= 0: float max is int max

    return triton, _fp8cast_dual_amax_kernel


def _launch(x: torch.Tensor, scale: torch.Tensor, via: str, wrap: Callable[[Any], Any] | None, e5m2: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    triton, kernel = _kernel()
    r, c = x.shape
    out = E5M2 if e5m2 else E4M3
    y = torch.empty((r, c), device=x.device, dtype=out)
    yt = torch.empty((c, r), device=x.device, dtype=out)
    amax = torch.zeros(1, device=x.device, dtype=torch.float32)
    if r and c:
        bc = min(128, max(16, triton.next_power_of_2(c)))  # the tile of the dual cast (kernels/dualcast.py)
        br = min(512, max(128, 16384 // bc))
        k = kernel if wrap is None else wrap(kernel)
        k[(triton.cdiv(r, br), triton.cdiv(c, bc))](x, scale.reshape(1).to(torch.float32), y, yt, amax, r, c,
                                                    x.stride(0), x.stride(1), VIA=1 if via == "bfloat16" else 0,
                                                    BR=br, BC=bc, E5=e5m2, num_warps=8)
    return y, yt, amax


def prepare_cast_kernel() -> None:
    """Register ``torch.ops.loka.chain_cast_dual_amax`` (the kernel as a ``torch.library.triton_op``,
    which inductor launches from its own generated code, as ``loka::cast_dual_inline``)
    once per process, outside any trace; registering does not import triton (launching does)."""
    try:
        torch.ops.loka.chain_cast_dual_amax  # noqa: B018
    except (AttributeError, RuntimeError):
        def cast_dual_amax_op(x: torch.Tensor, scale: torch.Tensor, via: str, e5m2: bool
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return _launch(x, scale, via, torch.library.wrap_triton, e5m2)

        torch.library.triton_op("loka::chain_cast_dual_amax", cast_dual_amax_op, mutates_args=())


def _kernel_op(x: torch.Tensor) -> Any:
    """The kernel's op where it runs for ``x`` (CUDA; the CPU under ``TRITON_INTERPRET=1``, eagerly),
    else None (the reference). Inside a trace only ``x.is_cuda`` is read: the op is registered
    by :class:`ChainMLP`'s constructor (or :func:`prepare_cast_kernel`) before any trace."""
    if not x.is_cuda and (torch.compiler.is_compiling() or os.environ.get("TRITON_INTERPRET") != "1"):
        return None
    if not torch.compiler.is_compiling():
        prepare_cast_kernel()
    return torch.ops.loka.chain_cast_dual_amax


def cast_dual_amax(x: torch.Tensor, scale: torch.Tensor, via: torch.dtype | None = None,
                   out: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`cast_dual_amax_reference` in one Triton kernel where it can run (CUDA; the CPU under
    ``TRITON_INTERPRET=1``), the reference elsewhere. ``via``: None or ``torch.bfloat16``; ``out``:
    ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``."""
    if x.dim() != 2:
        raise ValueError(f"cast_dual_amax takes a 2-D operand (rows, cols), got shape {tuple(x.shape)}")
    if via not in (None, torch.bfloat16):
        raise ValueError(f"cast_dual_amax rounds through bfloat16 or nothing, got via={via}")
    if out not in (E4M3, E5M2):
        raise ValueError(f"cast_dual_amax writes float8_e4m3fn or float8_e5m2, got out={out}")
    op = _kernel_op(x)
    if op is None:
        return cast_dual_amax_reference(x, scale, via, out)
    return op(x, scale, "bfloat16" if via is not None else "", out == E5M2)


BLOCK = 256  #: the BlockNorm width this chain's kernels take (the Mods' ``blocknorm = 256``)


# ------------------------------------------------------------------ references (torch, fp32 math)
def _hswish(z: torch.Tensor) -> torch.Tensor:
    return z * (z + 3.0).clamp(0.0, 6.0) / 6.0


def _hswish_grad(z: torch.Tensor) -> torch.Tensor:
    """d hardswish / dz as aten's backward: 0 below -3, z / 3 + 1/2 up to 3 (inclusive), 1 above."""
    return torch.where(z < -3.0, torch.zeros_like(z), torch.where(z <= 3.0, z / 3.0 + 0.5, torch.ones_like(z)))


def _q(t: torch.Tensor, scale: torch.Tensor, out: torch.dtype = E4M3) -> torch.Tensor:
    return (t * scale.reshape(())).clamp(-_fmax(out), _fmax(out)).to(out)


def norm_fwd_cast_reference(y: torch.Tensor, scale: torch.Tensor | None, eps: float, act: bool = True, out_bf16: bool = False
                            ) -> tuple[torch.Tensor, ...]:
    """``x = hswish(blocknorm(y))`` (blocks of 256 along the last dim; ``act`` False: the norm only)
    of ``y`` ``(M, N)``, in fp32 math: ``(qx (M, N), qx_t (N, M), rstd (M, N / 256), amax (1,))``;
    with ``out_bf16`` (the chain's last output, which leaves it in bf16) ``(rstd, x)``, ``x`` in
    ``y``'s dtype, and ``scale`` unused (None allowed)."""
    m, n = y.shape
    yf = y.float().view(m, n // BLOCK, BLOCK)
    rstd = torch.rsqrt(yf.square().mean(-1) + eps)  # (M, N / 256)
    z = yf * rstd[..., None]
    x = (_hswish(z) if act else z).reshape(m, n)
    if out_bf16:
        return rstd, x.to(y.dtype)
    assert scale is not None, "an FP8 output needs its scale"
    q = _q(x, scale)
    return q, q.t().contiguous(), rstd, x.abs().amax().reshape(1)


def norm_bwd_cast_reference(g: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, scale: torch.Tensor, act: bool = True,
                            out: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradient at ``y`` of ``hswish(blocknorm(y))`` given ``g`` at its output, both ``(M, N)``:
    ``dy = rstd * (gz - z * mean(gz * z))`` per block, ``z = y * rstd``, ``gz = g * hswish'(z)``;
    returns ``(qdy (M, N), qdy_t (N, M), amax (1,))``, ``qdy`` in ``out`` (e4m3 or e5m2)."""
    m, n = y.shape
    z = y.float().view(m, n // BLOCK, BLOCK) * rstd[..., None]
    gz = g.float().view(m, n // BLOCK, BLOCK)
    if act:
        gz = gz * _hswish_grad(z)
    dy = (rstd[..., None] * (gz - z * (gz * z).mean(-1, keepdim=True))).reshape(m, n)
    q = _q(dy, scale, out)
    return q, q.t().contiguous(), dy.abs().amax().reshape(1)


# ------------------------------------------------------------------ Triton kernels (imported on first use)
@lru_cache(maxsize=1)
def _kernels() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def _fp8cast_norm_fwd_kernel(y_ptr, s_ptr, q_ptr, qt_ptr, rstd_ptr, amax_ptr, x_ptr, M, N, NB, EPS: tl.constexpr,
                        ACT: tl.constexpr, OUT: tl.constexpr, BR: tl.constexpr, BLK: tl.constexpr):
        # one (BR, BLK) tile: BR rows of one norm block of BLK features
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        blk = tl.program_id(1)
        cols = blk * BLK + tl.arange(0, BLK)
        rm = rows < M
        m = rm[:, None]
        at = rows[:, None].to(tl.int64) * N + cols[None, :]
        yf = tl.load(y_ptr + at, mask=m, other=0.0).to(tl.float32)
        # EPS a constexpr: as a runtime argument inductor types a Python float fp64, and Triton
        # 3.6 fails to lower the fp64 square root (make_llir's PassManager, 2026-12-07, H100)
        r = 1.0 / tl.sqrt(tl.sum(yf * yf, axis=1) / BLK + EPS)  # (BR,)
        tl.store(rstd_ptr + rows.to(tl.int64) * NB + blk, r, mask=rm)
        x = yf * r[:, None]
        if ACT:  # Hard Swish
            x = x * tl.minimum(tl.maximum(x + 3.0, 0.0), 6.0) / 6.0
        if OUT:  # the chain's output: bf16 only
            tl.store(x_ptr + at, x.to(x_ptr.dtype.element_ty), mask=m)
        else:
            scale = tl.load(s_ptr)
            q8 = tl.minimum(tl.maximum(x * scale, -448.0), 448.0).to(tl.float8e4nv)
            tl.store(q_ptr + at, q8, mask=m)
            # the transposed copy (N, M), saturated with tl.where: saturated with tl.minimum /
            # tl.maximum, it came out wrong on an H100 (Triton 3.6.0) in every tile tried (2026-12-07,
            # benchmarks/results/chain_qt_ab_h100_s33d.json; triton-lang/triton#11111)
            vt = tl.trans(x) * scale
            vt = tl.where(vt > 448.0, 448.0, tl.where(vt < -448.0, -448.0, vt))
            tl.store(qt_ptr + cols[:, None].to(tl.int64) * M + rows[None, :], vt.to(tl.float8e4nv), mask=rm[None, :])
            tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))

    @triton.jit
    def _fp8cast_norm_bwd_kernel(g_ptr, y_ptr, rstd_ptr, s_ptr, q_ptr, qt_ptr, amax_ptr, M, N, NB,
                        ACT: tl.constexpr, BR: tl.constexpr, BLK: tl.constexpr, E5: tl.constexpr = False):
        # E5: dy in e5m2 (saturated at +-57344), else e4m3
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        blk = tl.program_id(1)
        cols = blk * BLK + tl.arange(0, BLK)
        rm = rows < M
        m = rm[:, None]
        at = rows[:, None].to(tl.int64) * N + cols[None, :]
        yf = tl.load(y_ptr + at, mask=m, other=0.0).to(tl.float32)
        gz = tl.load(g_ptr + at, mask=m, other=0.0).to(tl.float32)
        r = tl.load(rstd_ptr + rows.to(tl.int64) * NB + blk, mask=rm, other=0.0)  # (BR,)
        z = yf * r[:, None]
        if ACT:
            d = tl.where(z < -3.0, 0.0, tl.where(z <= 3.0, z / 3.0 + 0.5, 1.0))
            gz = gz * d
        mean = tl.sum(gz * z, axis=1) / BLK  # (BR,)
        dy = r[:, None] * (gz - z * mean[:, None])
        scale = tl.load(s_ptr)
        # the transposed copy (N, M), saturated with tl.where: saturated with tl.minimum /
        # tl.maximum, it came out wrong on an H100 (Triton 3.6.0) in every tile tried (2026-12-07,
        # benchmarks/results/chain_qt_ab_h100_s33d.json; triton-lang/triton#11111). The e4m3 branch
        # is the form the GPU checked; E5 repeats it with e5m2's bound and an explicit rounding
        # (Triton asks one of an fp32 -> e5m2 cast: to nearest even, as torch's). The repeat, and the
        # forward kernel's copy, stay written out: one jitted helper for the three changed the sm_90
        # PTX of the checked form (2026-12-07), which only a GPU run could clear again
        if E5:
            q8 = tl.minimum(tl.maximum(dy * scale, -57344.0), 57344.0).to(tl.float8e5, fp_downcast_rounding="rtne")
            tl.store(q_ptr + at, q8, mask=m)
            vt = tl.trans(dy) * scale
            vt = tl.where(vt > 57344.0, 57344.0, tl.where(vt < -57344.0, -57344.0, vt))
            tl.store(qt_ptr + cols[:, None].to(tl.int64) * M + rows[None, :],
                     vt.to(tl.float8e5, fp_downcast_rounding="rtne"), mask=rm[None, :])
        else:
            q8 = tl.minimum(tl.maximum(dy * scale, -448.0), 448.0).to(tl.float8e4nv)
            tl.store(q_ptr + at, q8, mask=m)
            vt = tl.trans(dy) * scale
            vt = tl.where(vt > 448.0, 448.0, tl.where(vt < -448.0, -448.0, vt))
            tl.store(qt_ptr + cols[:, None].to(tl.int64) * M + rows[None, :], vt.to(tl.float8e4nv), mask=rm[None, :])
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(dy), axis=1), axis=0))

    return triton, _fp8cast_norm_fwd_kernel, _fp8cast_norm_bwd_kernel


_BR = 32  # rows a tile: 32 x 256 fp32 values, 32-byte runs in the transposed stores
_WARPS = 4


def _fwd_launch(y: torch.Tensor, scale: torch.Tensor, eps: float, act: bool, out_bf16: bool,
                wrap: Callable[[Any], Any] | None) -> tuple[torch.Tensor, ...]:
    triton, kf, _ = _kernels()
    m, n = y.shape
    nb = n // BLOCK
    fp8 = (1, 1) if out_bf16 else (m, n)  # placeholders where the kernel writes no FP8
    q = torch.empty(fp8, device=y.device, dtype=E4M3)
    qt = torch.empty(fp8[::-1], device=y.device, dtype=E4M3)
    rstd = torch.empty((m, nb), device=y.device, dtype=torch.float32)
    amax = torch.zeros(1, device=y.device, dtype=torch.float32)
    x = torch.empty((m, n) if out_bf16 else (1,), device=y.device, dtype=y.dtype)
    if m and n:
        k = kf if wrap is None else wrap(kf)
        k[(triton.cdiv(m, _BR), nb)](y, scale.reshape(1).to(torch.float32), q, qt, rstd, amax, x, m, n, nb, EPS=float(eps),
                                     ACT=act, OUT=out_bf16, BR=_BR, BLK=BLOCK, num_warps=_WARPS)
    return (rstd, x) if out_bf16 else (q, qt, rstd, amax)


def _bwd_launch(g: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, scale: torch.Tensor, act: bool,
                wrap: Callable[[Any], Any] | None, e5m2: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    triton, _, kb = _kernels()
    m, n = y.shape
    nb = n // BLOCK
    out = E5M2 if e5m2 else E4M3
    q = torch.empty((m, n), device=y.device, dtype=out)
    qt = torch.empty((n, m), device=y.device, dtype=out)
    amax = torch.zeros(1, device=y.device, dtype=torch.float32)
    if m and n:
        k = kb if wrap is None else wrap(kb)
        k[(triton.cdiv(m, _BR), nb)](g.contiguous(), y, rstd, scale.reshape(1).to(torch.float32), q, qt, amax, m, n, nb,
                                     ACT=act, BR=_BR, BLK=BLOCK, E5=e5m2, num_warps=_WARPS)
    return q, qt, amax


def prepare_kernels() -> None:
    """Register the kernels as ``torch.library.triton_op`` s (inductor launches them from its own
    code) once per process, outside any trace; registering does not import triton."""
    try:
        torch.ops.loka.chain_norm_bwd_cast  # noqa: B018
    except (AttributeError, RuntimeError):
        def fwd(y: torch.Tensor, scale: torch.Tensor, eps: float, act: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            q, qt, rstd, amax = _fwd_launch(y, scale, eps, act, False, torch.library.wrap_triton)
            return q, qt, rstd, amax

        def fwd_out(y: torch.Tensor, eps: float, act: bool) -> tuple[torch.Tensor, torch.Tensor]:
            rstd, x = _fwd_launch(y, torch.ones(1, device=y.device), eps, act, True, torch.library.wrap_triton)
            return rstd, x

        def bwd(g: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, scale: torch.Tensor, act: bool, e5m2: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return _bwd_launch(g, y, rstd, scale, act, torch.library.wrap_triton, e5m2)

        torch.library.triton_op("loka::chain_norm_fwd_cast", fwd, mutates_args=())
        torch.library.triton_op("loka::chain_norm_fwd_out", fwd_out, mutates_args=())
        torch.library.triton_op("loka::chain_norm_bwd_cast", bwd, mutates_args=())


def _kernel_ops(t: torch.Tensor) -> Any:
    """(fwd, fwd_out, bwd) ops where the kernels run for ``t`` (CUDA; the CPU under
    ``TRITON_INTERPRET=1``, eagerly), else None (the references)."""
    if not t.is_cuda and (torch.compiler.is_compiling() or os.environ.get("TRITON_INTERPRET") != "1"):
        return None
    if not torch.compiler.is_compiling():
        prepare_kernels()
    ops = torch.ops.loka
    return ops.chain_norm_fwd_cast, ops.chain_norm_fwd_out, ops.chain_norm_bwd_cast


def _check(y: torch.Tensor, what: str) -> None:
    if y.dim() != 2 or y.shape[1] % BLOCK:
        raise ValueError(f"{what} takes (rows, features) with features a multiple of {BLOCK}, got {tuple(y.shape)}")


def norm_fwd_cast(y: torch.Tensor, scale: torch.Tensor | None, eps: float, act: bool = True, out_bf16: bool = False
                  ) -> tuple[torch.Tensor, ...]:
    """:func:`norm_fwd_cast_reference` in one Triton kernel where it can run (CUDA; the CPU under
    ``TRITON_INTERPRET=1``), the reference elsewhere."""
    _check(y, "norm_fwd_cast")
    y = y.contiguous()
    ops = _kernel_ops(y)
    if ops is None:
        return norm_fwd_cast_reference(y, scale, eps, act, out_bf16)
    if out_bf16:
        return tuple(ops[1](y, float(eps), act))
    assert scale is not None, "an FP8 output needs its scale"
    return tuple(ops[0](y, scale, float(eps), act))


def norm_bwd_cast(g: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, scale: torch.Tensor, act: bool = True,
                  out: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`norm_bwd_cast_reference` in one Triton kernel where it can run, the reference elsewhere."""
    _check(y, "norm_bwd_cast")
    if out not in (E4M3, E5M2):
        raise ValueError(f"norm_bwd_cast writes float8_e4m3fn or float8_e5m2, got out={out}")
    ops = _kernel_ops(y)
    if ops is None:
        return norm_bwd_cast_reference(g, y, rstd, scale, act, out)
    q, qt, amax = ops[2](g.contiguous(), y.contiguous(), rstd, scale, act, out == E5M2)
    return q, qt, amax


# ------------------------------------------------------------------ the chain's autograd
def _own(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().abs().amax()


class FP8Chain(torch.autograd.Function):
    """``x0 -> [GEMM_i -> BlockNorm -> Hard Swish] * n (-> GEMM_tail)`` with FP8 operands throughout.

    ``amax``: float32 ``(3 L,)`` buffer for ``L`` GEMMs, the delayed amaxes: ``[x_0, w_0 .. w_{L-1},
    x_1 .. x_{L-1}, dy_0 .. dy_{L-1}]`` (``x_i`` the input of GEMM ``i``, ``dy_i`` the gradient at
    its output), rewritten by every call with this call's values. ``own``: every scale from the operand's own amax
    instead (calibration, eagerly). ``grad_e5m2``: the gradients ``dy`` in e5m2 (else e4m3)."""

    @staticmethod
    def forward(ctx: Any, x0: torch.Tensor, amax: torch.Tensor, eps: float, margin: float, tail: bool, own: bool,
                grad_e5m2: bool, *weights: torch.Tensor) -> torch.Tensor:
        L = len(weights)
        dtype = x0.dtype
        iw, ix = 1, 1 + L  # offsets into amax: w_i, then x_{i+1} (the norms' outputs)

        def scale(i: int, now: torch.Tensor | None) -> torch.Tensor:
            return _multiplier(now, 1.0) if own and now is not None else _multiplier(amax[i], margin)

        new = []
        s0 = scale(0, _own(x0) if own else None)
        qx, qxt, a0 = cast_dual_amax(x0, s0)
        new.append((0, a0))
        inv_x = [s0.reciprocal()]
        saved_xt, saved_wt, inv_w, ys, rstds = [qxt], [], [], [], []
        out = x0
        for i, w in enumerate(weights):
            sw = scale(iw + i, _own(w.to(dtype)) if own else None)
            qw, qwt, aw = cast_dual_amax(w, sw, via=dtype if w.dtype != dtype else None)  # (N, K), (K, N)
            new.append((iw + i, aw))
            inv_w.append(sw.reciprocal())
            saved_wt.append(qwt)
            y = torch._scaled_mm(qx, qw.t(), scale_a=inv_x[-1], scale_b=inv_w[-1], out_dtype=dtype, use_fast_accum=True)
            last = i == L - 1
            if last and tail:
                out = y  # the tail linear's output: no norm after it
                break
            ys.append(y)
            if last:  # the chain's output: the norm and Hard Swish in bf16 (no FP8 needed)
                rstd, out = norm_fwd_cast(y, None, eps, True, True)
                rstds.append(rstd)
                break
            if own:
                _, _, _, a_now = norm_fwd_cast(y, torch.ones((), device=y.device), eps)
                sx = _multiplier(a_now.reshape(()), 1.0)
            else:
                sx = _multiplier(amax[ix + i], margin)
            qx, qxt, rstd, ax = norm_fwd_cast(y, sx, eps)  # the next GEMM's input, both layouts
            new.append((ix + i, ax))
            rstds.append(rstd)
            inv_x.append(sx.reciprocal())
            saved_xt.append(qxt)
        for i, a in new:
            amax[i].copy_(a.reshape(()))
        ctx.save_for_backward(*saved_xt, *saved_wt, *ys, *rstds, *inv_x, *inv_w)
        ctx.meta = (L, tail, own, margin, [w.dtype for w in weights], dtype, E5M2 if grad_e5m2 else E4M3)
        ctx.amax = amax
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        L, tail, own, margin, w_dtypes, dtype, gd = ctx.meta
        amax = ctx.amax
        idy = 2 * L  # offset of dy_i in amax
        sv = list(ctx.saved_tensors)
        n_norm = L - 1 if tail else L
        xt, wt = sv[:L], sv[L:2 * L]
        ys = sv[2 * L:2 * L + n_norm]
        rstds = sv[2 * L + n_norm:2 * L + 2 * n_norm]
        inv_x = sv[2 * L + 2 * n_norm:3 * L + 2 * n_norm]
        inv_w = sv[3 * L + 2 * n_norm:]
        g = g.to(dtype)
        dws: list[torch.Tensor] = [torch.empty(0)] * L
        new = []
        for i in reversed(range(L)):
            if i == L - 1 and tail:  # the tail's output gradient arrives in bf16: one kernel, both layouts
                sg = _multiplier(_own(g), 1.0, gd) if own else _multiplier(amax[idy + i], margin, gd)
                qg, qgt, ag = cast_dual_amax(g, sg, out=gd)
            else:
                if own:
                    _, _, a_now = norm_bwd_cast(g, ys[i], rstds[i], torch.ones((), device=g.device))
                    sg = _multiplier(a_now.reshape(()), 1.0, gd)
                else:
                    sg = _multiplier(amax[idy + i], margin, gd)
                qg, qgt, ag = norm_bwd_cast(g, ys[i], rstds[i], sg, out=gd)  # dy_i from g (the gradient at x_{i+1})
            new.append((idy + i, ag))
            g_inv = sg.reciprocal()
            dws[i] = torch._scaled_mm(qgt, xt[i].t(), scale_a=g_inv, scale_b=inv_x[i], out_dtype=torch.float32).to(w_dtypes[i])
            g = torch._scaled_mm(qg, wt[i].t(), scale_a=g_inv, scale_b=inv_w[i], out_dtype=dtype)  # (M, K_i)
        for i, a in new:
            amax[i].copy_(a.reshape(()))
        return (g, None, None, None, None, None, None, *dws)


class ChainMLP(nn.Sequential):
    """An MLP of ``linear -> BlockNorm(256) -> Hard Swish`` blocks (and optionally the linear that
    follows it, ``tail``) run as one :class:`FP8Chain`.

    It is an ``nn.Sequential`` over the same block modules at the same indices, so a model's state
    dict keeps its keys (``mlp.0.linear.weight``, ...); the ``start`` leading blocks that cannot join
    the chain (e.g. a first linear whose K is not a multiple of 16) run as they are, in front of
    it. ``tail`` is not registered here: its owner keeps its weight under its own name, through a
    :class:`FoldedTail` (see :func:`swap_chain`). ``amax``: the chain's delayed amaxes (a buffer
    left out of state dicts). Until it is calibrated (:func:`calibrate`, or its own first call in
    training) each operand is cast with its own amax, which fills ``amax``; from then on with the
    last call's. ``grad_format``: ``"e5m2"`` (the default, :data:`GRAD_FORMAT`) or ``"e4m3"`` for the
    gradients ``dy`` (an attribute read at each call)."""

    def __init__(self, blocks: Sequence[nn.Module], tail: nn.Linear | None = None, *, margin: float = MARGIN,
                 start: int = 0, grad_format: str = GRAD_FORMAT) -> None:
        if not blocks:
            raise ValueError("a chain needs at least one linear -> BlockNorm -> Hard Swish block")
        if grad_format not in GRAD_FORMATS:
            raise ValueError(f"grad_format={grad_format!r}: a chain casts its gradients to one of "
                             f"{sorted(GRAD_FORMATS)}")
        if not (math.isfinite(margin) and margin >= 1.0):
            raise ValueError(f"margin={margin!r}: a delayed scale's margin is a factor >= 1.0")
        if not 0 <= start < len(blocks):
            raise ValueError(f"start={start}: the chain needs at least one of the {len(blocks)} block(s)")
        eps = None
        for j, b in enumerate(blocks[start:], start):
            lin, norm, act = getattr(b, "linear", None), getattr(b, "norm", None), getattr(b, "act", None)
            why = _why_not(lin, norm, act)
            if why:
                raise ValueError(f"block {j} cannot join an FP8 chain: {why}")
            e = norm.eps  # type: ignore[union-attr]
            if eps is not None and e != eps:
                raise ValueError(f"block {j}: BlockNorm eps {e!r} differs from the chain's {eps!r}")
            eps = e
        if tail is not None and (type(tail) is not nn.Linear or tail.bias is not None or tail.in_features % 16
                                 or tail.out_features % 16):
            raise ValueError(f"the tail must be a bias-free nn.Linear with both dims multiples of 16, got {tail!r}")
        super().__init__(*blocks)
        self.start = start
        self._tail: list[nn.Linear] = [tail] if tail is not None else []  # a list: not registered as a submodule
        self.eps = float(torch.finfo(torch.bfloat16).eps if eps is None else eps)
        self.margin = float(margin)
        self.grad_format = grad_format
        self.own_scales = False
        self._calibrated = False
        prepare_kernels()
        prepare_cast_kernel()
        n = len(blocks) - start + (tail is not None)
        dev = next(blocks[start].parameters()).device
        self.amax: torch.Tensor
        self.register_buffer("amax", torch.zeros(3 * n, device=dev), persistent=False)  # see FP8Chain

    @property
    def blocks(self) -> list[nn.Module]:
        """The blocks in the chain (after the ``start`` leading ones)."""
        return list(self)[self.start:]

    @property
    def tail(self) -> nn.Linear | None:
        return self._tail[0] if self._tail else None

    @property
    def weights(self) -> list[torch.Tensor]:
        ws: list[torch.Tensor] = [b.get_submodule("linear").weight for b in self.blocks]  # type: ignore[misc]
        tail = self.tail
        return ws + ([tail.weight] if tail is not None else [])

    @property
    def calibrated(self) -> bool:
        return self._calibrated

    def _apply(self, fn: Any, recurse: bool = True) -> "ChainMLP":
        # .to() / .cuda() / .half() reach the unregistered tail too: built alone, a chain would
        # otherwise leave its tail's weight behind (on the GPU, _scaled_mm then refused its CPU
        # operand, 2026-12-07). Inside a model the tail's weight is its FoldedTail's parameter,
        # which the model's conversion converts in place; converting it twice is a no-op. The amaxes stay
        # float32 whatever the weights' dtype (the kernels take fp32 amaxes and scales).
        super()._apply(fn, recurse)
        if self.amax.dtype != torch.float32:
            self.amax = self.amax.float()
        tail = self.tail
        if tail is not None and recurse:
            tail._apply(fn)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., K0) -> (..., N_last)
        for b in list(self)[:self.start]:
            x = b(x)
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        lead = x.shape[:-1]
        own = self.own_scales or not self._calibrated
        with torch.autocast(dev, enabled=False):
            out = FP8Chain.apply(x.reshape(-1, x.shape[-1]).to(dtype), self.amax, self.eps, self.margin,
                                 self.tail is not None, own, self.grad_format == "e5m2", *self.weights)
        if not self._calibrated and torch.is_grad_enabled() and out.requires_grad:
            self._calibrated = True  # this call's backward fills the gradients' amaxes
        return out.reshape(*lead, out.shape[-1])


class FoldedTail(nn.Module):
    """Where a chain's tail linear was: the same ``weight`` parameter under the same name (state
    dicts and optimizers see it as before), and the identity in forward (the chain ran the GEMM).
    :func:`unchain` puts the linear back."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self._linear = [linear]  # not registered

    @property
    def linear(self) -> nn.Linear:
        return self._linear[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        lin = self.linear
        return f"in_features={lin.in_features}, out_features={lin.out_features}, folded into the chain before it"


def _why_not(lin: Any, norm: Any, act: Any) -> str:
    from loka_tune.layers import BlockNorm

    if type(lin) is not nn.Linear or lin.bias is not None:
        return "its linear is not a bias-free nn.Linear (apply the No Bias Mod first)"
    if lin.in_features % 16 or lin.out_features % 16:
        return f"FP8 GEMMs take dims that are multiples of 16, got {lin.in_features} x {lin.out_features}"
    if not isinstance(norm, BlockNorm) or norm.block != BLOCK or norm.weight is not None:
        return f"its norm is not a parameter-free BlockNorm({BLOCK}) (got {type(norm).__name__})"
    if lin.out_features % BLOCK:
        return f"its width {lin.out_features} is not a multiple of the norm block {BLOCK}"
    if not isinstance(act, nn.Hardswish):
        return f"its activation is not Hard Swish (got {type(act).__name__})"
    return ""


def chain_start(seq: nn.Sequential) -> tuple[int | None, str]:
    """The index of the first block of ``seq`` that can join an FP8 chain (those after it must
    too), or ``(None, why)``."""
    blocks = list(seq)
    whys = [_why_not(getattr(b, "linear", None), getattr(b, "norm", None), getattr(b, "act", None)) for b in blocks]
    start = next((j for j, w in enumerate(whys) if not w), None)
    if start is None:
        return None, f"no block can join an FP8 chain: {whys[0]}"
    late = next((j for j in range(start, len(blocks)) if whys[j]), None)
    if late is not None:
        return None, f"block {late} cannot join the chain after block {start}: {whys[late]}"
    return start, ""


def swap_chain(model: nn.Module, mlp: str, tail: str | None = None, *, margin: float = MARGIN) -> list[str]:
    """Replace the MLP (an ``nn.Sequential`` of blocks) named ``mlp`` by a :class:`ChainMLP` over the
    same blocks, chained from the first that can join (those before it run in front, as they
    are), with ``tail`` (a linear that takes the MLP's output, replaced by a :class:`FoldedTail`)
    as its last GEMM; returns the linears' names now in the chain. :func:`unchain` undoes it."""
    seq = model.get_submodule(mlp)
    if isinstance(seq, ChainMLP):
        raise ValueError(f"{mlp!r} is an FP8 chain already (unchain the model first)")
    if not isinstance(seq, nn.Sequential) or len(seq) == 0:
        raise ValueError(f"{mlp!r} is not a non-empty nn.Sequential of MLP blocks")
    blocks = list(seq)
    start = next((j for j, b in enumerate(blocks) if not _why_not(getattr(b, "linear", None), getattr(b, "norm", None),
                                                                    getattr(b, "act", None))), None)
    if start is None:
        b0 = blocks[0]
        why = _why_not(getattr(b0, "linear", None), getattr(b0, "norm", None), getattr(b0, "act", None))
        raise ValueError(f"no block of {mlp!r} can join an FP8 chain: {why}")
    tail_mod = model.get_submodule(tail) if tail else None
    chain = ChainMLP(blocks, tail_mod, margin=margin, start=start)  # type: ignore[arg-type]
    chain._orig = [seq]  # type: ignore[assignment]  # for unchain (a list: not registered)
    for attr in ("out_dim",):  # what the model's MLP class carries beside its blocks
        if hasattr(seq, attr):
            setattr(chain, attr, getattr(seq, attr))
    _set(model, mlp, chain)
    if tail:
        _set(model, tail, FoldedTail(tail_mod))  # type: ignore[arg-type]
    names = [f"{mlp}.{j}.linear" for j in range(start, len(blocks))]
    return names + ([tail] if tail else [])


def _set(model: nn.Module, name: str, mod: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, mod)


def unchain(model: nn.Module) -> list[str]:
    """Undo :func:`swap_chain` everywhere in ``model``: each :class:`ChainMLP` becomes the module it
    replaced and each :class:`FoldedTail` its linear again (weights shared all along); returns the
    MLPs' names."""
    done = []
    for name, mod in list(model.named_modules()):
        if isinstance(mod, ChainMLP):
            _set(model, name, getattr(mod, "_orig", [nn.Sequential(*mod)])[0])
            done.append(name)
        elif isinstance(mod, FoldedTail):
            _set(model, name, mod.linear)
    return done


def calibrate(model: nn.Module, batches: Sequence[tuple[Any, ...]], loss_fn: Callable[[Any, int], torch.Tensor], *,
              autocast: torch.dtype | None = torch.bfloat16) -> dict[str, list[float]]:
    """Fill every :class:`ChainMLP`'s delayed amaxes from real batches (forward and backward with
    each operand cast by its own amax; the largest seen kept); the gradients are cleared. Returns
    ``{name: amaxes}``."""
    chains: dict[str, ChainMLP] = {n: m for n, m in model.named_modules() if isinstance(m, ChainMLP)}
    if not chains:
        return {}
    if not batches:
        raise ValueError("calibrate needs at least one batch")
    dev = next(iter(chains.values())).amax.device
    seen = {n: torch.zeros_like(m.amax) for n, m in chains.items()}
    try:
        for m in chains.values():
            m.own_scales = True
        for i, b in enumerate(batches):
            with torch.autocast(dev.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                out = model(*b)
            loss_fn(out, i).backward()
            for n, m in chains.items():
                seen[n] = torch.maximum(seen[n], m.amax)
    finally:
        for m in chains.values():
            m.own_scales = False
            for w in m.weights:  # a tail's weight too, which the model may hold elsewhere
                w.grad = None
        model.zero_grad(set_to_none=True)
    for n, m in chains.items():
        if not (torch.isfinite(seen[n]).all() and (seen[n] > 0).all()):
            raise ValueError(f"{n}: amaxes {seen[n].tolist()} after calibration; calibrate on batches whose "
                             "operands in this chain are finite and not all zero")
        m.amax.copy_(seen[n])
        m._calibrated = True
    return {n: v.tolist() for n, v in seen.items()}
