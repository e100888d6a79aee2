"""FP8 GEMMs with tensor, row and block scaling in Triton (GPU).

``C (M, N) = A (M, K) @ B (N, K)^T`` with FP8 operands (e4m3 / e5m2, both K-contiguous: the
canonical layout :mod:`loka_tune.kernels.triton_quant` writes) and float32 *dequantization*
factors, output bf16:

- ``tensor``: ``C = (A @ B^T) * sa * sb`` (scalars), applied in the epilogue;
- ``row``: ``C[i, j] = (A @ B^T)[i, j] * sa[i] * sb[j]``, epilogue;
- ``block``: 1x128 scales of A (``sa (M, ceil(K/128))``) and either 128x128 scales of B
  (``sb (ceil(N/128), ceil(K/128))``, the weight in fwd / dgrad) or 1x128 (``sb (N, ceil(K/128))``,
  wgrad); each 128-deep slice of the reduction is computed by the tensor cores into a fresh
  accumulator and added, scaled, into the float32 accumulator (DeepSeek-V3 / DeepGEMM
  promotion), so ``BK = 128``.

Fast accumulation (``fast_accum=True``) lets the Hopper tensor cores accumulate the whole
reduction in their reduced-precision fp8 accumulator (Triton's default on sm90); without it,
the accumulator is promoted to float32 every 128 elements (``max_num_imprecise_acc=128``),
as cuBLAS does without ``use_fast_accum``.

Tile sizes come from a small heuristic on the number of output tiles versus SMs (no
autotuning: a study times hundreds of shapes and autotuning each one would cost more than
the GEMMs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loka_tune.config import Granularity

__all__ = ["fp8_gemm", "pick_config"]

_SCALE_MODE = {Granularity.TENSOR: 0, Granularity.ROW: 1, Granularity.BLOCK: 2}


@triton.jit
def _fp8_gemm_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, M, N, K,
                     sam, sak, sbn, sbk, scm, scn, ssa_r, ssa_c, ssb_r, ssb_c,
                     SCALE: tl.constexpr, B_BLOCK128: tl.constexpr, FAST_ACC: tl.constexpr,
                     EVEN_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    # grouped launch order: GROUP_M row-tiles share B tiles in L2
    num_in_group = GROUP_M * num_pid_n
    group_id = pid // num_in_group
    first_m = group_id * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % num_in_group) % group_m)
    pid_n = (pid % num_in_group) // group_m
    rm = pid_m * BM + tl.arange(0, BM)  # (BM,)
    rn = pid_n * BN + tl.arange(0, BN)  # (BN,)
    rk = tl.arange(0, BK)
    mmask = rm < M
    nmask = rn < N
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * sam + rk[None, :] * sak  # (BM, BK)
    b_ptrs = b_ptr + rn[None, :].to(tl.int64) * sbn + rk[:, None] * sbk  # (BK, BN), K-contiguous
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mmask[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=nmask[None, :], other=0.0)
        else:
            kmask = (k0 + rk) < K
            a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if SCALE == 2:
            kb = k0 // BK
            sa = tl.load(sa_ptr + rm * ssa_r + kb * ssa_c, mask=mmask, other=0.0)  # (BM,)
            if B_BLOCK128:
                sb = tl.load(sb_ptr + (rn // 128) * ssb_r + kb * ssb_c, mask=nmask, other=0.0)  # (BN,)
            else:
                sb = tl.load(sb_ptr + rn * ssb_r + kb * ssb_c, mask=nmask, other=0.0)
            acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
        elif FAST_ACC:
            acc = tl.dot(a, b, acc)
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BK)
        a_ptrs += BK * sak
        b_ptrs += BK * sbk
    if SCALE == 0:
        acc = acc * (tl.load(sa_ptr) * tl.load(sb_ptr))
    elif SCALE == 1:
        sa = tl.load(sa_ptr + rm * ssa_r, mask=mmask, other=0.0)
        sb = tl.load(sb_ptr + rn * ssb_r, mask=nmask, other=0.0)
        acc = acc * (sa[:, None] * sb[None, :])
    c_ptrs = c_ptr + rm[:, None].to(tl.int64) * scm + rn[None, :] * scn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def pick_config(M: int, N: int, K: int, sms: int, two_acc: bool = False) -> dict[str, int]:
    """Tile sizes, warps and pipeline stages for an ``M x N x K`` FP8 GEMM on ``sms`` SMs.

    ``two_acc``: the kernel keeps a second accumulator (block scaling, or promotion without
    fast accumulation); 128 x 256 tiles would then spill registers (seen on the H200: 3-5x
    slower), so tiles stop at 128 x 128.
    """
    t128 = triton.cdiv(M, 128) * triton.cdiv(N, 128)
    if t128 >= 2 * sms and N >= 256 and not two_acc:
        return dict(BM=128, BN=256, num_warps=8, num_stages=3)
    if t128 >= sms:
        return dict(BM=128, BN=128, num_warps=8, num_stages=4)
    if triton.cdiv(M, 64) * triton.cdiv(N, 128) >= sms:
        return dict(BM=64, BN=128, num_warps=4, num_stages=4)
    return dict(BM=64, BN=64, num_warps=4, num_stages=4)


def fp8_gemm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
             gran: Granularity, *, b_block128: bool = False, fast_accum: bool = False,
             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``(a @ b.T)`` dequantized by ``sa`` / ``sb`` (see the module docstring for shapes).

    ``a`` ``(M, K)`` and ``b`` ``(N, K)`` FP8 with unit stride along K; returns ``(M, N)``.
    """
    gran = Granularity(gran)
    M, K = a.shape
    N, K2 = b.shape
    assert K == K2, (a.shape, b.shape)
    assert a.stride(1) == 1 and b.stride(1) == 1, "FP8 operands must be K-contiguous"
    c = torch.empty((M, N), device=a.device, dtype=out_dtype)
    fast = fast_accum and gran != Granularity.BLOCK
    cfg = pick_config(M, N, K, _num_sms(a.device), two_acc=not fast)
    bk = 128
    sa2 = sa if sa.dim() == 2 else sa.reshape(-1, 1)
    sb2 = sb if sb.dim() == 2 else sb.reshape(-1, 1)
    grid = (triton.cdiv(M, cfg["BM"]) * triton.cdiv(N, cfg["BN"]),)
    _fp8_gemm_kernel[grid](
        a, b, c, sa2, sb2, M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        sa2.stride(0), sa2.stride(1), sb2.stride(0), sb2.stride(1),
        SCALE=_SCALE_MODE[gran], B_BLOCK128=b_block128, FAST_ACC=fast,
        EVEN_K=K % bk == 0, BM=cfg["BM"], BN=cfg["BN"], BK=bk, GROUP_M=8,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return c
