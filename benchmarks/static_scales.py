"""Training with a calibrated (static) activation scale: the experiment behind e2e.py's
``static_tensorwise_filter`` variant (issue 21).

Why: under captured CUDA graphs on one H200, serving large Wukong with calibrated tensorwise
activation scales ran 6.63 ms against 7.35 ms for the same sites scaled per call (torchao's
static vs dynamic tensorwise, ``benchmarks/results/serve_h200.json``): a per-call amax is a
reduction over the whole activation, which splits its producer into a reduction kernel and a
cast kernel that recomputes it. Training pays the same split on every quantized activation.
Whether a fixed activation scale pays in the compiled *training* step, and what it costs in
loss, is what this variant measures before the product grows the option.

:class:`StaticScaleLinear` is an ``nn.Linear`` whose three GEMMs run in e4m3 tensorwise through
``torch._scaled_mm`` as torchao's tensorwise recipe does (fast accumulation in the forward GEMM
only), except that the input ``x`` is cast with a fixed multiplier ``x_scale`` (``fmax / (amax
* margin)`` from :func:`calibrate`; values past it saturate at the format's max) instead of its
own amax. The weight and the output gradient keep per-call tensorwise scales. The forward saves
``x`` already quantized and transposed (one byte an element, the wgrad's operand).

Benchmark code, not the product: the product's path is ``loka_tune.apply`` with a config.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["StaticScaleLinear", "swap_static", "calibrate"]

E4M3 = torch.float8_e4m3fn
FMAX = float(torch.finfo(E4M3).max)  # 448
_TINY = FMAX / float(torch.finfo(torch.float32).max)


def _dynamic(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` cast to e4m3 with its own tensorwise scale: ``(data, dequantization factor)``, the
    product's own cast (``loka_tune.kernels.scaled.cast_to_fp8``, exact scales)."""
    from loka_tune.config import Format, Granularity, ScaleRounding
    from loka_tune.kernels.scaled import cast_to_fp8

    return cast_to_fp8(t, Format.E4M3, Granularity.TENSOR, ScaleRounding.EXACT)


def _cast(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (t.float() * scale).clamp(-FMAX, FMAX).to(E4M3)


class _StaticFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor,
                x_inv: torch.Tensor) -> torch.Tensor:  # x (M, K) in the compute dtype, w (N, K)
        qx = _cast(x, x_scale).contiguous()  # (M, K): one elementwise pass, fused into x's producer when compiled
        qw, w_inv = _dynamic(w)  # (N, K)
        y = torch._scaled_mm(qx, qw.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=x.dtype, use_fast_accum=True)
        qxt = _cast(x.t(), x_scale).contiguous()  # (K, M): the wgrad's operand, one byte an element
        ctx.save_for_backward(qxt, w, x_inv)
        ctx.x_dtype = x.dtype
        return y  # (M, N)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        qxt, w, x_inv = ctx.saved_tensors
        dtype = ctx.x_dtype
        dy32 = dy.float()
        g_scale = torch.full((), FMAX, device=dy.device) / dy32.abs().amax().clamp(min=_TINY)
        g_inv = g_scale.reciprocal()
        qg = (dy32 * g_scale).clamp(-FMAX, FMAX).to(E4M3).contiguous()  # (M, N)
        qgt = (dy32.t() * g_scale).clamp(-FMAX, FMAX).to(E4M3).contiguous()  # (N, M)
        qwt, w_inv = _dynamic(w.t().contiguous())  # (K, N): the same amax as w
        dx = torch._scaled_mm(qg, qwt.t(), scale_a=g_inv, scale_b=w_inv, out_dtype=dtype)  # (M, K)
        dw = torch._scaled_mm(qgt, qxt.t(), scale_a=g_inv, scale_b=x_inv, out_dtype=torch.float32)  # (N, K)
        return dx, dw.to(w.dtype), None, None


class StaticScaleLinear(nn.Linear):
    """``nn.Linear`` in e4m3 tensorwise with a calibrated input scale (see the module doc).

    ``x_scale`` / ``x_inv`` are buffers (float32 ``()``); before :func:`calibrate` the layer runs
    in its compute dtype, unquantized (``calibrated`` is False) and records its inputs' amax.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, margin: float = 2.0,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if not (math.isfinite(margin) and margin >= 1.0):
            raise ValueError(f"margin={margin!r}: a calibration margin is a factor >= 1.0")
        self.margin = float(margin)
        self.register_buffer("x_scale", torch.empty(0, device=device))
        self.register_buffer("x_inv", torch.empty(0, device=device))
        self.register_buffer("seen_amax", torch.zeros((), device=device))

    @classmethod
    def from_linear(cls, lin: nn.Linear, *, margin: float = 2.0) -> "StaticScaleLinear":
        new = cls(lin.in_features, lin.out_features, lin.bias is not None, margin=margin,
                  device=lin.weight.device, dtype=lin.weight.dtype)
        new.weight = lin.weight
        new.bias = lin.bias
        return new

    @property
    def calibrated(self) -> bool:
        return self.x_scale.numel() == 1

    @torch.no_grad()
    def fix_scale(self, amax: float | None = None) -> None:
        """Fix the input's multiplier from ``amax`` (default: the largest seen since the last fix)."""
        a = float(self.seen_amax) if amax is None else float(amax)
        if not (math.isfinite(a) and a > 0):
            raise ValueError(f"{a!r}: calibrate on batches whose inputs to this layer are finite and not all zero")
        dev = self.weight.device
        self.x_scale = torch.tensor(FMAX / (a * self.margin), dtype=torch.float32, device=dev)
        self.x_inv = self.x_scale.reciprocal()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., K) -> (..., N)
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        if not self.calibrated:  # calibration pass: plain GEMM, the input's amax recorded
            with torch.no_grad():
                self.seen_amax.copy_(torch.maximum(self.seen_amax, x.detach().float().abs().amax()))
            return super().forward(x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(dtype)  # (M, K)
        with torch.autocast(dev, enabled=False):
            y = _StaticFn.apply(x2, self.weight.to(dtype), self.x_scale, self.x_inv)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)


def swap_static(model: nn.Module, names: Iterable[str], *, margin: float = 2.0) -> list[str]:
    """Replace the named ``nn.Linear`` modules of ``model`` by :class:`StaticScaleLinear`
    (weights shared, in place); returns the names swapped, sorted."""
    wanted = set(names)
    done = []
    for name, mod in list(model.named_modules()):
        if name in wanted and isinstance(mod, nn.Linear) and not isinstance(mod, StaticScaleLinear):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, StaticScaleLinear.from_linear(mod, margin=margin))
            done.append(name)
    missing = wanted - set(done)
    if missing:
        raise ValueError(f"no nn.Linear named {sorted(missing)} in the model")
    return sorted(done)


def calibrate(model: nn.Module, batches: Sequence[tuple[Any, ...]], *,
              autocast: torch.dtype | None = torch.bfloat16) -> dict[str, float]:
    """Run ``batches`` (the model's positional inputs) forward, without gradients, through every
    uncalibrated :class:`StaticScaleLinear` of ``model`` and fix each one's scale from the largest
    input it saw; returns ``{name: amax}``. The model's train/eval mode is kept."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, StaticScaleLinear) and not m.calibrated}
    if not layers:
        return {}
    if not batches:
        raise ValueError("calibrate needs at least one batch")
    for m in layers.values():
        m.seen_amax.zero_()
    dev = next(iter(layers.values())).weight.device
    with torch.no_grad(), torch.autocast(dev.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        for b in batches:
            model(*b)
    out = {}
    for n, m in layers.items():
        out[n] = float(m.seen_amax)
        m.fix_scale()
    return out
