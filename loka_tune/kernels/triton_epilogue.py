"""Fused FP8 GEMM epilogue in Triton (GPU): Linear -> BlockNorm -> Hard Swish.

Forward, one kernel per output tile ``(BM, BN)`` with ``BN`` a multiple of the BlockNorm
block ``b`` (a tile holds whole blocks, so no cross-tile reduction is needed):

1. ``acc = Xq @ Wq^T``: the main loop of :mod:`loka_tune.kernels.triton_gemm` (rowwise-scaled
   FP8 operands written by :mod:`loka_tune.kernels.triton_quant`, K-contiguous, optional fast
   accumulation);
2. dequantize ``y = acc * sx[i] * sw[j]`` (+ bias), in float32;
3. BlockNorm ``z = y * rstd``, ``rstd = rsqrt(mean(y^2 over each block of b) + eps)``;
4. Hard Swish ``h = z * clamp(z + 3, 0, 6) / 6``;
5. store ``h`` (bf16), and for the backward the pre-norm ``y`` (bf16) and ``rstd`` (float32,
   ``(M, N / b)``);
6. optionally the rowwise FP8 quantization of ``h`` for the next layer, with the reference
   semantics of :mod:`loka_tune.kernels.quant` applied to the bf16-rounded ``h``: when one
   tile spans the whole row the cast happens in the epilogue; otherwise the epilogue writes
   per-(tile, row) amax partials and the cast kernel of :mod:`triton_quant` finishes (a
   rowwise scale needs the amax of the whole row, which no single tile sees).

Backward (elementwise, one program per ``(rows, block)``): with ``z = y * rstd``,
``dz = dh * hardswish'(z)`` and ``dy = rstd * (dz - z * mean(dz * z over the block))``; the
dgrad / wgrad GEMMs run elsewhere (:mod:`loka_tune.kernels.fused`).

``DOT_FP8=False`` is a test switch: the same kernel with float32 operands holding FP8 values
(the Triton CPU interpreter does not run FP8 ``tl.dot``). Importing this module needs triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loka_tune.config import Format, ScaleRounding
from loka_tune.kernels.triton_quant import FMAX, TL_FP8, row_cast_partials_kernel, tl_cast, tl_scale_from_amax

__all__ = ["fused_forward", "fused_backward", "pick_epilogue_config", "epilogue_reason"]

_MIN_BLOCK, _MAX_BLOCK = 16, 512


@triton.jit
def _fused_fwd_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, ypre_ptr, rstd_ptr, amax_ptr, q_ptr, qs_ptr,
                      M, N, K, sam, sak, sbn, sbk, eps,
                      HAS_BIAS: tl.constexpr, SAVE: tl.constexpr, OUT_Q: tl.constexpr,
                      QMAX: tl.constexpr, POW2: tl.constexpr, Q_T: tl.constexpr,
                      FAST_ACC: tl.constexpr, EVEN_K: tl.constexpr, DOT_FP8: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NB: tl.constexpr,
                      GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    num_in_group = GROUP_M * num_pid_n
    group_id = pid // num_in_group
    first_m = group_id * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % num_in_group) % group_m)
    pid_n = (pid % num_in_group) // group_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    mmask = rm < M
    nmask = rn < N
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * sam + rk[None, :] * sak  # (BM, BK)
    b_ptrs = b_ptr + rn[None, :].to(tl.int64) * sbn + rk[:, None] * sbk  # (BK, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    # ---- main loop: triton_gemm's rowwise path
    for k0 in range(0, K, BK):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mmask[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=nmask[None, :], other=0.0)
        else:
            kmask = (k0 + rk) < K
            a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if DOT_FP8:
            if FAST_ACC:
                acc = tl.dot(a, b, acc)
            else:
                acc = tl.dot(a, b, acc, max_num_imprecise_acc=BK)
        else:  # test switch (interpreter): float32 operands holding FP8 values
            acc = tl.dot(a, b, acc, input_precision="ieee")
        a_ptrs += BK * sak
        b_ptrs += BK * sbk
    # ---- epilogue: dequantize (+ bias)
    sa = tl.load(sa_ptr + rm, mask=mmask, other=0.0)
    sb = tl.load(sb_ptr + rn, mask=nmask, other=0.0)
    y = acc * (sa[:, None] * sb[None, :])  # out-of-range rows / cols are exactly 0
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    # ---- BlockNorm over the BN // NB whole blocks of this tile
    if NB == BN:  # one block per tile: a plain row reduction (no reshape / layout change)
        rstd1 = 1.0 / tl.sqrt_rn(tl.sum(y * y, axis=1) / NB + eps)  # (BM,)
        z = y * rstd1[:, None]
        rstd = rstd1[:, None]  # (BM, 1)
    else:
        y3 = tl.reshape(y, (BM, BN // NB, NB))
        ms = tl.sum(y3 * y3, axis=2) / NB  # (BM, BN // NB)
        rstd = 1.0 / tl.sqrt_rn(ms + eps)
        z = tl.reshape(y3 * rstd[:, :, None], (BM, BN))
    # ---- Hard Swish
    h = z * (tl.minimum(tl.maximum(z + 3.0, 0.0), 6.0) / 6.0)
    omask = mmask[:, None] & nmask[None, :]
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    hb = h.to(tl.bfloat16)
    tl.store(out_ptr + offs, hb, mask=omask)
    if SAVE:
        tl.store(ypre_ptr + offs, y.to(tl.bfloat16), mask=omask)
        nblk = N // NB
        rb = pid_n * (BN // NB) + tl.arange(0, BN // NB)
        tl.store(rstd_ptr + rm[:, None].to(tl.int64) * nblk + rb[None, :], rstd,
                 mask=mmask[:, None] & (rb[None, :] < nblk))
    # ---- optional rowwise FP8 of the bf16 output (reference semantics on bf16 h)
    if OUT_Q != 0:
        hf = hb.to(tl.float32)
        amax = tl.max(tl.where(omask, tl.abs(hf), 0.0), axis=1)  # (BM,)
        if OUT_Q == 1:  # the tile spans the whole row
            scale = tl_scale_from_amax(amax, QMAX, POW2)
            qv = tl_cast(hf, scale[:, None], QMAX, Q_T)
            tl.store(q_ptr + offs, qv, mask=omask)
            tl.store(qs_ptr + rm, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), mask=mmask)
        else:  # partial amax of this tile's columns; the cast kernel reduces them
            tl.store(amax_ptr + pid_n * M + rm, amax, mask=mmask)


@triton.jit
def _fused_bwd_kernel(dh_ptr, ypre_ptr, rstd_ptr, dy_ptr, M, N, sdm, sdn,
                      NB: tl.constexpr, BR: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)  # block index
    rows = pid_r * BR + tl.arange(0, BR)
    cols = pid_c * NB + tl.arange(0, NB)
    rmask = rows < M
    m = rmask[:, None]
    r64 = rows[:, None].to(tl.int64)
    dh = tl.load(dh_ptr + r64 * sdm + cols[None, :] * sdn, mask=m, other=0.0).to(tl.float32)
    y = tl.load(ypre_ptr + r64 * N + cols[None, :], mask=m, other=0.0).to(tl.float32)
    r = tl.load(rstd_ptr + rows.to(tl.int64) * (N // NB) + pid_c, mask=rmask, other=0.0)
    z = y * r[:, None]
    g = tl.where(z < -3.0, 0.0, tl.where(z <= 3.0, z / 3.0 + 0.5, 1.0))
    dz = dh * g
    c = tl.sum(dz * z, axis=1) / NB
    dy = r[:, None] * (dz - z * c[:, None])
    tl.store(dy_ptr + r64 * N + cols[None, :], dy.to(dy_ptr.dtype.element_ty), mask=m)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def epilogue_reason(n: int, block: int) -> str | None:
    """None when the fused kernel handles ``N = n`` with BlockNorm block ``block``, else why not."""
    b = min(block, n)
    if n % b:
        return f"N={n} is not a multiple of the BlockNorm block {block} (ragged last block): the fused kernel needs whole blocks"
    if b & (b - 1) or not _MIN_BLOCK <= b <= _MAX_BLOCK:
        return f"effective block {b} must be a power of two in [{_MIN_BLOCK}, {_MAX_BLOCK}] for the fused kernel"
    return None


def pick_epilogue_config(M: int, N: int, block: int, sms: int) -> dict[str, int]:
    """Tiles for the fused kernel: ``BN`` a multiple of the block, like ``triton_gemm.pick_config``."""
    if block >= 512:
        return dict(BM=64, BN=block, num_warps=8, num_stages=2)
    if block == 256:
        if triton.cdiv(M, 128) * triton.cdiv(N, 256) >= sms:
            return dict(BM=128, BN=256, num_warps=8, num_stages=3)
        return dict(BM=64, BN=256, num_warps=8, num_stages=3)
    t128 = triton.cdiv(M, 128) * triton.cdiv(N, 128)
    if t128 >= 2 * sms and N >= 256:
        return dict(BM=128, BN=256, num_warps=8, num_stages=3)
    if t128 >= sms:
        return dict(BM=128, BN=128, num_warps=8, num_stages=4)
    return dict(BM=64, BN=128, num_warps=4, num_stages=4)


def fused_forward(qx: torch.Tensor, sx: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor,
                  bias: torch.Tensor | None, block: int, eps: float, *, fast_accum: bool = True,
                  save: bool = True, out_fp8: Format | None = None,
                  out_rounding: ScaleRounding = ScaleRounding.EXACT,
                  config: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """Fused ``hardswish(blocknorm(dequant(qx @ qw.T) + bias))``.

    ``qx`` ``(M, K)`` and ``qw`` ``(N, K)`` FP8 (or float32 holding FP8 values: the interpreter
    test switch), K-contiguous; ``sx`` ``(M, 1)``, ``sw`` ``(N, 1)`` float32 dequantization
    factors. Returns ``{"out": (M, N) bf16}`` plus ``"ypre"`` (bf16) and ``"rstd"`` ``(M, N/b)``
    float32 when ``save``, and ``"q"`` / ``"q_inv_scale"`` ``(M, 1)`` when ``out_fp8``.
    """
    M, K = qx.shape
    N, K2 = qw.shape
    assert K == K2 and qx.stride(1) == 1 and qw.stride(1) == 1, (qx.shape, qw.shape)
    b = min(block, N)
    reason = epilogue_reason(N, block)
    if reason is not None:
        raise ValueError(reason)
    dev = qx.device
    cfg = dict(config) if config is not None else pick_epilogue_config(M, N, b, _num_sms(dev))
    bm, bn = cfg.pop("BM"), cfg.pop("BN")
    if bn % b:
        raise ValueError(f"BN={bn} must be a multiple of the block {b}")
    out = torch.empty((M, N), device=dev, dtype=torch.bfloat16)
    res = {"out": out}
    ypre = torch.empty((M, N), device=dev, dtype=torch.bfloat16) if save else out
    rstd = torch.empty((M, N // b), device=dev, dtype=torch.float32) if save else sx
    if save:
        res["ypre"], res["rstd"] = ypre, rstd
    n_tiles_n = triton.cdiv(N, bn)
    out_q = 0 if out_fp8 is None else (1 if n_tiles_n == 1 else 2)
    fmt = Format(out_fp8) if out_fp8 is not None else Format.E4M3
    pow2 = ScaleRounding(out_rounding) == ScaleRounding.POW2
    if out_q:
        q = torch.empty((M, N), device=dev, dtype=torch.float8_e4m3fn if fmt == Format.E4M3 else torch.float8_e5m2)
        qs = torch.empty((M, 1), device=dev, dtype=torch.float32)
        amax = torch.empty((n_tiles_n, M), device=dev, dtype=torch.float32) if out_q == 2 else qs
        res["q"], res["q_inv_scale"] = q, qs
    else:
        q = qs = amax = out
    bias_t = bias if bias is not None else sx
    grid = (triton.cdiv(M, bm) * n_tiles_n,)
    args = (qx, qw, sx, sw, bias_t, out, ypre, rstd, amax, q, qs,
            M, N, K, qx.stride(0), qx.stride(1), qw.stride(0), qw.stride(1), float(eps))
    consts = dict(HAS_BIAS=bias is not None, SAVE=save, OUT_Q=out_q, QMAX=FMAX[fmt], POW2=pow2, Q_T=TL_FP8[fmt],
                  FAST_ACC=fast_accum, EVEN_K=K % 128 == 0, DOT_FP8=qx.dtype != torch.float32, BK=128, NB=b, GROUP_M=8)
    try:
        _fused_fwd_kernel[grid](*args, BM=bm, BN=bn, **consts, **cfg)
    except triton.runtime.errors.OutOfResources:  # fall back to a smaller tile (same BN: whole blocks)
        if config is not None or bm == 64:
            raise
        _fused_fwd_kernel[(triton.cdiv(M, 64) * n_tiles_n,)](*args, BM=64, BN=bn, **consts, num_warps=8, num_stages=2)
    if out_q == 2:
        br, bc = 64, 64
        row_cast_partials_kernel[(triton.cdiv(M, br), triton.cdiv(N, bc))](
            out, amax, q, qs, M, N, out.stride(0), out.stride(1), n_tiles_n, FMAX_=FMAX[fmt], POW2=pow2,
            OUT_T=TL_FP8[fmt], BR=br, BC=bc, BS=triton.next_power_of_2(n_tiles_n), num_warps=4)
    return res


def fused_backward(dh: torch.Tensor, ypre: torch.Tensor, rstd: torch.Tensor, block: int,
                   out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``dy`` (the gradient of the pre-norm GEMM output) from ``dh`` (any strides), the saved
    pre-norm ``ypre`` ``(M, N)`` and ``rstd`` ``(M, N / b)``."""
    M, N = ypre.shape
    b = min(block, N)
    assert N % b == 0 and rstd.shape == (M, N // b) and ypre.is_contiguous() and rstd.is_contiguous()
    dy = torch.empty((M, N), device=ypre.device, dtype=out_dtype)
    br = max(1, min(64, 4096 // b))
    _fused_bwd_kernel[(triton.cdiv(M, br), N // b)](dh, ypre, rstd, dy, M, N, dh.stride(0), dh.stride(1),
                                                    NB=b, BR=br, num_warps=4 if br * b <= 4096 else 8)
    return dy
