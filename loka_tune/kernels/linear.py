"""``LokaLinear``: a drop-in ``nn.Linear`` whose three GEMMs each run through their own choice.

For an input ``X`` ``(..., K)`` flattened to ``(M, K)`` and weight ``W`` ``(N, K)``:

- fwd:   ``Y  = gemm(X, W)``          -> ``(M, N)``, plus bias
- dgrad: ``dX = gemm(dY, W^T)``       -> ``(M, K)``
- wgrad: ``dW = gemm(dY^T, X^T)``     -> ``(N, K)``
- bias:  ``db = sum(dY, 0)`` in float32 (never quantized)

where ``gemm(A, B) = A @ B.T`` runs the role's :class:`~loka_tune.config.GemmChoice`. How is
decided once, when the precision is set (never per call): plain ``bf16`` is a direct matmul
(all three plain: ``forward`` is ``F.linear``); a backend that offers a direct call path
(:meth:`~loka_tune.kernels.registry.Backend.direct`: the GPU backends) is called through it:
traceable torch code that ``torch.compile`` fuses into the graph (``torch_scaled_mm``,
``torchao``) or one opaque custom op per GEMM (``fbgemm``, ``triton``); everything else (the
``emulated`` oracle, backends that cannot be imported here) goes through the
``torch.ops.loka.gemm`` custom op (see :mod:`loka_tune.kernels.ops`), which also runs the
non-finite check. Under ``torch.compile`` nothing of this dispatch remains at run time.

Quantize once (compiled runs): where two GEMMs of a layer take the same operand tensorwise on
``torch_scaled_mm`` in one format (``X`` in fwd and wgrad, ``W`` in fwd and dgrad, ``dY`` in
dgrad and wgrad), it is quantized once and its FP8 copy (transposed where the other GEMM needs
it) serves both, and the FP8 copies of ``X`` and ``W`` are what forward saves for backward
(:class:`~loka_tune.kernels.scaled.SharePlan`), as torchao's tensorwise training does.
Bit-identical to quantizing per GEMM; eager mode keeps the fused Triton quantization per GEMM.
With the dual-cast mode ``auto`` (on CUDA) or ``on`` (:mod:`loka_tune.kernels.dualcast`; the
default ``off`` keeps inductor's casts, see there why) each shared operand is cast by one kernel
that writes both FP8 layouts from one read (on CUDA ``torch.ops.loka.cast_dual_inline``, which
inductor launches itself; ``torch.ops.loka.cast_dual`` elsewhere), and forward saves the
transposed copies backward takes.

Compute dtype: the autocast dtype when autocast is on for the input's device, else the
input's dtype; operands are cast to it, the output is in it, and gradients come back in the
dtypes of ``X``, ``W`` and the bias. The module has exactly ``nn.Linear``'s parameters
(``weight``, ``bias``), so state dicts load both ways.

Non-finite operands make a quantized GEMM fall back to the unquantized one for that call;
``LokaLinear.nonfinite_fallbacks`` counts them (see :mod:`loka_tune.kernels.ops`). The check
runs where the custom op runs (by default for CPU tensors);
``ops.set_nonfinite_check(True)`` routes every GEMM through it (debugging).
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from loka_tune.config import BF16, ROLES, GemmChoice, Granularity, SitePrecision
from loka_tune.errors import BackendError
from loka_tune.kernels import dualcast, ops
from loka_tune.kernels.dualcast import cast_to_fp8_dual
from loka_tune.kernels.registry import SHAPE_FALLBACKS, Backend, get_backend
from loka_tune.kernels.scaled import NO_SHARE, SharePlan, cast_to_fp8, mm_quantized, share_plan, transposed
from loka_tune.layers import carry_hooks

__all__ = ["LokaLinear", "find_linears", "is_eligible"]

_TAGS = itertools.count()
_PLAIN_BF16 = BF16.short_str()  # "bf16"

GemmFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_NO_DIRECT: tuple[GemmFn | None, GemmFn | None, GemmFn | None] = (None, None, None)


_ROLE_NAMES = tuple(r.value for r in ROLES)  # ("fwd", "dgrad", "wgrad")

#: quantize shared tensorwise operands once in eager mode too (tests; compiled runs always do)
SHARE_IN_EAGER = False


def _backend(choice: str) -> Backend | None:
    """The backend of a non-bf16 choice, or None (plain bf16, or not importable here: the custom
    op then raises the full message at the first call)."""
    if choice == _PLAIN_BF16:
        return None
    try:
        return get_backend(ops.parse_choice(choice).backend)
    except BackendError:
        return None


def _direct(choice: str, role: str) -> GemmFn | None:
    """The backend's direct call path for one GEMM (None: plain bf16, or the custom op)."""
    backend = _backend(choice)
    return None if backend is None else backend.direct(ops.parse_choice(choice), ROLES[_ROLE_NAMES.index(role)])


def _gemm(a: torch.Tensor, b: torch.Tensor, choice: str, role: str, tag: str, fn: GemmFn | None) -> torch.Tensor:
    if choice == _PLAIN_BF16:
        return a @ b.t()
    if fn is not None:
        return fn(a, b)
    return torch.ops.loka.gemm(a, b, choice, role, tag)


class _LokaLinearFn(torch.autograd.Function):
    """The autograd of a LokaLinear on a 2-D input; choices arrive as short_str ids.

    ``share`` (a :class:`~loka_tune.kernels.scaled.SharePlan`, set only while compiling) says
    which tensorwise operands are quantized once for two GEMMs; those GEMMs then run on the FP8
    copies (``cs`` holds the three parsed choices) and the FP8 copies, not the bf16 tensors,
    are saved for backward.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,  # (M, K)
        weight: torch.Tensor,  # (N, K)
        bias: torch.Tensor | None,  # (N,)
        fwd: str,
        dgrad: str,
        wgrad: str,
        fns: tuple[GemmFn | None, GemmFn | None, GemmFn | None],
        tag: str,
        dtype: torch.dtype,
        share: SharePlan = NO_SHARE,
        cs: tuple[GemmChoice, ...] = (),
    ) -> torch.Tensor:
        xc, wc = x.to(dtype), weight.to(dtype)
        saved_x: tuple[torch.Tensor, ...]
        saved_w: tuple[torch.Tensor, ...]
        if share.x or share.w:  # fwd is tensorwise on torch._scaled_mm: quantize, keep the FP8 copies
            c = cs[0]
            # with share.dual, the copy saved for backward is the transposed one the dual cast wrote
            if share.dual and share.x:
                qx, saved_x = cast_to_fp8_dual(xc, c.a_format, c.rounding)  # (M, K), (K, M)
            else:
                qx = cast_to_fp8(xc, c.a_format, Granularity.TENSOR, c.rounding)  # (M, K), ()
                saved_x = qx if share.x else (xc,)
            if share.dual and share.w:  # the kernel reads the fp32 master weight (no bf16 copy)
                qw, saved_w = cast_to_fp8_dual(weight, c.b_format, c.rounding, via=dtype)  # (N, K), (K, N)
            else:
                qw = cast_to_fp8(wc, c.b_format, Granularity.TENSOR, c.rounding)  # (N, K), ()
                saved_w = qw if share.w else (wc,)
            y = mm_quantized(qx, qw, c, dtype)  # (M, N)
        else:
            y = _gemm(xc, wc, fwd, "fwd", tag, fns[0])  # (M, N)
            saved_x, saved_w = (xc,), (wc,)
        if bias is not None:
            y = y + bias.to(dtype)
        ctx.save_for_backward(*saved_x, *saved_w)
        ctx.meta = (dgrad, wgrad, fns, tag, dtype, x.dtype, weight.dtype, None if bias is None else bias.dtype,
                    share, cs, len(saved_x))
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        dgrad, wgrad, fns, tag, dtype, x_dtype, w_dtype, b_dtype, share, cs, nx = ctx.meta
        saved = ctx.saved_tensors
        sx, sw = saved[:nx], saved[nx:]  # (X,) or its FP8 (data, inv_scale); the same for W
        dy = dy.to(dtype)  # (M, N)
        qdy = qdy_t = None
        if share.dy and share.dual:
            qdy, qdy_t = cast_to_fp8_dual(dy, cs[1].a_format, cs[1].rounding)  # (M, N), (N, M)
        elif share.dy:
            qdy = cast_to_fp8(dy, cs[1].a_format, Granularity.TENSOR, cs[1].rounding)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:  # (M, N) @ (K, N).T -> (M, K)
            if share.w or share.dy:
                c = cs[1]
                a = qdy if qdy is not None else cast_to_fp8(dy, c.a_format, Granularity.TENSOR, c.rounding)
                if share.w:  # W^T (K, N): saved transposed by the dual cast, else transposed here
                    b = (sw[0], sw[1]) if share.dual else transposed((sw[0], sw[1]))
                else:
                    b = cast_to_fp8(sw[0].t(), c.b_format, Granularity.TENSOR, c.rounding)
                dx = mm_quantized(a, b, c, dtype).to(x_dtype)
            else:
                dx = _gemm(dy, sw[0].t(), dgrad, "dgrad", tag, fns[1]).to(x_dtype)
        if ctx.needs_input_grad[1]:  # (N, M) @ (K, M).T -> (N, K)
            if share.x or share.dy:
                c = cs[2]
                if qdy_t is not None:
                    a = qdy_t
                elif qdy is not None:
                    a = transposed(qdy)
                else:
                    a = cast_to_fp8(dy.t(), c.a_format, Granularity.TENSOR, c.rounding)
                if share.x:  # X^T (K, M): saved transposed by the dual cast, else transposed here
                    b = (sx[0], sx[1]) if share.dual else transposed((sx[0], sx[1]))
                else:
                    b = cast_to_fp8(sx[0].t(), c.b_format, Granularity.TENSOR, c.rounding)
                dw = mm_quantized(a, b, c, dtype).to(w_dtype)
            else:
                dw = _gemm(dy.t(), sx[0].t(), wgrad, "wgrad", tag, fns[2]).to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            db = dy.to(torch.float32).sum(0).to(b_dtype)  # (N,)
        return dx, dw, db, None, None, None, None, None, None, None, None


class LokaLinear(nn.Linear):
    """``nn.Linear`` with per-GEMM precision (fwd, dgrad, wgrad); see the module docstring.

    ``precision``: a :class:`SitePrecision`, or a string / mapping it parses from
    (``"e4m3.row.emulated"``, ``"fwd|dgrad|wgrad"``). ``name``: the site name (for messages).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        precision: SitePrecision | str | dict[str, str] | None = None,
        name: str = "",
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.site_name = name
        self._tag = f"{name or 'linear'}#{next(_TAGS)}"
        self.precision = SitePrecision() if precision is None else precision

    # ------------------------------------------------------------------ precision
    @property
    def precision(self) -> SitePrecision:
        return self._precision

    @precision.setter
    def precision(self, value: SitePrecision | str | dict[str, str]) -> None:
        p = SitePrecision.from_obj(value, key=f"precision of {self.site_name or 'LokaLinear'}")
        self._precision = p
        self._ids = (p.fwd.short_str(), p.dgrad.short_str(), p.wgrad.short_str())
        self._plain = all(i == _PLAIN_BF16 for i in self._ids)
        self._resolve()

    def _resolve(self) -> None:
        """Resolve each GEMM's call path once (see the module docstring)."""
        fns = tuple(_direct(i, r) for i, r in zip(self._ids, _ROLE_NAMES))
        self._fns = fns if any(f is not None for f in fns) else _NO_DIRECT
        checks = []
        for i, r in zip(self._ids, ROLES):
            be = _backend(i)
            if be is not None and be.runtime_shape_check:
                checks.append((r, be, ops.parse_choice(i)))
        self._shape_checks = tuple(checks)
        self._choices = tuple(ops.parse_choice(i) for i in self._ids)
        self._share = share_plan(*self._choices)
        # the same plan cast by loka::cast_dual (chosen per graph in forward, by the dual-cast mode)
        self._share_dual = replace(self._share, dual=True) if self._share.any else self._share
        self._dual_ok = self._share.any and dualcast.triton_available()
        if self._dual_ok:
            dualcast.prepare_inline()  # the inline form, registered now if the mode asks for it (not under a trace)

    def _fit_to_shape(self, m: int) -> tuple[tuple[str, str, str], tuple[GemmFn | None, ...]]:
        """Choices and call paths for ``m`` rows: bf16 for each GEMM whose backend cannot launch
        at its real shape (recorded in ``registry.SHAPE_FALLBACKS``)."""
        ids, fns = list(self._ids), list(self._fns)
        k, n = self.in_features, self.out_features
        for role, backend, choice in self._shape_checks:
            shape = role.shape(m, k, n)
            reason = backend.runtime_reason(choice, role, shape)
            if reason is not None:
                i = ROLES.index(role)
                SHAPE_FALLBACKS[(backend.name, ids[i], role.value, *shape)] = reason
                ids[i], fns[i] = _PLAIN_BF16, None
        return (ids[0], ids[1], ids[2]), tuple(fns)

    @property
    def nonfinite_fallbacks(self) -> int:
        """GEMM calls of this layer that met a non-finite operand and ran unquantized."""
        return ops.nonfinite_count(self._tag)

    def reset_nonfinite_fallbacks(self) -> None:
        ops.reset_nonfinite(self._tag)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_fns", None)  # closures and backend objects: resolved again on load
        state.pop("_shape_checks", None)
        state.pop("_choices", None)
        state.pop("_share", None)
        state.pop("_share_dual", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled / deep-copied layers get their own non-finite counter."""
        super().__setstate__(state)
        self._tag = f"{self.site_name or 'linear'}#{next(_TAGS)}"
        self._resolve()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_linear(
        cls, linear: nn.Linear, precision: SitePrecision | str | dict[str, str] | None = None, *, name: str = ""
    ) -> "LokaLinear":
        """A LokaLinear sharing ``linear``'s ``weight`` and ``bias`` Parameters (no copy).

        The new module takes over ``linear``'s training flag and its forward hooks/pre-hooks.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear takes an nn.Linear, got {type(linear).__name__}")
        new = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",  # no allocation / init: the parameters are replaced below
            precision=precision,
            name=name,
        )
        new.weight = linear.weight
        new.bias = linear.bias
        carry_hooks(linear, new)  # its train mode and forward hooks
        return new

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., K) -> (..., N)
        if self._plain:
            return F.linear(x, self.weight, self.bias)
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])  # (M, K)
        (fwd, dgrad, wgrad), fns = (self._ids, self._fns) if not self._shape_checks else self._fit_to_shape(x2.shape[0])
        share, cs = NO_SHARE, self._choices
        if ops.nonfinite_check_forced():
            fns = _NO_DIRECT
        elif self._share.any and (SHARE_IN_EAGER or torch.compiler.is_compiling()):
            # eager keeps the fused Triton quantization per GEMM; compiled, inductor fuses these casts
            if (fwd, dgrad, wgrad) != self._ids:  # a shape fallback changed a choice
                cs = tuple(ops.parse_choice(i) for i in (fwd, dgrad, wgrad))
            if cs is not self._choices:
                share = share_plan(*cs)
            else:  # the dual cast: mode "on", or "auto" on a CUDA tensor with triton installed
                mode = dualcast.get_dual_cast()
                dual = mode == "on" or (mode == "auto" and x.is_cuda and self._dual_ok)
                share = self._share_dual if dual else self._share
        y = _LokaLinearFn.apply(x2, self.weight, self.bias, fwd, dgrad, wgrad, fns, self._tag, dtype,
                                share, cs)  # (M, N)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, precision={self._precision.short_str()}"


def is_eligible(module: nn.Module) -> bool:
    """An eligible site: a plain ``nn.Linear`` (exact type) or a :class:`LokaLinear`.

    Subclasses of ``nn.Linear`` with their own ``forward`` (and ``MultiheadAttention``'s
    ``out_proj``, whose weight is used without calling it) are not swapped.
    """
    return type(module) is nn.Linear or isinstance(module, LokaLinear)


def find_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Eligible linear layers of ``model`` by fully qualified name, in module order.

    The root module itself is not a site (it cannot be swapped in place); a layer reachable
    under several names is listed once, under its first name.
    """
    return {name: m for name, m in model.named_modules() if name and is_eligible(m)}
