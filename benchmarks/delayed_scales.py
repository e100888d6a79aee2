"""Training with delayed activation and gradient scales, each FP8 copy cast by the operand's own
producer: the experiment behind e2e.py's ``delayed_tensorwise_filter`` variant (issue 21).

Why: on torchao's 15 tensorwise sites of large Wukong (H100, B = 8192, 2026-12-07,
``e2e_dualcast_inline_h100_s30.json``) the FP8 GEMMs save about 5.0 ms a step and the casts give
2.9 ms of it back. With a scale from the operand's own amax, the cast must wait for a reduction
over the whole tensor, so the producer (the norm and Hard Swish before a Linear, Hard Swish's and
the norm's backward before its ``dy``) writes the operand in bf16 and a second kernel reads it back
to cast it: 2 bytes written, 2 read and 2 written an element (both FP8 layouts). A *delayed*
scale (the amax of the step before, times a margin) is known before the producer runs, so the
cast is elementwise and inductor can fuse it into the producer, which then writes the row-major
FP8 copy (1 byte) and no bf16 copy when nothing else reads it; the transposed copy that the wgrad
takes (Hopper's FP8 GEMMs take both operands K-major) is then a transpose of the FP8 copy (1 byte
read, 1 written). That is 3 bytes an element instead of 6, for ``x`` and ``dy``. The amax for the
next step is a reduction that inductor already fuses into the producer (2026-12-06, third session:
``triton_red_fused_..._abs_amax_..._rsqrt_...``). Earlier, a *calibrated* (fixed) input scale did
not pay (0.998x torchao's line, ``benchmarks/static_scales.py``); that variant cast ``x^T`` from
the bf16 ``x`` and kept ``dy``'s own amax, so the producer still wrote ``x`` in bf16. Whether the
delayed form pays, and what it costs in loss, is what this variant measures before the product
grows it.

:class:`DelayedScaleLinear` is an ``nn.Linear`` whose three GEMMs run in e4m3 tensorwise through
``torch._scaled_mm`` (fast accumulation in the forward GEMM only, torchao's tensorwise recipe).
``x`` and ``dy`` are cast with ``fmax / (margin * amax)``, ``amax`` the buffer ``x_amax`` /
``g_amax`` that the step before left (values past it saturate at +-448); each call then stores its
operand's own amax there for the next. The weight keeps its own amax per call (the optimizer
writes it outside the graph, so nothing could fuse its cast). :func:`calibrate` fills the buffers
with one forward and backward of real batches, cast with their own amaxes, before training.

``dual=True`` (e2e.py's ``delayed_dualcast_tensorwise_filter``) casts every operand, the weight
included, with a delayed scale through one Triton kernel that writes both FP8 layouts from one
read *and* takes the operand's amax for the next step in the same pass (an atomic max per tile:
:func:`cast_dual_amax`). That removes the weights' own amax pass: with the product's dual cast
(``config_dualcast``) each step still reads every fp32 master weight twice, once for its amax and
once to cast it (15 reductions, ~0.3 ms a step at B = 8192 on an H100, 2026-12-07); here once.
``x`` and ``dy`` are then written in bf16 by their producers and read once by the kernel, as in
the product's dual cast, but their amax reductions leave the producers' kernels.

Measured (one H100, 2026-12-07, third session; BENCHMARKS.md, "Delayed scales in the compiled
step"): the first form ran 1.0054x / 1.0060x torchao's line at B = 8192 (seeds 0 / 1) and 0.998x
at 32768. Inductor did not write the FP8 copies from the norm's pass: it recomputed the norm and
Hard Swish from the GEMM's bf16 output in two cast kernels, one a layout. The ``dual`` form ran
1.0305x / 1.0308x torchao's line at B = 8192 (seeds 0 / 1; H100, 2026-12-07, fourth session,
"The FP8 chain on an H100"); its kernel now saturates with ``tl.where`` (see
:mod:`loka_tune.kernels.chain`, where it lives), a form not yet run on a GPU.

Benchmark code, not the product: the product's path is ``loka_tune.apply`` with a config.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

# the constants and the dual-amax cast live in the product (loka_tune.kernels.chain), with the chain
from loka_tune.kernels.chain import (  # noqa: F401  (re-exported for the tests and e2e.py)
    E4M3,
    FMAX,
    MARGIN,
    _multiplier,
    cast_dual_amax,
    cast_dual_amax_reference,
)
from loka_tune.kernels.chain import prepare_cast_kernel as prepare_kernel  # noqa: F401

__all__ = ["DelayedScaleLinear", "swap_delayed", "calibrate", "cast_dual_amax", "cast_dual_amax_reference", "MARGIN"]


def _cast(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``t`` times ``scale``, saturated at +-448, in e4m3, K-contiguous (the layout of ``t`` when it
    is row-major: elementwise, fused into ``t``'s producer when compiled)."""
    q = (t.to(torch.float32) * scale).clamp(-FMAX, FMAX).to(E4M3)
    return q if q.stride(-1) == 1 else q.contiguous()


def _own_amax(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32).abs().amax()  # ()


class _DelayedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, x_amax: torch.Tensor, g_amax: torch.Tensor,
                margin: float, own: bool, w_amax: torch.Tensor | None = None) -> torch.Tensor:
        # x (M, K) in the compute dtype; w (N, K): that dtype, or (dual, w_amax given) the fp32 master weight
        dual = w_amax is not None and not own
        if dual:  # one kernel a operand: both layouts and the next step's amax
            assert w_amax is not None
            sx = _multiplier(x_amax, margin)
            qx, qxt, ax = cast_dual_amax(x, sx)  # (M, K), (K, M), (1,)
            x_amax.copy_(ax.reshape(()))
            sw = _multiplier(w_amax, margin)
            qw, qwt, aw = cast_dual_amax(w, sw, via=x.dtype if w.dtype != x.dtype else None)  # (N, K), (K, N)
            w_amax.copy_(aw.reshape(()))
        else:
            amax_now = _own_amax(x)  # () the amax the next step's scale is taken from
            sx = _multiplier(amax_now if own else x_amax, 1.0 if own else margin)  # ()
            qx = _cast(x, sx)  # (M, K)
            x_amax.copy_(amax_now)  # after sx was formed from the old value
            qxt = qx.t().contiguous()  # (K, M): the wgrad's operand, transposed from the FP8 copy
            wc = w.to(x.dtype)
            w_now = _own_amax(wc)
            sw = _multiplier(w_now, 1.0)
            if w_amax is not None:
                w_amax.copy_(w_now)
            qw = _cast(wc, sw)  # (N, K)
            qwt = qw.t().contiguous()  # (K, N): the dgrad's operand
        x_inv, w_inv = sx.reciprocal(), sw.reciprocal()
        y = torch._scaled_mm(qx, qw.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=x.dtype, use_fast_accum=True)
        ctx.save_for_backward(qxt, qwt, x_inv, w_inv)
        ctx.g_amax, ctx.margin, ctx.own, ctx.dual, ctx.dtypes = g_amax, margin, own, dual, (x.dtype, w.dtype)
        return y  # (M, N)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        qxt, qwt, x_inv, w_inv = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        g_amax = ctx.g_amax
        dy = dy.to(x_dtype)  # (M, N)
        if ctx.dual:
            sg = _multiplier(g_amax, ctx.margin)
            qg, qgt, ag = cast_dual_amax(dy, sg)  # (M, N), (N, M), (1,)
            g_amax.copy_(ag.reshape(()))
        else:
            amax_now = _own_amax(dy)
            sg = _multiplier(amax_now if ctx.own else g_amax, 1.0 if ctx.own else ctx.margin)
            qg = _cast(dy, sg)  # (M, N)
            g_amax.copy_(amax_now)
            qgt = qg.t().contiguous()  # (N, M)
        g_inv = sg.reciprocal()
        dx = torch._scaled_mm(qg, qwt.t(), scale_a=g_inv, scale_b=w_inv, out_dtype=x_dtype)  # (M, K)
        dw = torch._scaled_mm(qgt, qxt.t(), scale_a=g_inv, scale_b=x_inv, out_dtype=torch.float32)  # (N, K)
        return dx, dw.to(w_dtype), None, None, None, None, None


class DelayedScaleLinear(nn.Linear):
    """``nn.Linear`` in e4m3 tensorwise with delayed scales for ``x`` and ``dy`` (see the module doc).

    Buffers ``x_amax`` and ``g_amax`` (float32 ``()``) hold the amax of the last call's input and
    output gradient, ``w_amax`` its weight's (``dual``: the weight's scale is delayed too, and
    every operand is cast by :func:`cast_dual_amax`). ``own_scales`` (set by :func:`calibrate`
    while it runs): cast with each operand's own amax instead, as torchao's dynamic recipe does.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, margin: float = MARGIN,
                 dual: bool = False, device: Any = None, dtype: Any = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin >= 1.0):
            raise ValueError(f"margin={margin!r}: a delayed scale's margin is a factor >= 1.0")
        self.margin = float(margin)
        self.own_scales = False
        self.dual = bool(dual)
        if self.dual:
            prepare_kernel()
        self.register_buffer("x_amax", torch.zeros((), device=device))
        self.register_buffer("g_amax", torch.zeros((), device=device))
        self.register_buffer("w_amax", torch.zeros((), device=device))

    @classmethod
    def from_linear(cls, lin: nn.Linear, *, margin: float = MARGIN, dual: bool = False) -> "DelayedScaleLinear":
        new = cls(lin.in_features, lin.out_features, lin.bias is not None, margin=margin, dual=dual, device="meta")
        new.weight = lin.weight
        new.bias = lin.bias
        for name in ("x_amax", "g_amax", "w_amax"):  # the buffers, off the meta device
            setattr(new, name, torch.zeros((), device=lin.weight.device))
        return new

    @property
    def calibrated(self) -> bool:
        return bool(self.x_amax > 0) and bool(self.g_amax > 0) and (not self.dual or bool(self.w_amax > 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., K) -> (..., N)
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(dtype)  # (M, K)
        with torch.autocast(dev, enabled=False):
            if self.dual:  # the fp32 master weight: the kernel rounds it to the compute dtype as it reads
                y = _DelayedFn.apply(x2, self.weight, self.x_amax, self.g_amax, self.margin, self.own_scales,
                                     self.w_amax)
            else:
                y = _DelayedFn.apply(x2, self.weight.to(dtype), self.x_amax, self.g_amax, self.margin,
                                     self.own_scales)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, margin={self.margin}, dual={self.dual}"


def swap_delayed(model: nn.Module, names: Iterable[str], *, margin: float = MARGIN, dual: bool = False) -> list[str]:
    """Replace the named plain ``nn.Linear`` modules of ``model`` by :class:`DelayedScaleLinear`
    (weights shared, in place; ``dual``: see the class); returns the names swapped, sorted."""
    wanted = set(names)
    done = []
    for name, mod in list(model.named_modules()):
        if name in wanted and type(mod) is nn.Linear:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, DelayedScaleLinear.from_linear(mod, margin=margin, dual=dual))
            done.append(name)
    missing = wanted - set(done)
    if missing:
        raise ValueError(f"no plain nn.Linear named {sorted(missing)} in the model")
    return sorted(done)


def calibrate(model: nn.Module, batches: Sequence[tuple[Any, ...]], loss_fn: Callable[[Any, int], torch.Tensor], *,
              autocast: torch.dtype | None = torch.bfloat16) -> dict[str, tuple[float, float]]:
    """Fill every :class:`DelayedScaleLinear`'s ``x_amax`` / ``g_amax`` from real batches: each of
    ``batches`` (the model's positional inputs) runs forward and ``loss_fn(output, i)`` backward
    with every operand cast by its own amax; the buffers keep the largest amax seen (``w_amax``
    the weight's). The
    gradients this leaves are cleared (the parameters do not move). Returns ``{name: (x amax,
    dy amax)}``."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, DelayedScaleLinear)}
    if not layers:
        return {}
    if not batches:
        raise ValueError("calibrate needs at least one batch")
    dev = next(iter(layers.values())).weight.device
    seen = {n: (0.0, 0.0) for n in layers}
    try:
        for m in layers.values():
            m.own_scales = True
        for i, b in enumerate(batches):
            with torch.autocast(dev.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                out = model(*b)
            loss_fn(out, i).backward()
            for n, m in layers.items():
                seen[n] = (max(seen[n][0], float(m.x_amax)), max(seen[n][1], float(m.g_amax)))
    finally:
        for m in layers.values():
            m.own_scales = False
        model.zero_grad(set_to_none=True)
    for n, m in layers.items():
        xa, ga = seen[n]
        if not (math.isfinite(xa) and xa > 0 and math.isfinite(ga) and ga > 0):
            raise ValueError(f"{n}: amaxes {xa!r} / {ga!r} after calibration; calibrate on batches whose inputs "
                             "and gradients at this layer are finite and not all zero")
        if m.dual and not (math.isfinite(float(m.w_amax)) and float(m.w_amax) > 0):
            raise ValueError(f"{n}: its weight's amax is {float(m.w_amax)!r}; a delayed weight scale needs a finite, "
                             "nonzero weight")
        m.x_amax.fill_(xa)
        m.g_amax.fill_(ga)
    return seen
