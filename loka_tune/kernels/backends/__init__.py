"""The GPU GEMM backends (``torch_scaled_mm``, ``fbgemm``, ``triton``, ``torchao``).

Each module registers one :class:`~loka_tune.kernels.registry.Backend` when imported; the
registry imports them lazily (``registry.LAZY_BACKENDS``), so ``import loka_tune`` never
touches triton, fbgemm or torchao. This package holds what they share:

- :class:`GPUBackend`: CUDA-only capability checks (device type, compute capability, the
  backend's own shape rules) and the call path :meth:`GPUBackend.direct` hands to
  ``LokaLinear`` once per GEMM: a *traceable* backend (``traceable = True``: plain torch ops
  around ``torch._scaled_mm``) is called as Python that ``torch.compile`` sees whole, so
  inductor fuses the quantization into neighbouring kernels and no Python runs per call;
  the others go through one custom op, ``torch.ops.loka_tune.fp8_gemm``, which
  ``torch.compile`` treats as one opaque node (no graph break on Triton launches or library
  calls) and CUDA graphs capture like any other op. A backend whose kernels fail to launch
  at some shapes (``runtime_shape_check = True``) has its ``extra_reason`` checked by
  ``LokaLinear`` at the real shape of each call (:meth:`Backend.runtime_reason`, at trace
  time under compile): an unsupported shape runs in bf16 and is recorded in
  ``registry.SHAPE_FALLBACKS`` instead of crashing the run;
- :func:`quantize_operand`: our fused Triton quantization (reference semantics, transposed
  views handled in the same pass), or the reference quantizer when Triton is missing;
- the serving path (a static weight: :meth:`~loka_tune.kernels.registry.Backend.quantize_weight`
  once, then :meth:`GPUBackend.static_gemm` per call, which quantizes only the activation):
  traceable where ``static_traceable`` (``torch_scaled_mm``, ``torchao``), else one custom op,
  ``torch.ops.loka_tune.fp8_gemm_static``, around the backend's ``static_gemm_impl``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, ClassVar

import torch

from loka_tune.config import Format, GemmChoice, GemmRole, Granularity, ScaleRounding
from loka_tune.kernels.registry import Backend, Shape, device_type, get_backend

__all__ = ["GPUBackend", "quantize_operand", "QOperand", "parse_choice"]


class QOperand:
    """FP8 data ``(rows, red)`` contiguous + float32 dequantization factors (``inv_scale``)."""

    __slots__ = ("data", "inv_scale")

    def __init__(self, data: torch.Tensor, inv_scale: torch.Tensor) -> None:
        self.data = data
        self.inv_scale = inv_scale


def quantize_operand(x: torch.Tensor, fmt: Format, gran: Granularity, rounding: ScaleRounding, *,
                     is_weight: bool, scale_mn_major: bool = False) -> QOperand:
    """Quantize a canonical operand with the reference semantics, in one fused Triton pass
    when Triton is importable (else with the reference quantizer, then a contiguous copy)."""
    try:
        from loka_tune.kernels import triton_quant
    except ImportError:  # pragma: no cover - GPU machines have triton
        from loka_tune.kernels.quant import quantize

        q = quantize(x, fmt, gran, rounding, is_weight=is_weight)
        inv = q.inv_scale()
        if scale_mn_major:
            inv = inv.t().contiguous().t()
        return QOperand(q.data.contiguous(), inv)
    out = triton_quant.quantize(x, fmt, gran, rounding, is_weight=is_weight, scale_mn_major=scale_mn_major)
    return QOperand(out.data, out.inv_scale)


@lru_cache(maxsize=4096)
def parse_choice(text: str) -> GemmChoice:
    return GemmChoice.parse(text)


_OP_DEFINED = False


def _ensure_op() -> None:
    """Define ``torch.ops.loka_tune.fp8_gemm`` once (a custom op with a shape-only fake)."""
    global _OP_DEFINED
    if _OP_DEFINED:
        return

    @torch.library.custom_op("loka_tune::fp8_gemm", mutates_args=())
    def fp8_gemm(a: torch.Tensor, b: torch.Tensor, backend: str, choice: str, role: str) -> torch.Tensor:
        be = get_backend(backend)
        assert isinstance(be, GPUBackend), backend
        return be.gemm_impl(a, b, parse_choice(choice), GemmRole(role))

    @fp8_gemm.register_fake
    def _(a: torch.Tensor, b: torch.Tensor, backend: str, choice: str, role: str) -> torch.Tensor:
        return a.new_empty((a.shape[0], b.shape[0]))

    _OP_DEFINED = True


_STATIC_OP_DEFINED = False


def _ensure_static_op() -> None:
    """Define ``torch.ops.loka_tune.fp8_gemm_static`` once: ``x @ W^T`` of a weight quantized
    ahead of time (its FP8 data and scales), a custom op with a shape-only fake."""
    global _STATIC_OP_DEFINED
    if _STATIC_OP_DEFINED:
        return

    @torch.library.custom_op("loka_tune::fp8_gemm_static", mutates_args=())
    def fp8_gemm_static(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, backend: str,
                        choice: str) -> torch.Tensor:
        be = get_backend(backend)
        assert isinstance(be, GPUBackend), backend
        return be.static_gemm_impl(a, w, w_scale, parse_choice(choice))

    @fp8_gemm_static.register_fake
    def _(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, backend: str, choice: str) -> torch.Tensor:
        return a.new_empty((a.shape[0], w.shape[0]))

    _STATIC_OP_DEFINED = True


class GPUBackend(Backend):
    """Base of the CUDA FP8 backends: capability checks + custom-op routing."""

    devices = frozenset({"cuda"})
    min_capability: ClassVar[tuple[int, int]] = (8, 9)  # FP8 tensor cores: Ada / Hopper and later
    max_capability: ClassVar[tuple[int, int] | None] = None
    #: ``gemm_impl`` is plain torch code (no host syncs, no Python-side kernel launches):
    #: :meth:`direct` then calls it without the custom op, so torch.compile traces it
    traceable: ClassVar[bool] = False
    #: ``static_gemm_impl`` is plain torch code: :meth:`static_gemm` calls it without a custom op
    static_traceable: ClassVar[bool] = False

    def extra_reason(self, choice: GemmChoice, role: GemmRole, shape: Shape | None) -> str | None:
        """Backend-specific rules beyond the declared capability sets (override)."""
        return None

    def gemm_impl(self, a: torch.Tensor, b: torch.Tensor, choice: GemmChoice, role: GemmRole) -> torch.Tensor:
        """The backend's own kernels for one canonical GEMM ``A @ B.T`` (every GPU backend implements it)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement gemm_impl")

    def static_gemm_impl(self, a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                         choice: GemmChoice) -> torch.Tensor:
        """The fwd GEMM ``a @ W^T`` of a weight from :meth:`quantize_weight` (``w``, ``w_scale``):
        quantizes ``a`` only. Backends with ``static_granularities`` implement it."""
        raise NotImplementedError(f"{type(self).__name__} does not implement static_gemm_impl")

    def static_gemm(self, choice: GemmChoice) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """The serving call path of ``choice``'s fwd GEMM, resolved once (module docstring)."""
        fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
        if self.static_traceable:
            def fn(a: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
                return self.static_gemm_impl(a, w, s, choice)
        else:
            _ensure_static_op()
            op, name, cs = torch.ops.loka_tune.fp8_gemm_static, self.name, choice.short_str()

            def fn(a: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
                return op(a, w, s, name, cs)
        return fn

    def supports(self, choice: GemmChoice, role: GemmRole | str, *, device: str | torch.device | None = None,
                 shape: Shape | None = None) -> str | None:
        reason = super().supports(choice, role, device=device, shape=shape)
        if reason is not None:
            return reason
        role = GemmRole(role)
        if device_type(device) == "cuda" and torch.cuda.is_available():
            cap = torch.cuda.get_device_capability(torch.device(device) if device is not None else None)
            if cap < self.min_capability:
                return f"needs compute capability >= {self.min_capability}, this GPU has {cap}"
            if self.max_capability is not None and cap > self.max_capability:
                return f"its kernels are built for compute capability <= {self.max_capability}, this GPU has {cap}"
        return self.extra_reason(choice, role, shape)

    def gemm(self, a: torch.Tensor, b: torch.Tensor, choice: GemmChoice, role: GemmRole) -> torch.Tensor:
        _ensure_op()
        return torch.ops.loka_tune.fp8_gemm(a, b, self.name, choice.short_str(), GemmRole(role).value)

    def direct(self, choice: GemmChoice, role: GemmRole) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The call path of one GEMM, resolved once (see the module docstring)."""
        role = GemmRole(role)
        name, cs, rs = self.name, choice.short_str(), role.value
        fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
        if self.traceable:
            def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                return self.gemm_impl(a, b, choice, role)
        else:
            _ensure_op()
            op = torch.ops.loka_tune.fp8_gemm

            def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                return op(a, b, name, cs, rs)
        return fn
