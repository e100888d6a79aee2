"""Fused FP8 quantization kernels in Triton (GPU), matching :mod:`loka_tune.kernels.quant`.

Each kernel reads a canonical operand ``x`` of shape ``(rows, red)`` *with any strides* (a
transposed view such as dgrad's ``W^T`` or wgrad's ``dY^T`` included), computes the reference
scales (``scale = fmax / amax`` per tile, clamped finite, ``1`` for all-zero tiles, optionally
rounded down to a power of two), and writes the saturated FP8 data **contiguous** in the
canonical layout ``(rows, red)`` together with float32 *dequantization* factors
``inv_scale = 1 / scale`` (what scaled GEMMs take). A transposed input is therefore
quantized and transposed in the same pass: no separate transpose kernel.

Passes over the bf16 input (2 B read, 1 B written per element):

- ``tensor``: two kernels: per-program partial amax (persistent grid), then cast (each
  program reduces the <= 1024 partials itself): 2 reads.
- ``row`` with the reduction dimension contiguous: one kernel, one program per strip of rows
  (rows longer than ``_ROW_SINGLE_MAX`` are read twice; the second read mostly hits L2).
- ``row`` on a transposed view (reduction dimension strided, wgrad's operands): column-amax
  partials over splits of the reduction, then cast + transpose: 2 reads.
- ``block`` 1x128 (activations / gradients) and 128x128 (weights): one kernel, one read,
  any layout.

The GEMM layouts the libraries want for the block scales differ; :func:`quantize` writes the
scales through a strided view so a caller can ask for an "MN-major" scale layout (FBGEMM's
groupwise GEMM) without another pass.

Import of this module needs ``triton``; it is imported lazily by the GPU backends only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import triton
import triton.language as tl

from loka_tune.config import Format, Granularity, ScaleRounding
from loka_tune.errors import UnsupportedChoiceError
from loka_tune.kernels.quant import FP8_DTYPE

__all__ = ["QuantOut", "quantize", "TL_FP8", "FMAX", "tl_scale_from_amax", "tl_cast", "row_cast_partials_kernel", "dual_cast",
           "dual_cast_tile"]

FMAX = {Format.E4M3: 448.0, Format.E5M2: 57344.0}
_TORCH_FP8 = {Format.E4M3: torch.float8_e4m3fn, Format.E5M2: torch.float8_e5m2}
TL_FP8 = {Format.E4M3: tl.float8e4nv, Format.E5M2: tl.float8e5}
_F32_MAX = 3.4028234663852886e38
_ROW_SINGLE_MAX = 8192  # rows up to this length are held in registers (one read)
_MAX_PARTIALS = 1024  # tensorwise partial-amax programs (the cast kernel reduces them all)


@dataclass(frozen=True)
class QuantOut:
    """FP8 data ``(rows, red)`` contiguous, and float32 dequantization factors.

    ``inv_scale`` shapes: tensor ``(1, 1)``; row ``(rows, 1)``; block activations
    ``(rows, ceil(red/128))`` and weights ``(ceil(rows/128), ceil(red/128))`` (possibly a
    transposed view of an MN-major buffer, see :func:`quantize`).
    """

    data: torch.Tensor
    inv_scale: torch.Tensor


@triton.jit
def tl_scale_from_amax(amax, FMAX_: tl.constexpr, POW2: tl.constexpr):
    """Reference scale rule: fmax / amax clamped finite; pow2 rounds down; zero tiles -> 1."""
    # IEEE division (Triton's `/` on fp32 is the approximate div.full: 1 ulp off the reference)
    scale = tl.div_rn(tl.full(amax.shape, FMAX_, tl.float32), tl.maximum(amax, FMAX_ / 3.4028234663852886e38))
    scale = tl.minimum(scale, 3.4028234663852886e38)
    if POW2:
        bits = scale.to(tl.uint32, bitcast=True) & 0x7F800000  # 2**floor(log2(scale))
        scale = bits.to(tl.float32, bitcast=True)
    return tl.where(amax == 0.0, 1.0, scale)


@triton.jit
def tl_cast(x, scale, FMAX_: tl.constexpr, OUT_T: tl.constexpr):
    """``x * scale`` saturated to +-FMAX_ and cast to ``OUT_T`` (the reference cast)."""
    y = x * scale
    y = tl.minimum(tl.maximum(y, -FMAX_), FMAX_)
    return y.to(OUT_T)


# ----------------------------------------------------------------------------- row
@triton.jit
def _row_kernel(x_ptr, y_ptr, s_ptr, R, C, sxr, sxc,
                FMAX_: tl.constexpr, POW2: tl.constexpr, OUT_T: tl.constexpr,
                BR: tl.constexpr, BC: tl.constexpr, SINGLE: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BR + tl.arange(0, BR)  # (BR,)
    rmask = rows < R
    cols = tl.arange(0, BC)
    if SINGLE:
        m = rmask[:, None] & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sxr + cols[None, :] * sxc, mask=m, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)  # (BR,)
        scale = tl_scale_from_amax(amax, FMAX_, POW2)
        y = tl_cast(x, scale[:, None], FMAX_, OUT_T)
        tl.store(y_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], y, mask=m)
    else:
        amax = tl.zeros((BR,), dtype=tl.float32)
        for c0 in range(0, C, BC):
            cc = c0 + cols
            m = rmask[:, None] & (cc[None, :] < C)
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sxr + cc[None, :] * sxc, mask=m, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        scale = tl_scale_from_amax(amax, FMAX_, POW2)
        for c0 in range(0, C, BC):
            cc = c0 + cols
            m = rmask[:, None] & (cc[None, :] < C)
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sxr + cc[None, :] * sxc, mask=m, other=0.0)
            y = tl_cast(x.to(tl.float32), scale[:, None], FMAX_, OUT_T)
            tl.store(y_ptr + rows[:, None].to(tl.int64) * C + cc[None, :], y, mask=m)
    tl.store(s_ptr + rows, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), mask=rmask)


# Transposed rowwise: column-amax partials over splits of the reduction, then cast.
@triton.jit
def _row_amax_partial_kernel(x_ptr, p_ptr, R, C, sxr, sxc, C_PER_SPLIT,
                             BR: tl.constexpr, BC: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_r * BR + tl.arange(0, BR)
    rmask = rows < R
    amax = tl.zeros((BR,), dtype=tl.float32)
    c_lo = pid_s * C_PER_SPLIT
    for c0 in range(c_lo, c_lo + C_PER_SPLIT, BC):
        cc = c0 + tl.arange(0, BC)
        m = rmask[:, None] & (cc[None, :] < C) & (cc[None, :] < c_lo + C_PER_SPLIT)
        x = tl.load(x_ptr + rows[:, None] * sxr + cc[None, :].to(tl.int64) * sxc, mask=m, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    tl.store(p_ptr + pid_s * R + rows, amax, mask=rmask)


@triton.jit
def row_cast_partials_kernel(x_ptr, p_ptr, y_ptr, s_ptr, R, C, sxr, sxc, NSPLIT,
                             FMAX_: tl.constexpr, POW2: tl.constexpr, OUT_T: tl.constexpr,
                             BR: tl.constexpr, BC: tl.constexpr, BS: tl.constexpr):
    """Second stage of a rowwise cast: reduce the ``NSPLIT`` amax partials of each row, then scale and cast."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BR + tl.arange(0, BR)
    rmask = rows < R
    sp = tl.arange(0, BS)
    part = tl.load(p_ptr + sp[:, None] * R + rows[None, :], mask=(sp[:, None] < NSPLIT) & rmask[None, :], other=0.0)
    amax = tl.max(part, axis=0)  # (BR,)
    scale = tl_scale_from_amax(amax, FMAX_, POW2)
    cc = pid_c * BC + tl.arange(0, BC)
    m = rmask[:, None] & (cc[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * sxr + cc[None, :].to(tl.int64) * sxc, mask=m, other=0.0)
    y = tl_cast(x.to(tl.float32), scale[:, None], FMAX_, OUT_T)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * C + cc[None, :], y, mask=m)
    if pid_c == 0:
        tl.store(s_ptr + rows, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), mask=rmask)


# ----------------------------------------------------------------------------- tensor
@triton.jit
def _tensor_amax_kernel(x_ptr, p_ptr, R, C, sxr, sxc, NPROG, n_c, N_ITER,
                        BR: tl.constexpr, BC: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros((BR, BC), dtype=tl.float32)
    for i in range(0, N_ITER):
        t = pid + i * NPROG  # tiles past the end are fully masked
        rows = (t // n_c) * BR + tl.arange(0, BR)
        cols = (t % n_c) * BC + tl.arange(0, BC)
        m = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sxr + cols[None, :].to(tl.int64) * sxc, mask=m, other=0.0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    tl.store(p_ptr + pid, tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit
def _tensor_cast_kernel(x_ptr, p_ptr, y_ptr, s_ptr, R, C, sxr, sxc, NPART, NPROG, n_c, N_ITER,
                        FMAX_: tl.constexpr, POW2: tl.constexpr, OUT_T: tl.constexpr,
                        BR: tl.constexpr, BC: tl.constexpr, BP: tl.constexpr):
    pid = tl.program_id(0)
    pp = tl.arange(0, BP)
    amax = tl.max(tl.load(p_ptr + pp, mask=pp < NPART, other=0.0), axis=0)
    scale = tl_scale_from_amax(amax, FMAX_, POW2)
    for i in range(0, N_ITER):
        t = pid + i * NPROG  # tiles past the end are fully masked
        rows = (t // n_c) * BR + tl.arange(0, BR)
        cols = (t % n_c) * BC + tl.arange(0, BC)
        m = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sxr + cols[None, :].to(tl.int64) * sxc, mask=m, other=0.0)
        y = tl_cast(x.to(tl.float32), scale, FMAX_, OUT_T)
        tl.store(y_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], y, mask=m)
    if pid == 0:
        tl.store(s_ptr, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale))


# ----------------------------------------------------------------------------- block
@triton.jit
def _block_kernel(x_ptr, y_ptr, s_ptr, R, C, sxr, sxc, ssr, ssc,
                  FMAX_: tl.constexpr, POW2: tl.constexpr, OUT_T: tl.constexpr,
                  BR: tl.constexpr, BC: tl.constexpr, WEIGHT: tl.constexpr):
    """One (BR, 128) tile: 1x128 scales per row (activations) or one 128x128 scale (WEIGHT,
    BR = 128). Scales are written at ``s_ptr + row_block * ssr + col_block * ssc``."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BR + tl.arange(0, BR)
    cols = pid_c * BC + tl.arange(0, BC)
    m = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sxr + cols[None, :].to(tl.int64) * sxc, mask=m, other=0.0)
    x = x.to(tl.float32)
    if WEIGHT:
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        scale = tl_scale_from_amax(amax, FMAX_, POW2)
        y = tl_cast(x, scale, FMAX_, OUT_T)
        tl.store(s_ptr + pid_r * ssr + pid_c * ssc, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale))
    else:
        amax = tl.max(tl.abs(x), axis=1)  # (BR,)
        scale = tl_scale_from_amax(amax, FMAX_, POW2)
        y = tl_cast(x, scale[:, None], FMAX_, OUT_T)
        tl.store(s_ptr + rows.to(tl.int64) * ssr + pid_c * ssc, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), mask=rows < R)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], y, mask=m)


# ----------------------------------------------------------------------------- driver
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the Triton interpreter (tests on CPU)


def quantize(x: torch.Tensor, fmt: Format | str, gran: Granularity | str,
             rounding: ScaleRounding | str = ScaleRounding.EXACT, *, is_weight: bool = False,
             scale_mn_major: bool = False) -> QuantOut:
    """Quantize the canonical operand ``x`` ``(rows, red)`` (any strides) in one fused pass
    (two for tensorwise and transposed rowwise). See the module docstring.

    ``scale_mn_major`` (block only): store the block scales MN-major, i.e. the returned
    ``inv_scale`` ``(nr, nc)`` is a transposed view of a contiguous ``(nc, nr)`` buffer.
    """
    fmt, gran, rounding = Format(fmt), Granularity(gran), ScaleRounding(rounding)
    if fmt not in FMAX:
        raise UnsupportedChoiceError(f"the Triton quantizer writes e4m3 or e5m2, not {fmt.value!r}")
    if x.dim() != 2:
        raise ValueError(f"quantize takes a 2-D canonical operand (rows, red), got shape {tuple(x.shape)}")
    R, C = x.shape
    fmax, pow2, out_t = FMAX[fmt], rounding == ScaleRounding.POW2, TL_FP8[fmt]
    y = torch.empty((R, C), device=x.device, dtype=_TORCH_FP8[fmt])
    sxr, sxc = x.stride()
    if R == 0 or C == 0:
        raise ValueError(f"cannot quantize an empty operand of shape {(R, C)}")
    if gran == Granularity.ROW:
        s = torch.empty((R, 1), device=x.device, dtype=torch.float32)
        if sxc == 1 or sxc <= sxr:  # reduction dim is the fast one: one pass per row strip
            single = C <= _ROW_SINGLE_MAX
            bc = triton.next_power_of_2(C) if single else 1024
            br = max(1, min(64, 8192 // bc)) if single else 8
            br = min(br, triton.next_power_of_2(R))
            _row_kernel[(triton.cdiv(R, br),)](x, y, s, R, C, sxr, sxc, FMAX_=fmax, POW2=pow2, OUT_T=out_t,
                                               BR=br, BC=bc, SINGLE=single, num_warps=8 if bc * br >= 4096 else 4)
        else:  # transposed view: rows are contiguous in memory, reduce over the strided dim
            br, bc = 64, 64
            n_r = triton.cdiv(R, br)
            nsplit = max(1, min(64, (4 * _num_sms(x.device)) // n_r, triton.cdiv(C, bc)))
            per = triton.cdiv(triton.cdiv(C, nsplit), bc) * bc
            nsplit = triton.cdiv(C, per)
            part = torch.empty((nsplit, R), device=x.device, dtype=torch.float32)
            _row_amax_partial_kernel[(n_r, nsplit)](x, part, R, C, sxr, sxc, per, BR=br, BC=bc, num_warps=4)
            row_cast_partials_kernel[(n_r, triton.cdiv(C, bc))](
                x, part, y, s, R, C, sxr, sxc, nsplit, FMAX_=fmax, POW2=pow2, OUT_T=out_t,
                BR=br, BC=bc, BS=triton.next_power_of_2(nsplit), num_warps=4)
        return QuantOut(y, s)
    if gran == Granularity.TENSOR:
        s = torch.empty((1, 1), device=x.device, dtype=torch.float32)
        trans = not (sxc == 1 or sxc <= sxr)
        br, bc = (128, 32) if trans else (32, 128)
        n_c = triton.cdiv(C, bc)
        n_tiles = triton.cdiv(R, br) * n_c
        nprog = max(1, min(n_tiles, _MAX_PARTIALS, 4 * _num_sms(x.device)))
        part = torch.empty((nprog,), device=x.device, dtype=torch.float32)
        _tensor_amax_kernel[(nprog,)](x, part, R, C, sxr, sxc, nprog, n_c, triton.cdiv(n_tiles, nprog), BR=br, BC=bc, num_warps=4)
        nprog2 = max(1, min(n_tiles, 8 * _num_sms(x.device)))
        _tensor_cast_kernel[(nprog2,)](x, part, y, s, R, C, sxr, sxc, nprog, nprog2, n_c, triton.cdiv(n_tiles, nprog2), FMAX_=fmax, POW2=pow2,
                                       OUT_T=out_t, BR=br, BC=bc, BP=triton.next_power_of_2(nprog), num_warps=4)
        return QuantOut(y, s)
    if gran == Granularity.BLOCK:
        nc = triton.cdiv(C, 128)
        nr = triton.cdiv(R, 128) if is_weight else R
        if scale_mn_major:
            s = torch.empty((nc, nr), device=x.device, dtype=torch.float32).t()  # (nr, nc) view
        else:
            s = torch.empty((nr, nc), device=x.device, dtype=torch.float32)
        br = 128 if is_weight else 32
        _block_kernel[(triton.cdiv(R, br), nc)](x, y, s, R, C, sxr, sxc, s.stride(0), s.stride(1),
                                                FMAX_=fmax, POW2=pow2, OUT_T=out_t, BR=br, BC=128,
                                                WEIGHT=is_weight, num_warps=8 if is_weight else 4)
        return QuantOut(y, s)
    raise UnsupportedChoiceError(
        f"the Triton quantizer implements tensor, row and block granularities, not {gran.value!r}"
    )


# ----------------------------------------------------------------------------- dual (both layouts)
@triton.jit
def _dual_cast_kernel(x_ptr, s_ptr, y_ptr, yt_ptr, R, C, sxr, sxc, FMT: tl.constexpr, VIA: tl.constexpr,
                      BR: tl.constexpr, BC: tl.constexpr):
    """One (BR, BC) tile of ``x`` (any strides) times the tensorwise ``scale``, saturated and cast,
    stored into ``y`` ``(R, C)`` and, transposed in fp32 first, into ``yt`` ``(C, R)``; both
    contiguous. ``FMT``: 0 e4m3, 1 e5m2; ``VIA``: the dtype the value is rounded through before
    the cast (the compute dtype of an fp32 master weight), 0 none, 1 bfloat16, 2 float16. Plain
    integers, not Triton dtypes, so that inductor can write them into the code it generates when
    it launches the kernel itself (:func:`loka_tune.kernels.dualcast.inline_op`)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)  # (BR,)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)  # (BC,)
    m = (rows[:, None] < R) & (cols[None, :] < C)  # (BR, BC)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sxr + cols[None, :].to(tl.int64) * sxc, mask=m, other=0.0)
    if VIA == 1:
        xf = x.to(tl.bfloat16).to(tl.float32)
    elif VIA == 2:
        xf = x.to(tl.float16).to(tl.float32)
    else:
        xf = x.to(tl.float32)
    scale = tl.load(s_ptr)
    mt = (cols[:, None] < C) & (rows[None, :] < R)  # (BC, BR)
    y_at = y_ptr + rows[:, None].to(tl.int64) * C + cols[None, :]
    yt_at = yt_ptr + cols[:, None].to(tl.int64) * R + rows[None, :]
    if FMT == 0:
        tl.store(y_at, tl_cast(xf, scale, 448.0, tl.float8e4nv), mask=m)
        tl.store(yt_at, tl_cast(tl.trans(xf), scale, 448.0, tl.float8e4nv), mask=mt)
    else:
        tl.store(y_at, tl_cast(xf, scale, 57344.0, tl.float8e5), mask=m)
        tl.store(yt_at, tl_cast(tl.trans(xf), scale, 57344.0, tl.float8e5), mask=mt)


def dual_cast_tile(r: int, c: int) -> tuple[int, int]:
    """The (rows, cols) tile of :func:`dual_cast` for an ``(r, c)`` operand: 128 x 128, but as
    narrow as a narrow operand (down to 16 columns) and as much taller, 16K elements a tile up to
    512 rows: the feature-axis Linears' 64- and 32-wide operands filled a quarter of a 128 x 128
    tile and ran 0.22 ms slower than inductor's casts at 2,097,152 x 64 x 32 (H100, 2026-12-07)."""
    bc = min(128, max(16, triton.next_power_of_2(c)))
    return min(512, max(128, 16384 // bc)), bc


_FMT_CODE = {Format.E4M3: 0, Format.E5M2: 1}
_VIA_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def dual_cast(x: torch.Tensor, scale: torch.Tensor, fmt: Format,
              via: torch.dtype = torch.float32, wrap: Callable[[Any], Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``(R, C)`` (CUDA, any strides and float dtype) rounded through ``via``, times
    ``scale`` (float32, one element), saturated and cast to ``fmt``: ``(data (R, C), data_t (C, R))``,
    both contiguous, from one read of ``x`` (see :mod:`loka_tune.kernels.dualcast`). ``wrap``:
    :func:`torch.library.wrap_triton` inside a ``triton_op`` (inductor then launches the kernel as
    one of its own); None launches it here."""
    if fmt not in _FMT_CODE:
        raise UnsupportedChoiceError(f"dual_cast writes e4m3 or e5m2, got {fmt.value!r}")
    if via not in _VIA_CODE:
        raise UnsupportedChoiceError(f"dual_cast rounds through float32, bfloat16 or float16, got {via}")
    r, c = x.shape
    dt = FP8_DTYPE[fmt]
    y = torch.empty((r, c), device=x.device, dtype=dt)
    yt = torch.empty((c, r), device=x.device, dtype=dt)
    if r and c:
        kernel = _dual_cast_kernel if wrap is None else wrap(_dual_cast_kernel)
        br, bc = dual_cast_tile(r, c)
        grid = (triton.cdiv(r, br), triton.cdiv(c, bc))
        kernel[grid](x, scale.reshape(1).to(torch.float32), y, yt, r, c, x.stride(0), x.stride(1),
                     FMT=_FMT_CODE[fmt], VIA=_VIA_CODE[via], BR=br, BC=bc, num_warps=8)
    return y, yt
