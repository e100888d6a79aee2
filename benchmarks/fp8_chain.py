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
inside it: autograd would not carry an FP8 gradient between two Functions. Each GEMM is
tensorwise through ``torch._scaled_mm`` (fast accumulation in the forward only), e4m3 operands and
the gradients in ``GRAD_FORMAT`` (e5m2 since 2026-12-07, sixth session, as torchao's tensorwise
recipe); the chain's input and the weights are cast by :func:`delayed_scales.cast_dual_amax` (both
layouts and the amax in one read). Only the block statistics (``rstd``, ``(M, N / 256)`` float32)
and the GEMM outputs ``y`` (bf16) are saved for backward, beside the FP8 copies the wgrads take.

The code lives in the product since 2026-12-07 (fourth session), :mod:`loka_tune.kernels.chain`
(``loka_tune.apply`` makes the chains under the ``fp8_chain`` Mod); this module re-exports it
under the names the benchmarks and their tests use, and adds :class:`AmaxTrace`, which records a
training run's delayed amaxes to tell whether an operand outgrew its delayed scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

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
           "norm_fwd_cast_reference", "norm_bwd_cast_reference", "prepare_kernels", "BLOCK", "MARGIN", "AmaxTrace",
           "slot_names", "set_margin", "set_grad_format"]


def slot_names(n_gemms: int) -> list[str]:
    """The names of a chain's ``amax`` slots (:class:`FP8Chain`'s layout, ``L`` GEMMs):
    ``x0, w0 .. w{L-1}, x1 .. x{L-1}, dy0 .. dy{L-1}``."""
    L = n_gemms
    return ["x0", *(f"w{i}" for i in range(L)), *(f"x{i}" for i in range(1, L)), *(f"dy{i}" for i in range(L))]


def set_margin(model: nn.Module, margin: float) -> int:
    """Every :class:`ChainMLP` of ``model`` casts with ``fmax / (margin * amax)`` from now on;
    returns how many chains were changed (an A/B of the headroom, not a product setting)."""
    if not margin >= 1.0:
        raise ValueError(f"margin={margin!r}: a delayed scale's margin is a factor >= 1.0")
    chains = [m for m in model.modules() if isinstance(m, ChainMLP)]
    for m in chains:
        m.margin = float(margin)
    return len(chains)


def set_grad_format(model: nn.Module, grad_format: str) -> int:
    """Every :class:`ChainMLP` of ``model`` casts its gradients to ``grad_format`` (``"e4m3"`` or
    ``"e5m2"``) from now on; returns how many chains were changed (an A/B, not a product setting)."""
    from loka_tune.kernels.chain import GRAD_FORMATS

    if grad_format not in GRAD_FORMATS:
        raise ValueError(f"grad_format={grad_format!r}: a chain casts its gradients to one of {sorted(GRAD_FORMATS)}")
    chains = [m for m in model.modules() if isinstance(m, ChainMLP)]
    for m in chains:
        m.grad_format = grad_format
    return len(chains)


class AmaxTrace:
    """Records every :class:`ChainMLP`'s ``amax`` after each training step (``after_step`` of
    :func:`loka_tune.objectives.trainer.train`): one on-device copy a chain a step, read back once
    by :meth:`summary`, so the run is not synchronised per step.

    Step ``t`` cast each operand with ``fmax / (margin * amax_{t-1})``: where ``amax_t`` exceeds
    ``margin * amax_{t-1}``, that step saturated the operand's largest values (at +-448). The
    summary gives, per chain, the largest step-to-step growth of each kind of operand (``x``,
    ``w``, ``dy``), where it happened, and how many (step, operand) pairs went over the margin.
    The first recorded step is the first trained one (its scales came from the calibration,
    which is not recorded), so growth is read from the second step on."""

    def __init__(self, model: nn.Module) -> None:
        self.chains = {n: m for n, m in model.named_modules() if isinstance(m, ChainMLP)}
        self.steps: list[int] = []
        self.values: dict[str, list[torch.Tensor]] = {n: [] for n in self.chains}

    def __call__(self, steps_done: int) -> None:
        self.steps.append(steps_done)
        for n, m in self.chains.items():
            self.values[n].append(m.amax.detach().clone())

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for n, m in self.chains.items():
            vals = self.values[n]
            if len(vals) < 2:
                continue
            a = torch.stack(vals).double().cpu()  # (steps, slots)
            growth = a[1:] / a[:-1].clamp(min=1e-30)  # (steps - 1, slots)
            names = slot_names(a.shape[1] // 3)
            over = growth > m.margin
            kinds: dict[str, Any] = {}
            for kind in ("x", "w", "dy"):
                cols = [j for j, s in enumerate(names) if s.rstrip("0123456789") == kind]
                g = growth[:, cols]
                flat = int(torch.argmax(g).item())
                t, j = divmod(flat, len(cols))
                kinds[kind] = {"max_growth": round(float(g.max()), 4), "at_step": self.steps[t + 1],
                               "operand": names[cols[j]], "steps_over_margin": int(over[:, cols].any(dim=1).sum())}
            out[n] = {"margin": m.margin, "grad_format": m.grad_format, "steps": len(vals),
                      "over_margin": int(over.sum()), **kinds,
                      "first": _rounded(a[0], names), "last": _rounded(a[-1], names)}
        return out


def _rounded(row: torch.Tensor, names: Sequence[str]) -> dict[str, float]:
    return {s: float(f"{float(v):.4g}") for s, v in zip(names, row)}
