"""The serving form of a linear layer: a weight quantized once, only the activation per call.

Training quantizes both operands of every GEMM on every call, because the weight changes every
step. A served weight never changes, so :class:`ServingLinear` quantizes it once, when it is
built (or when a state dict is loaded into it), keeps the FP8 data and its scales as buffers,
and runs only the forward GEMM ``Y = X W^T (+ bias)`` with the activation ``X`` quantized per
call, through its fwd :class:`~loka_tune.config.GemmChoice`'s backend
(:meth:`~loka_tune.kernels.registry.Backend.quantize_weight` /
:meth:`~loka_tune.kernels.registry.Backend.static_gemm`):

- ``emulated``: the reference quantization (every granularity; the oracle, CPU and GPU);
- ``torch_scaled_mm`` (tensor, row) and ``torchao`` (tensor, row): traceable torch ops around
  ``torch._scaled_mm``, the aten op: under ``torch.compile`` inductor fuses the activation's
  quantization into the kernel that produces it, as in LokaLinear's direct paths;
- ``fbgemm`` (tensor, row, block) and ``triton`` (tensor, row, block): one opaque custom op per
  GEMM (``loka_tune::fp8_gemm_static``), CUDA-graph capturable.

The quantization is the one the training form's per-call path applies to the same weight
(the emulated backend's, bit for bit: ``tests/test_serving.py``), done from the weight as it is
stored (``weight_dtype``): a model in bf16 quantizes its bf16 weights, as a bf16-autocast
training forward does; fp32 master weights are quantized from fp32 (one rounding, not two).

A tensorwise site on ``emulated`` or ``torch_scaled_mm`` can also fix its activation's scale
ahead of time (:meth:`ServingLinear.calibrate_`, or :func:`loka_tune.serving.calibrate` over a
whole model and a few real batches): each call then casts the activation with that scale, one
elementwise pass that inductor fuses into the activation's producer, instead of a reduction over
the whole activation before the cast (on an H200 those reductions, and the producers they make
inductor compute twice, cost large Wukong 0.84 ms of its 7.2 ms tensorwise forward at 8192 rows).
Activations above the calibration's amax (times ``margin``) saturate at the format's max.

Buffers (the state dict): ``weight_fp8`` ``(N, K)`` in the choice's FP8 dtype,
``weight_scale`` float32 in the form its backend's kernel takes (dequantization factors
``1 / scale`` for the GPU backends, so that ``W ~ weight_fp8 * weight_scale`` per tile; the
reference multipliers ``scale`` for ``emulated``, whose dequantization divides, as
:func:`~loka_tune.kernels.quant.dequantize` does), ``act_scale`` (the calibrated multiplier,
float32 ``()``; only in a calibrated layer's state dict) and ``bias`` (``N``, or absent). Loading a
state dict that holds the high-precision ``weight`` (a training checkpoint, ``nn.Linear``'s
key) re-quantizes it; one holding ``weight_fp8`` / ``weight_scale`` loads them as they are.

Inference only: there is no backward. A forward under grad mode whose input requires grad
returns an output whose backward raises :class:`~loka_tune.errors.ServingError` naming the fix
(train the training form: ``apply`` without ``serving=True``). Non-finite weights are refused
when quantized; non-finite activations are not checked per call (no host sync).

:class:`ServingFusedBlock` is the serving form of the fused Linear -> BlockNorm -> Hard Swish
epilogue (``mods.fuse_epilogue``): its ServingLinear's static weight feeds the fused Triton
kernel (rowwise e4m3/e5m2 ``.triton`` on CUDA, one custom op:
``loka_tune::serve_fused_epilogue``) or, for ``.emulated`` choices, the reference epilogue in
traceable torch ops (bit for bit the training form's emulated fused forward). The next
layer's input quantization is not fused into it: under ``torch.compile`` inductor fuses that
quantization into the epilogue's elementwise kernels for the traceable backends, and the
Triton kernel's FP8 output (``out_fp8``) would need the next layer to take an FP8 input.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from loka_tune.config import FP8_FORMATS, GemmChoice, GemmRole, Granularity
from loka_tune.errors import BackendError, LokaError, ServingError, UnsupportedChoiceError
from loka_tune.kernels.fused import effective_block, epilogue_supports, reference_epilogue
from loka_tune.kernels.registry import Backend, get_backend
from loka_tune.layers import BlockNorm, carry_hooks

__all__ = ["ServingLinear", "ServingFusedBlock", "static_support_reason"]

StaticFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def static_support_reason(choice: GemmChoice) -> str | None:
    """None when ``choice``'s backend serves its fwd GEMM with a static weight, else why not
    (devices and shapes: :func:`~loka_tune.kernels.registry.check_supported`)."""
    if choice.is_bf16:
        return None
    try:
        backend = get_backend(choice.backend)
    except BackendError as e:
        return str(e)
    return backend.static_reason(choice)


class _InferenceOnly(torch.autograd.Function):
    """The identity forward; a backward that says the layer cannot be trained."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, where: str) -> torch.Tensor:
        ctx.where = where
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[None, None]:
        raise ServingError(
            f"{ctx.where} is the serving form of a site (a static FP8 weight, inference only): it has no"
            " backward. Train the training form, loka_tune.apply(model, config) without serving=True,"
            " and serve it afterwards")


class ServingLinear(nn.Module):
    """An inference-only linear layer: ``x @ W^T + bias`` with ``W`` quantized once (module docstring).

    ``choice``: the fwd GEMM choice (an FP8 :class:`GemmChoice` or its id) whose backend has a
    static-weight path; ``weight``: the high-precision weight ``(out_features, in_features)``,
    quantized here from ``weight_dtype`` (default: its own dtype); ``bias``: kept as a buffer.
    ``name``: the site name (for messages). Use :meth:`from_linear` to serve an ``nn.Linear``.
    """

    weight_fp8: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, choice: GemmChoice | str, *,
                 weight_dtype: torch.dtype | None = None, name: str = "") -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"a linear weight is 2-D (out_features, in_features), got shape {tuple(weight.shape)}")
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.site_name = name
        self.choice = GemmChoice.parse(choice, key=f"serving choice of {name or 'ServingLinear'}")
        if self.choice.is_bf16 or self.choice.a_format not in FP8_FORMATS:
            raise UnsupportedChoiceError(
                f"{self._where()}: {self.choice.short_str()!r} is a bf16 choice; a bf16 site serves as a plain"
                " nn.Linear (loka_tune.apply does that)")
        self.weight_dtype = weight.dtype if weight_dtype is None else weight_dtype
        self._resolve()
        self.register_buffer("weight_fp8", torch.empty(0, device=weight.device))
        self.register_buffer("weight_scale", torch.empty(0, device=weight.device))
        # the activation's calibrated multiplier fmax / amax (float32 ()), or empty: scaled per call
        self.register_buffer("act_scale", torch.empty(0, device=weight.device))
        # its reciprocal, the GEMM's dequantization factor: computed once per calibration, not a kernel
        # per call (derived: never in the state dict)
        self.register_buffer("act_inv_scale", torch.empty(0, device=weight.device), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach())
        self.quantize_(weight)

    @classmethod
    def from_linear(cls, linear: nn.Linear, choice: GemmChoice | str, *, name: str = "") -> "ServingLinear":
        """The serving form of ``linear`` (an ``nn.Linear`` or a ``LokaLinear``): its weight
        quantized for ``choice``, its bias shared (no copy); its forward hooks move along."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear takes an nn.Linear, got {type(linear).__name__}")
        new = cls(linear.weight, linear.bias, choice, name=name)
        carry_hooks(linear, new)  # its train mode and forward hooks
        return new

    def _where(self) -> str:
        return f"site {self.site_name!r}" if self.site_name else "ServingLinear"

    def _resolve(self) -> None:
        """The backend's static call path, resolved once (also after unpickling)."""
        backend = get_backend(self.choice.backend)
        reason = backend.static_reason(self.choice)
        if reason is not None:
            raise UnsupportedChoiceError(
                f"{self._where()}: {self.choice.short_str()!r} cannot serve a static weight: {reason}. Choose a"
                " backend that can (emulated; torch_scaled_mm or torchao for tensor/row; fbgemm or triton for"
                " tensor/row/block), or serve this site in bf16")
        self._backend: Backend = backend
        self._fn: StaticFn = backend.static_gemm(self.choice)
        self._shape_check = backend.runtime_shape_check
        self._cal_fn: Callable[..., torch.Tensor] | None = (
            backend.calibrated_gemm(self.choice) if backend.calibrated_reason(self.choice) is None else None)

    @property
    def calibrated(self) -> bool:
        """Whether the activation is quantized with a calibrated scale (:meth:`calibrate_`)."""
        return self.act_scale.numel() == 1

    def calibration_reason(self) -> str | None:
        """None when this site can take a calibrated activation scale (its choice's backend and
        granularity: tensorwise on ``emulated`` or ``torch_scaled_mm``), else why not."""
        return self._backend.calibrated_reason(self.choice)

    @torch.no_grad()
    def calibrate_(self, amax: torch.Tensor | float, *, margin: float = 1.0) -> "ServingLinear":
        """Fix the activation's scale from a calibration's ``amax`` (the largest ``|x|`` seen)
        times ``margin`` (>= 1: headroom; larger values saturate at the format's max): the
        multiplier ``fmax / (amax * margin)`` of the reference (:func:`~loka_tune.kernels.quant.
        compute_scale`). Each call then casts ``x`` with it: one elementwise pass that fuses into
        its producer, no amax reduction. Returns self."""
        from loka_tune.kernels.quant import compute_scale

        why = self.calibration_reason()
        if why is not None:
            raise UnsupportedChoiceError(
                f"{self._where()}: {self.choice.short_str()!r} cannot take a calibrated activation scale: {why}."
                " Calibrate tensorwise sites (e4m3.tensor[.fa].torch_scaled_mm), or leave this site dynamic")
        if not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin >= 1.0):
            raise ServingError(f"{self._where()}: got margin={margin!r}; a calibration margin is a factor >= 1.0"
                               " (1.0: the largest activation seen maps to the format's max)")
        a = torch.as_tensor(amax, dtype=torch.float32).to(self.weight_fp8.device).reshape(())
        if not bool(torch.isfinite(a)) or float(a) <= 0:
            raise ServingError(f"{self._where()}: got a calibration amax of {float(a)!r}; it must be finite and > 0"
                               " (calibrate on real batches whose activations are finite and not all zero)")
        self._set_act_scale(compute_scale(a * margin, self.choice.a_format, self.choice.rounding))
        return self

    def _set_act_scale(self, scale: torch.Tensor | None) -> None:
        """``act_scale`` (float32 ``()``) and its reciprocal, or both empty (None: per call)."""
        if scale is None:
            self.act_scale = torch.empty(0, device=self.weight_fp8.device)
            self.act_inv_scale = torch.empty(0, device=self.weight_fp8.device)
        else:
            self.act_scale = scale
            self.act_inv_scale = scale.reciprocal()  # the op the dynamic path runs on its own scale

    def clear_calibration_(self) -> "ServingLinear":
        """Back to scaling the activation per call (its own amax). Returns self."""
        self._set_act_scale(None)
        return self

    @torch.no_grad()
    def quantize_(self, weight: torch.Tensor) -> "ServingLinear":
        """Quantize ``weight`` ``(out_features, in_features)`` (cast to ``weight_dtype``, on this
        layer's device) into ``weight_fp8`` / ``weight_scale``; returns self."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ServingError(f"{self._where()}: got a weight of shape {tuple(weight.shape)}; this layer serves"
                               f" ({self.out_features}, {self.in_features}): a state dict of another model?")
        w = weight.detach().to(device=self.weight_fp8.device, dtype=self.weight_dtype)  # (N, K)
        if not bool(torch.isfinite(w).all()):
            raise ServingError(f"{self._where()}: the weight holds non-finite values, which would quantize to NaN"
                               " tiles; serve a finite checkpoint (or this site in bf16)")
        self.weight_fp8, self.weight_scale = self._backend.quantize_weight(w, self.choice)
        return self

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., K) -> (..., N)
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(dtype)  # (M, K)
        if self._shape_check:  # plain Python on ints: folded at trace time under torch.compile
            shape = (int(x2.shape[0]), self.in_features, self.out_features)
            reason = self._backend.runtime_reason(self.choice, GemmRole.FWD, shape)
            if reason is not None:
                raise BackendError(f"{self._where()} ({self.choice.short_str()}) cannot run {shape[0]} rows: {reason};"
                                   " serve batches padded to the serving plan's buckets (loka_tune.serving.ServingBuckets)")
        with torch.autocast(dev, enabled=False):  # the backend decides the GEMM's precision (emulated: fp32)
            if self.act_scale.numel() == 1 and self._cal_fn is not None:  # calibrated: no amax per call
                y = self._cal_fn(x2, self.act_scale, self.weight_fp8, self.weight_scale,
                                 act_inv=self.act_inv_scale)  # (M, N) in dtype
            else:
                y = self._fn(x2, self.weight_fp8, self.weight_scale)  # (M, N) in dtype
        if self.bias is not None:
            y = y + self.bias.to(dtype)
        if torch.is_grad_enabled() and x.requires_grad:
            y = _InferenceOnly.apply(y, self._where())
        return y.reshape(*lead, self.out_features)

    # ------------------------------------------------------------------ state dict, pickling
    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        act = state_dict.pop(prefix + "act_scale", None)  # absent (an older or dynamic state dict): per call
        self._set_act_scale(None if act is None or act.numel() == 0
                            else act.detach().to(device=self.weight_fp8.device, dtype=torch.float32).reshape(()))
        state_dict[prefix + "act_scale"] = self.act_scale  # loaded as it now is: never a missing key
        key = prefix + "weight"
        if key in state_dict:  # a high-precision weight (nn.Linear's key): quantize it
            w = state_dict.pop(key)
            if prefix + "weight_fp8" in state_dict:
                error_msgs.append(f"{prefix[:-1] or 'ServingLinear'}: the state dict holds both 'weight' and"
                                  " 'weight_fp8'; keep one (the high-precision weight is re-quantized)")
                return
            try:
                self.quantize_(w)
            except LokaError as e:
                error_msgs.append(str(e))
                return
            state_dict[prefix + "weight_fp8"] = self.weight_fp8
            state_dict[prefix + "weight_scale"] = self.weight_scale
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not self.calibrated:  # a dynamic layer's state dict is what it was before calibration existed
            destination.pop(prefix + "act_scale", None)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for k in ("_fn", "_cal_fn", "_backend"):  # closures and backend objects: resolved again on load
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._resolve()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None},"
                f" choice={self.choice.short_str()}, static weight {str(self.weight_fp8.dtype).removeprefix('torch.')}"
                + (", calibrated activation scale" if self.calibrated else ""))


# ----------------------------------------------------------------------------- fused epilogue
_FUSED_OP_DEFINED = False


def _ensure_fused_op() -> None:
    """Define ``torch.ops.loka_tune.serve_fused_epilogue`` once (the Triton path, a shape-only fake)."""
    global _FUSED_OP_DEFINED
    if _FUSED_OP_DEFINED:
        return

    @torch.library.custom_op("loka_tune::serve_fused_epilogue", mutates_args=())
    def serve_fused_epilogue(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                             block: int, eps: float, choice: str) -> torch.Tensor:
        from loka_tune.kernels import triton_epilogue, triton_quant
        from loka_tune.kernels.backends import parse_choice

        c = parse_choice(choice)
        qx = triton_quant.quantize(x, c.a_format, Granularity.ROW, c.rounding)  # (M, K), (M, 1)
        res = triton_epilogue.fused_forward(qx.data, qx.inv_scale, w, w_scale, bias, block, eps,
                                            fast_accum=c.fast_accum, save=False)
        return res["out"]  # (M, N) bf16

    @serve_fused_epilogue.register_fake
    def _(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, block: int,
          eps: float, choice: str) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.bfloat16)

    _FUSED_OP_DEFINED = True


class ServingFusedBlock(nn.Module):
    """``act(norm(linear(x)))`` of a :class:`ServingLinear` as one fused epilogue (module docstring).

    Keeps ``linear``, ``norm`` (a parameter-free :class:`~loka_tune.layers.BlockNorm`) and ``act``
    (``nn.Hardswish``) as children, so the state dict's names are the replaced container's.
    Raises :class:`UnsupportedChoiceError` when the fused epilogue does not run the linear's
    choice on its device (see :func:`~loka_tune.kernels.fused.epilogue_supports`).
    """

    def __init__(self, linear: ServingLinear, norm: BlockNorm, act: nn.Module) -> None:
        super().__init__()
        if not isinstance(linear, ServingLinear):
            raise TypeError(f"linear must be a ServingLinear, got {type(linear).__name__}")
        if not isinstance(norm, BlockNorm) or getattr(norm, "weight", None) is not None:
            raise TypeError(f"norm must be a parameter-free loka_tune.layers.BlockNorm, got {norm!r}")
        if type(act) is not nn.Hardswish:
            raise TypeError(f"act must be nn.Hardswish, got {type(act).__name__}")
        reason = epilogue_supports(linear.choice, n=linear.out_features, block=int(norm.block),
                                   device=linear.weight_fp8.device)
        if reason is not None:
            raise UnsupportedChoiceError(f"cannot fuse {linear.choice.short_str()!r}: {reason}")
        self.linear, self.norm, self.act = linear, norm, act
        self._triton = linear.choice.backend == "triton"
        self._origin: nn.Module | None = None  # the replaced container (a plain attribute, not a submodule)

    @property
    def block(self) -> int:
        return int(self.norm.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., K) -> (..., N)
        lin = self.linear
        n = lin.out_features
        b = effective_block(n, self.block)
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        eps = torch.finfo(dtype).eps if self.norm.eps is None else float(self.norm.eps)
        lead = x.shape[:-1]
        if self._triton:
            _ensure_fused_op()
            x2 = x.reshape(-1, lin.in_features).to(dtype)  # (M, K)
            h = torch.ops.loka_tune.serve_fused_epilogue(x2, lin.weight_fp8, lin.weight_scale, lin.bias, b, eps,
                                                         lin.choice.short_str())  # (M, N) bf16
            h = h if h.dtype == dtype else h.to(dtype)
            if torch.is_grad_enabled() and x.requires_grad:
                h = _InferenceOnly.apply(h, lin._where())
        else:  # the reference: the emulated GEMM, then BlockNorm and Hard Swish as the unfused modules
            y = lin(x).reshape(-1, n)  # (M, N) in dtype
            with torch.autocast(dev, enabled=False):
                h, _ = reference_epilogue(y, b, eps)
        return h.reshape(*lead, n)

    def extra_repr(self) -> str:
        return f"block={self.block}, eps={self.norm.eps}, choice={self.linear.choice.short_str()}"
