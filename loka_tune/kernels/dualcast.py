"""Both FP8 layouts of a tensorwise operand from one read: ``torch.ops.loka.cast_dual``.

Hopper's FP8 GEMMs take both operands K-major, so a linear layer needs each of ``X``, ``W`` and
``dY`` in FP8 twice: ``X`` for the forward and ``X^T`` for wgrad, ``W`` for the forward and ``W^T``
for dgrad, ``dY`` for dgrad and ``dY^T`` for wgrad. With tensorwise scales the two copies hold
the same values (:class:`~loka_tune.kernels.scaled.SharePlan`). Left to inductor, the transposed
copy is a kernel of its own; here one Triton kernel
(:func:`loka_tune.kernels.triton_quant.dual_cast`) reads the operand once, with any strides, and
writes both, the transposed one through a tile transpose, as TransformerEngine's cast-transpose
does. The amax and the scale stay plain torch ops, so inductor still fuses the amax into the
operand's producer; only the cast is opaque.

Measured (BENCHMARKS.md, 2026-12-06, fourth session, one H100, Wukong large, compiled, torchao's
15 filter sites): the benchmark form of this cast ran 1.011x / 1.012x torchao's tensorwise line
at B = 8192 (two seeds) and 1.009x at 32768. This module's form (2026-12-07, one H100, B = 8192,
seed 0): the study's export 1.0035x torchao's line, the kernel 1.55 ms a step for its 45 calls
(it reads the fp32 weight; the benchmark form's read a bf16 copy: 1.37 ms).

When it runs: on the shared tensorwise operands of a compiled :class:`~loka_tune.kernels.linear.LokaLinear`
(the only place the two copies are made together), by the mode:

- ``off`` (the default): never (inductor's casts);
- ``auto``: on CUDA tensors where ``triton`` is installed; elsewhere inductor's casts;
- ``on``: always (on the CPU the op runs :func:`cast_dual_reference`: tests, and the same graph).

Why ``off`` by default (one H100, 2026-12-07, BENCHMARKS.md): the op is opaque to inductor, so
each call pays the custom op's dispatch and Triton's Python launcher on the host. With ``auto``
the default, the GPU smoke's batch-1,024 models (host-bound steps) ran their tensorwise variants
at 3.15x (DCNv2) and 1.31x (Interformer) the step time of bf16 + Mods in the same run, against
0.94x and 0.85x with inductor's casts the session before; the compiled Linear-block price cells
added up to 1.3 ms of host time per block (three calls; median 0.9 ms), saved at most 0.04 ms of GPU time
(8192 x 2048 x 8192), and lost 0.22 ms at the feature-axis shape 2,097,152 x 64 x 32. In a
GPU-bound step (B = 8192, large Wukong) the host time hides, and the cast gained 1.1% over
torchao's line. The inline form below (a ``torch.library.triton_op``) took most of the host
cost away but not all (one H100, 2026-12-07, the same smoke tests: DCNv2 1.66x and Interformer
1.13x bf16 + Mods), and in the GPU-bound whole model it ran the study's export at 1.0035x
torchao's line (B = 8192, one seed). So the default stays ``off``; turn it on only for
GPU-bound steps: ``LOKA_DUAL_CAST=auto``.

The mode starts from the environment variable ``LOKA_DUAL_CAST`` and is changed with
:func:`set_dual_cast` or, for one block, :func:`dual_cast_mode`. It is read when a graph is
traced: change it before compiling.

Two forms of the same kernel (``LOKA_DUAL_CAST_OP`` or :func:`set_dual_cast_op`):

- ``inline`` (the default): on CUDA, ``torch.ops.loka.cast_dual_inline``, a
  ``torch.library.triton_op``: inductor sees the Triton kernel inside it and launches it from its
  own generated code, like the kernels it writes (no custom-op dispatch, no Triton Python
  launcher per call). It is registered the first time it can be needed (a mode other than ``off``
  set, or a LokaLinear that could take it built under such a mode), which imports ``triton``;
  until then, and without ``triton``, the opaque form runs;
- ``opaque``: ``torch.ops.loka.cast_dual``, a ``custom_op`` inductor calls as a black box (the
  form measured on 2026-12-06/07; kept for the A/B and for the CPU, where it runs the reference).

The result is bit for bit that of :func:`loka_tune.kernels.scaled.cast_to_fp8` and its
transpose.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from functools import lru_cache
from typing import Any, Iterator

import torch

from loka_tune.config import Format, ScaleRounding
from loka_tune.kernels.quant import FMAX, FP8_DTYPE
from loka_tune.kernels.scaled import scale_from_amax

__all__ = ["DUAL_CAST_MODES", "DUAL_CAST_OPS", "cast_dual", "cast_dual_reference", "cast_to_fp8_dual",
           "dual_cast_mode", "get_dual_cast", "get_dual_cast_op", "inline_op", "prepare_inline",
           "set_dual_cast", "set_dual_cast_op", "triton_available", "takes_dual_cast"]

DUAL_CAST_MODES = ("auto", "on", "off")
DUAL_CAST_OPS = ("inline", "opaque")
_FORMATS = (Format.E4M3, Format.E5M2)
_VIA = {"": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
_VIA_NAME = {None: "", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _check_mode(mode: str, where: str) -> str:
    m = str(mode).strip().lower()
    if m not in DUAL_CAST_MODES:
        raise ValueError(f"{where} {mode!r} is not a dual-cast mode; use one of {', '.join(DUAL_CAST_MODES)}")
    return m


def _check_op(op: str, where: str) -> str:
    o = str(op).strip().lower()
    if o not in DUAL_CAST_OPS:
        raise ValueError(f"{where} {op!r} is not a form of the dual cast; use one of {', '.join(DUAL_CAST_OPS)}")
    return o


_MODE = {"mode": _check_mode(os.environ.get("LOKA_DUAL_CAST", "off") or "off", "LOKA_DUAL_CAST="),
         "op": _check_op(os.environ.get("LOKA_DUAL_CAST_OP", "inline") or "inline", "LOKA_DUAL_CAST_OP=")}
_INLINE: dict[str, Any] = {}  # "op": the registered triton_op (or None where it cannot be)


def get_dual_cast() -> str:
    """The dual-cast mode: ``auto``, ``on`` or ``off`` (module docstring)."""
    return _MODE["mode"]


def set_dual_cast(mode: str) -> str:
    """Set the dual-cast mode (``auto``, ``on``, ``off``); returns the previous one. Graphs
    compiled before keep the mode they were traced with."""
    prev = _MODE["mode"]
    _MODE["mode"] = _check_mode(mode, "set_dual_cast:")
    if _MODE["mode"] != "off":
        prepare_inline()
    return prev


def get_dual_cast_op() -> str:
    """The form of the dual cast: ``inline`` (a triton_op, the default) or ``opaque`` (module docstring)."""
    return _MODE["op"]


def set_dual_cast_op(op: str) -> str:
    """Set the form of the dual cast (``inline``, ``opaque``); returns the previous one. Read
    when a graph is traced, as the mode is."""
    prev = _MODE["op"]
    _MODE["op"] = _check_op(op, "set_dual_cast_op:")
    prepare_inline()
    return prev


def prepare_inline() -> None:
    """Register the inline form (:func:`inline_op`) now, outside any trace, if the mode and the
    form ask for it and ``triton`` is installed: what :func:`set_dual_cast` and LokaLinear's
    constructor call, so that a graph traced afterwards can take it."""
    if _MODE["mode"] != "off" and _MODE["op"] == "inline" and triton_available():
        inline_op()


def inline_op() -> Any:
    """``torch.ops.loka.cast_dual_inline``, registered on the first call (which imports
    ``triton``); None without ``triton``. The same signature and result as ``loka::cast_dual``,
    CUDA only (the Triton interpreter, ``TRITON_INTERPRET=1``, also runs it on the CPU)."""
    if "op" not in _INLINE:
        try:
            _INLINE["op"] = _register_inline() if triton_available() else None
        except ImportError:  # a triton that cannot be imported: the opaque form
            _INLINE["op"] = None
    return _INLINE["op"]


def _register_inline() -> Any:
    from loka_tune.kernels.triton_quant import dual_cast  # imports triton

    def cast_dual_inline(x: torch.Tensor, scale: torch.Tensor, fmt: str,
                         via: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        f, v = _parse(x, scale, fmt, via)
        if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"loka::cast_dual_inline runs on CUDA tensors, got one on {x.device.type}; "
                             "use torch.ops.loka.cast_dual there (its torch reference)")
        return dual_cast(x, scale, f, torch.float32 if v is None else v, wrap=torch.library.wrap_triton)

    torch.library.triton_op("loka::cast_dual_inline", cast_dual_inline, mutates_args=())
    return torch.ops.loka.cast_dual_inline


@contextlib.contextmanager
def dual_cast_mode(mode: str) -> Iterator[None]:
    """The dual-cast mode ``mode`` inside the block, the previous one after it."""
    prev = set_dual_cast(mode)
    try:
        yield
    finally:
        _MODE["mode"] = prev


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether ``triton`` can be imported (looked up, not imported)."""
    return importlib.util.find_spec("triton") is not None


def takes_dual_cast(share: bool, device_type: str = "cuda") -> bool:
    """Whether a compiled :class:`~loka_tune.kernels.linear.LokaLinear` on ``device_type`` whose
    precision shares an operand (``share``: its :class:`~loka_tune.kernels.scaled.SharePlan` has
    ``any``) casts through :func:`cast_dual` under the current mode: the rule its forward applies
    (there with triton's presence resolved before tracing). Site prices key on it."""
    mode = get_dual_cast()
    return share and (mode == "on" or (mode == "auto" and device_type == "cuda" and triton_available()))


def cast_dual_reference(x: torch.Tensor, scale: torch.Tensor, fmt: Format,
                        via: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``(R, C)`` rounded through ``via`` (None: not), times ``scale`` (float32, one element),
    saturated at the format's max and cast: ``(data (R, C), data_t (C, R))``, both contiguous."""
    xv = x if via is None else x.to(via)
    fmax = FMAX[fmt]
    y = (xv.to(torch.float32) * scale.reshape(())).clamp(-fmax, fmax).to(FP8_DTYPE[fmt])  # (R, C)
    return y.contiguous(), y.t().clone(memory_format=torch.contiguous_format)  # a copy: (1, C) never aliases


@torch.library.custom_op("loka::cast_dual", mutates_args=())
def cast_dual(x: torch.Tensor, scale: torch.Tensor, fmt: str, via: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cast_dual_reference` (``fmt``: ``e4m3`` / ``e5m2``; ``via``: ``""``, ``bfloat16`` or
    ``float16``) in one Triton kernel on CUDA, the torch reference elsewhere."""
    f, v = _parse(x, scale, fmt, via)
    if x.device.type == "cuda":
        from loka_tune.kernels.triton_quant import dual_cast

        return dual_cast(x, scale, f, torch.float32 if v is None else v)
    return cast_dual_reference(x, scale, f, v)


def _parse(x: torch.Tensor, scale: torch.Tensor, fmt: str, via: str) -> tuple[Format, torch.dtype | None]:
    if x.dim() != 2:
        raise ValueError(f"loka::cast_dual takes a 2-D operand (rows, cols), got shape {tuple(x.shape)}; "
                         "flatten the leading dims first")
    if scale.numel() != 1:
        raise ValueError(f"loka::cast_dual takes one tensorwise scale, got {scale.numel()} elements "
                         f"(shape {tuple(scale.shape)}); rowwise and block scales have their own casts")
    f = next((g for g in _FORMATS if g.value == fmt), None)
    if f is None:
        raise ValueError(f"loka::cast_dual writes e4m3 or e5m2, got fmt={fmt!r}")
    if via not in _VIA:
        raise ValueError(f"loka::cast_dual rounds through one of {sorted(_VIA)}, got via={via!r}")
    return f, _VIA[via]


@cast_dual.register_fake
def _cast_dual_fake(x: torch.Tensor, scale: torch.Tensor, fmt: str, via: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    f, _ = _parse(x, scale, fmt, via)
    r, c = x.shape
    dt = FP8_DTYPE[f]
    return x.new_empty((r, c), dtype=dt), x.new_empty((c, r), dtype=dt)


def cast_to_fp8_dual(
    x: torch.Tensor, fmt: Format, rounding: ScaleRounding, via: torch.dtype | None = None
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Tensorwise FP8 of ``x`` ``(R, C)`` in both layouts: ``((data, inv_scale), (data_t, inv_scale))``,
    ``data`` ``(R, C)`` and ``data_t`` ``(C, R)`` contiguous, ``inv_scale`` float32 ``()``; bit for
    bit :func:`~loka_tune.kernels.scaled.cast_to_fp8` of ``x.to(via)`` and its transpose.

    ``via``: the compute dtype an fp32 master weight is rounded to first (the kernel reads the
    fp32 weight itself: no bf16 copy is written). The amax is torch code that inductor fuses.
    """
    v = None if via is None or via in (x.dtype, torch.float32) else via  # rounding to fp32 changes nothing
    if v not in _VIA_NAME:
        raise ValueError(f"cast_to_fp8_dual rounds through bfloat16 or float16, got via={via}")
    xv = x if v is None else x.to(v)
    amax = xv.to(torch.float32).abs().amax()  # ()
    scale = scale_from_amax(amax, fmt, rounding == ScaleRounding.POW2)  # ()
    inline = _INLINE.get("op") if x.is_cuda and _MODE["op"] == "inline" else None
    op = torch.ops.loka.cast_dual if inline is None else inline
    data, data_t = op(x, scale, fmt.value, _VIA_NAME[v])
    inv = scale.reciprocal()
    return (data, inv), (data_t, inv)
