"""FP8 MLP chains whose norms write the FP8 operands themselves: the experiment behind e2e.py's
``chain_tensorwise_filter`` variant (issue 21).

Why: with inductor's casts, or the dual cast, every FP8 operand of torchao's 15 Wukong sites is
first written in bf16 by its producer and read back to be cast (BENCHMARKS.md, 2026-12-07, third
session). A delayed scale alone did not change that: inductor still recomputed the BlockNorm and
Hard Swish from the GEMM's bf16 output in one cast kernel per layout. Inside an MLP of
``linear -> BlockNorm -> Hard Swish`` blocks, the operands between two FP8 GEMMs need no bf16
copy at all:

- forward: the next linear's input ``x = hswish(blocknorm(y))`` is only ever read as FP8, in two
  layouts (``x`` for the forward GEMM, ``x^T`` for the wgrad);
- backward: the previous linear's output gradient ``dy = blocknorm'(hswish'(g))`` is only ever
  read as FP8, in two layouts (``dy`` for the dgrad, ``dy^T`` for the wgrad).

Here one Triton kernel does each: it reads the GEMM output ``y`` (and, backward, the gradient
``g``) once, takes the block statistics itself, and writes both FP8 layouts with a *delayed*
scale (the last step's amax times a margin) and the amax for the next step (an atomic max per
tile). That is 4 bytes an element where inductor's path moves about 8 (forward) and 10 (backward).

:class:`FP8Chain` is one ``torch.autograd.Function`` over a whole chain of blocks (and the linear
that follows the MLP, Wukong's ``fmb.out``), so that the FP8 operands pass between the blocks
inside it: autograd would not carry an FP8 gradient between two Functions. Each GEMM is e4m3
tensorwise through ``torch._scaled_mm`` (fast accumulation in the forward only, torchao's
tensorwise recipe); the chain's input and the weights are cast by
:func:`delayed_scales.cast_dual_amax` (both layouts and the amax in one read). Only the block
statistics (``rstd``, ``(M, N / 256)`` float32) and the GEMM outputs ``y`` (bf16) are saved for
backward, beside the FP8 copies the wgrads take.

The code lives in the product since 2026-12-07 (fourth session), :mod:`loka_tune.kernels.chain`
(not yet wired into ``loka_tune.apply`` or the study's space); this module re-exports it under the
names the benchmarks and their tests use.
"""

from __future__ import annotations

from loka_tune.kernels.chain import (  # noqa: F401  (re-exported: e2e.py, the tests)
    BLOCK,
    MARGIN,
    ChainMLP,
    FoldedTail,
    FP8Chain,
    _bwd_launch,
    _fwd_launch,
    _kernels,
    calibrate,
    norm_bwd_cast,
    norm_bwd_cast_reference,
    norm_fwd_cast,
    norm_fwd_cast_reference,
    prepare_kernels,
    swap_chain,
    unchain,
)

__all__ = ["ChainMLP", "FP8Chain", "FoldedTail", "swap_chain", "unchain", "calibrate", "norm_fwd_cast", "norm_bwd_cast",
           "norm_fwd_cast_reference", "norm_bwd_cast_reference", "prepare_kernels", "BLOCK", "MARGIN"]
