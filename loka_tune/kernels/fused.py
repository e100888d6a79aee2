"""Fused Linear -> BlockNorm -> Hard Swish (LoKA "Mods": the fused GEMM epilogue).

A chain ``hardswish(blocknorm(linear(x)))`` runs as one FP8 GEMM whose epilogue dequantizes,
normalizes each block of ``b`` output features and applies Hard Swish, so the GEMM output
never makes a round trip through memory before the norm and the activation:

- forward: ``X`` and ``W`` quantized rowwise (our fused Triton quantization), then one
  Triton kernel (:mod:`loka_tune.kernels.triton_epilogue`) writes ``h`` (bf16), the pre-norm
  ``y`` (bf16) and the per-row per-block ``rstd`` (float32) for the backward, and optionally
  a rowwise FP8 copy of ``h`` for the next layer;
- backward: one elementwise Triton kernel turns ``dh`` into ``dy`` (Hard Swish' and
  BlockNorm's backward: ``dz = dh * hardswish'(z)``, ``dy = rstd * (dz - z * mean_b(dz * z))``
  with ``z = y * rstd``), then dgrad ``dX = dy @ W`` and wgrad ``dW = dy^T @ X`` run as
  ordinary GEMMs through the registered backends (``get_backend(choice.backend).gemm``), with
  their own choices (``dgrad`` / ``wgrad``), as in :class:`~loka_tune.kernels.linear.LokaLinear`.

Epilogue choices (the ``fwd`` GEMM choice selects the implementation by its backend):

- ``<fmt>.row[.pow2][.fa].triton`` — the Triton kernel (CUDA, e4m3/e5m2 operands, rowwise
  scales; ``fa`` = fast accumulation, the fastest FP8 GEMM on the H200);
- ``<fmt>.<gran>[.pow2].emulated`` — the pure-torch reference with the same semantics
  (CPU and GPU; the oracle): the emulated GEMM of
  :mod:`loka_tune.kernels.emulated`, then BlockNorm and Hard Swish exactly as the unfused
  modules compute them, with the backward written by hand like the Triton kernel's.

The model pass that swaps (Linear, BlockNorm, Hardswish) chains for
:class:`FusedLinearBlockNormHardswish` (which keeps the original modules as children, so the
parameter names and the state dict do not change for containers) and undoes it is
:func:`loka_tune.mods.fuse.fuse_epilogues` / :func:`~loka_tune.mods.fuse.unfuse_epilogues`. As a
Mod (``ModsConfig.fuse_epilogue``), :func:`loka_tune.apply` runs it with ``choice=None`` after
the precision swap: each chain with its own LokaLinear's choices.

Layering: kernels must not import :mod:`loka_tune.mods`; BlockNorm lives in
:mod:`loka_tune.layers` (the bottom layer), so it is recognised with ``isinstance``.
Importing this module does not import triton (the Triton path imports it on first use).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loka_tune.config import Format, GemmChoice, GemmRole, Granularity, SitePrecision
from loka_tune.errors import UnsupportedChoiceError
from loka_tune.kernels.linear import LokaLinear, is_eligible
from loka_tune.kernels.registry import get_backend
from loka_tune.layers import BlockNorm

__all__ = [
    "DEFAULT_CHOICE",
    "EPILOGUE_BACKENDS",
    "FusedLinearBlockNormHardswish",
    "any_hooked",
    "effective_block",
    "epilogue_supports",
    "fused_linear_blocknorm_hardswish",
    "reference_epilogue",
    "reference_epilogue_backward",
]

DEFAULT_CHOICE = "e4m3.row.fa.triton"
#: backends that implement the fused epilogue (the ``fwd`` choice's backend picks one)
EPILOGUE_BACKENDS = ("triton", "emulated")
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_TRITON_FORMATS = (Format.E4M3, Format.E5M2)


# ----------------------------------------------------------------------------- support
def effective_block(n: int, block: int) -> int:
    """The BlockNorm block the epilogue uses on an output of width ``n``: ``block``, at most ``n``."""
    return min(block, n)


def epilogue_supports(choice: GemmChoice | str, *, n: int, block: int, device: str | torch.device | None = None) -> str | None:
    """None when the fused epilogue runs ``choice`` for an output width ``n`` and BlockNorm
    block ``block`` on ``device``; otherwise the reason (a sentence naming the fix)."""
    c = GemmChoice.parse(choice) if isinstance(choice, str) else choice
    b = effective_block(n, block)
    if n % b:
        return (f"output width {n} is not a multiple of the BlockNorm block {block} (ragged last block):"
                " the fused epilogue needs whole blocks; pad the layer or pick a block that divides it")
    if c.is_bf16:
        return f"the fwd GEMM is {c.short_str()!r}: the fused epilogue is an FP8 GEMM (nothing to fuse)"
    if c.backend not in EPILOGUE_BACKENDS:
        return (f"the fused epilogue runs fwd choices of the backends {list(EPILOGUE_BACKENDS)}, not"
                f" {c.short_str()!r}; use e.g. 'e4m3.row.fa.triton' (CUDA) or an '.emulated' choice")
    if c.backend == "emulated":
        return None
    if c.a_format not in _TRITON_FORMATS or c.b_format not in _TRITON_FORMATS or c.granularity != Granularity.ROW:
        return (f"the Triton fused epilogue runs rowwise-scaled e4m3/e5m2 GEMMs, not {c.short_str()!r};"
                " use e.g. 'e4m3.row.fa.triton' (or an '.emulated' choice)")
    if b & (b - 1) or not 16 <= b <= 512:
        return f"the Triton fused epilogue needs a power-of-two block in [16, 512], got an effective block of {b}"
    if device is not None and torch.device(device).type != "cuda":
        return f"the Triton fused epilogue runs on CUDA, not {torch.device(device).type!r}; use an '.emulated' choice"
    return None


def _check(choice: GemmChoice, n: int, block: int, device: torch.device) -> None:
    reason = epilogue_supports(choice, n=n, block=block, device=device)
    if reason is not None:
        raise UnsupportedChoiceError(f"fused Linear->BlockNorm->Hardswish with {choice.short_str()!r}: {reason}")


# ----------------------------------------------------------------------------- reference math
def reference_epilogue(y: torch.Tensor, block: int, eps: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hardswish(blocknorm(y)), rstd)`` for ``y`` ``(M, N)``, ``N`` a multiple of the block.

    Exactly :class:`loka_tune.layers.BlockNorm` (statistics in at least float32, result cast back
    to ``y.dtype``) followed by ``F.hardswish``; ``rstd`` ``(M, N / b)`` in the statistics dtype.
    """
    m, n = y.shape
    b = effective_block(n, block)
    yb = y.unflatten(-1, (n // b, b))
    yf = yb.float() if yb.dtype in _LOW_PRECISION else yb
    e = torch.finfo(y.dtype).eps if eps is None else eps
    rstd = torch.rsqrt(yf.square().mean(dim=-1, keepdim=True) + e)  # (M, N/b, 1)
    z = (yf * rstd).to(y.dtype).flatten(-2)
    return F.hardswish(z), rstd.squeeze(-1)


def reference_epilogue_backward(dh: torch.Tensor, ypre: torch.Tensor, rstd: torch.Tensor, block: int) -> torch.Tensor:
    """``dy`` from ``dh``: Hard Swish' then BlockNorm's backward, in at least float32 (the
    math of the Triton backward kernel). Returned in ``ypre.dtype``."""
    m, n = ypre.shape
    b = effective_block(n, block)
    wd = torch.float32 if ypre.dtype in _LOW_PRECISION else ypre.dtype
    y = ypre.to(wd).unflatten(-1, (n // b, b))
    r = rstd.to(wd).unsqueeze(-1)  # (M, N/b, 1)
    z = y * r
    g = torch.where(z < -3, torch.zeros_like(z), torch.where(z <= 3, z / 3 + 0.5, torch.ones_like(z)))
    dz = dh.to(wd).unflatten(-1, (n // b, b)) * g
    c = (dz * z).mean(dim=-1, keepdim=True)
    return (r * (dz - z * c)).flatten(-2).to(ypre.dtype)


def _gemm(a: torch.Tensor, b: torch.Tensor, choice: GemmChoice, role: GemmRole) -> torch.Tensor:
    if choice.is_bf16 and choice.backend == "bf16":
        return a @ b.t()
    return get_backend(choice.backend).gemm(a, b, choice, role)


# ----------------------------------------------------------------------------- autograd
class _FusedFn(torch.autograd.Function):
    """Autograd of the fused chain on a 2-D input; returns ``(h, q, q_inv_scale)``
    (``q`` / ``q_inv_scale`` empty unless ``out_fp8``; not differentiable)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,  # (M, K)
        weight: torch.Tensor,  # (N, K)
        bias: torch.Tensor | None,  # (N,)
        block: int,
        eps: float | None,
        prec: SitePrecision,
        dtype: torch.dtype,
        out_fp8: bool,
        save: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with torch.autocast(x.device.type, enabled=False):  # the reference's fp32 GEMM stays fp32
            return _FusedFn._forward(ctx, x, weight, bias, block, eps, prec, dtype, out_fp8, save)

    @staticmethod
    def _forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block: int,
                 eps: float | None, prec: SitePrecision, dtype: torch.dtype, out_fp8: bool,
                 save: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        fwd = prec.fwd
        xc, wc = x.to(dtype), weight.to(dtype)
        n = wc.shape[0]
        b = effective_block(n, block)
        e = torch.finfo(dtype).eps if eps is None else float(eps)
        q, qs = xc.new_empty(0), xc.new_empty(0)
        if fwd.backend == "triton":
            from loka_tune.kernels import triton_epilogue, triton_quant

            qx = triton_quant.quantize(xc, fwd.a_format, Granularity.ROW, fwd.rounding)
            qw = triton_quant.quantize(wc, fwd.b_format, Granularity.ROW, fwd.rounding, is_weight=True)
            res = triton_epilogue.fused_forward(
                qx.data, qx.inv_scale, qw.data, qw.inv_scale, bias, b, e, fast_accum=fwd.fast_accum,
                save=save, out_fp8=Format.E4M3 if out_fp8 else None, out_rounding=fwd.rounding)
            h = res["out"]
            ypre, rstd = (res["ypre"], res["rstd"]) if save else (h, h)  # inference: nothing saved
            if h.dtype != dtype:
                h = h.to(dtype)
            if out_fp8:
                q, qs = res["q"], res["q_inv_scale"]
        else:  # reference: the unfused chain's exact forward
            y = _gemm(xc, wc, fwd, GemmRole.FWD)  # (M, N) in dtype
            if bias is not None:
                y = y + bias.to(dtype)
            h, rstd = reference_epilogue(y, b, e)
            ypre = y
            if out_fp8:
                from loka_tune.kernels.quant import quantize

                qt = quantize(h, Format.E4M3, Granularity.ROW, fwd.rounding)
                q, qs = qt.data, qt.inv_scale()
        if save:
            ctx.save_for_backward(xc, wc, ypre, rstd)
        ctx.meta = (b, prec, dtype, x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(q, qs)
        return h, q, qs

    @staticmethod
    def backward(ctx: Any, dh: torch.Tensor, _dq: Any, _dqs: Any) -> tuple[torch.Tensor | None, ...]:
        xc, wc, ypre, rstd = ctx.saved_tensors
        b, prec, dtype, x_dtype, w_dtype, b_dtype = ctx.meta
        if prec.fwd.backend == "triton":
            from loka_tune.kernels import triton_epilogue

            dy = triton_epilogue.fused_backward(dh, ypre, rstd, b, out_dtype=dtype)
        else:
            dy = reference_epilogue_backward(dh, ypre, rstd, b).to(dtype)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _gemm(dy, wc.t(), prec.dgrad, GemmRole.DGRAD).to(x_dtype)  # (M, K)
        if ctx.needs_input_grad[1]:
            dw = _gemm(dy.t(), xc.t(), prec.wgrad, GemmRole.WGRAD).to(w_dtype)  # (N, K)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            db = dy.to(torch.float32).sum(0).to(b_dtype)
        return dx, dw, db, None, None, None, None, None, None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def fused_linear_blocknorm_hardswish(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    block: int,
    eps: float | None = 1e-6,
    precision: SitePrecision | str = DEFAULT_CHOICE,
    out_fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``hardswish(blocknorm(x @ weight.T + bias))`` fused; ``x`` ``(..., K)``.

    ``precision``: the fwd choice selects the epilogue implementation (see the module
    docstring); dgrad / wgrad are ordinary GEMM choices. Returns ``(h, q, q_inv_scale)``:
    ``h`` ``(..., N)`` in the compute dtype (autocast dtype if on, else ``x.dtype``), and with
    ``out_fp8`` the rowwise e4m3 copy of ``h`` ``(M, N)`` and its ``(M, 1)`` float32
    dequantization factors (reference semantics; not differentiable), else ``None``s.
    """
    prec = SitePrecision.from_obj(precision, key="precision")
    n = weight.shape[0]
    _check(prec.fwd, n, block, x.device)
    lead = x.shape[:-1]
    # the backward's tensors (pre-norm output, rstd) are written only when a backward can follow
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    h, q, qs = _FusedFn.apply(x.reshape(-1, x.shape[-1]), weight, bias, block, eps, prec, _compute_dtype(x), out_fp8, save)
    h = h.reshape(*lead, n)
    return (h, q, qs) if out_fp8 else (h, None, None)


# ----------------------------------------------------------------------------- module
def any_hooked(*mods: nn.Module) -> bool:
    """Whether any of ``mods`` has forward (pre-)hooks or backward hooks (also used by the
    fuse pass, :mod:`loka_tune.mods.fuse`)."""
    return any(getattr(m, a, None) for m in mods for a in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"))


class FusedLinearBlockNormHardswish(nn.Module):
    """``act(norm(linear(x)))`` as one fused epilogue GEMM; see the module docstring.

    Keeps ``linear`` (an ``nn.Linear`` or :class:`LokaLinear`, whose parameters it uses),
    ``norm`` (a parameter-free BlockNorm: its ``block`` and ``eps``) and ``act``
    (``nn.Hardswish``) as children, so parameter names are those of the replaced container.
    ``choice``: the fused fwd choice (``"e4m3.row.fa.triton"``, ``"e4m3.row.emulated"``, ...);
    ``dgrad`` / ``wgrad``: the backward GEMM choices (default: a LokaLinear's own, else
    ``choice``). ``choice=None``: ``linear`` must be a :class:`LokaLinear` and the module
    follows its ``precision`` (all three GEMMs, also when it changes later; ``dgrad`` /
    ``wgrad`` must then be ``None``). ``out_fp8=True``: :meth:`forward_fp8` also returns the
    rowwise e4m3 output.

    While ``linear`` has forward hooks or pre-hooks (site discovery, the probe), :meth:`forward`
    runs the unfused chain ``act(norm(linear(x)))`` so that the hooks see the linear's real
    input and output; the result is that of the linear's own precision (a plain ``nn.Linear``:
    unquantized).
    """

    def __init__(self, linear: nn.Linear, norm: nn.Module, act: nn.Module | None = None, *,
                 choice: GemmChoice | str | None = DEFAULT_CHOICE, dgrad: GemmChoice | str | None = None,
                 wgrad: GemmChoice | str | None = None) -> None:
        super().__init__()
        if not is_eligible(linear):
            raise TypeError(f"linear must be an nn.Linear or a LokaLinear, got {type(linear).__name__}")
        if not isinstance(norm, BlockNorm):
            raise TypeError(f"norm must be a loka_tune.layers.BlockNorm, got {type(norm).__name__}")
        if getattr(norm, "weight", None) is not None:
            raise UnsupportedChoiceError("the fused epilogue implements the parameter-free BlockNorm; this one has an affine weight")
        self.linear = linear
        self.norm = norm
        self.act = act if act is not None else nn.Hardswish()
        if type(self.act) is not nn.Hardswish:
            raise TypeError(f"act must be nn.Hardswish, got {type(self.act).__name__}")
        # where the chain came from, for unfuse_epilogues (plain attributes: not submodules)
        self._origin: nn.Module | None = None  # the replaced container
        self._seq_keys: tuple[str, str, str] | None = None  # or the keys of an nn.Sequential run
        self._follow = choice is None
        if self._follow:
            if not isinstance(linear, LokaLinear):
                raise UnsupportedChoiceError(
                    f"choice=None follows the linear's LokaLinear precision, but the linear is a plain"
                    f" {type(linear).__name__} (bf16): give an explicit choice or apply a precision first")
            if dgrad is not None or wgrad is not None:
                raise ValueError("choice=None takes all three GEMMs from the LokaLinear: leave dgrad and wgrad None")
            self._precision = linear.precision
        else:
            assert choice is not None  # not self._follow
            fwd = GemmChoice.parse(choice)
            own = linear.precision if isinstance(linear, LokaLinear) else None
            dg = GemmChoice.parse(dgrad, key="dgrad") if dgrad is not None else (own.dgrad if own is not None else fwd)
            wg = GemmChoice.parse(wgrad, key="wgrad") if wgrad is not None else (own.wgrad if own is not None else fwd)
            self._precision = SitePrecision(fwd, dg, wg)
        fwd = self.precision.fwd
        reason = epilogue_supports(fwd, n=linear.out_features, block=norm.block)
        if reason is not None:
            raise UnsupportedChoiceError(f"cannot fuse with {fwd.short_str()!r}: {reason}")

    @property
    def precision(self) -> SitePrecision:
        """The fwd (fused) and dgrad / wgrad choices (with ``choice=None``: the LokaLinear's, now)."""
        if self._follow:
            own = getattr(self.linear, "precision", None)
            if own is None:
                raise UnsupportedChoiceError(
                    f"this fused chain follows its linear's precision, but the linear is now a plain"
                    f" {type(self.linear).__name__}: unfuse it (loka_tune.mods.fuse.unfuse_epilogues)")
            return own
        return self._precision

    @precision.setter
    def precision(self, value: SitePrecision | str) -> None:
        self._precision = SitePrecision.from_obj(value, key="precision")
        self._follow = False

    @property
    def follows_linear(self) -> bool:
        """Whether the precision is the linear's (``choice=None``)."""
        return self._follow

    @property
    def block(self) -> int:
        return int(self.norm.block)

    @property
    def eps(self) -> float | None:
        return self.norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., K) -> (..., N)
        if any_hooked(self.linear):  # let hooks on the linear see its input and output
            return self.act(self.norm(self.linear(x)))
        h, _, _ = fused_linear_blocknorm_hardswish(x, self.linear.weight, self.linear.bias, block=self.block,
                                                    eps=self.eps, precision=self.precision)
        return h

    def forward_fp8(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(h, q, q_inv_scale)``: ``h`` as :meth:`forward` plus its rowwise e4m3 copy ``(M, N)``
        and ``(M, 1)`` dequantization factors, for a next layer that takes FP8 input."""
        h, q, qs = fused_linear_blocknorm_hardswish(x, self.linear.weight, self.linear.bias, block=self.block,
                                                     eps=self.eps, precision=self.precision, out_fp8=True)
        assert q is not None and qs is not None
        return h, q, qs

    def extra_repr(self) -> str:
        return f"block={self.block}, eps={self.eps}, precision={self.precision.short_str()}"
