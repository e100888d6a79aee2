"""Reference FP8 quantization: the semantics every backend must match.

A canonical operand is a 2-D tensor ``(rows, red)`` whose last dimension is the reduction
dimension of its GEMM (see :mod:`loka_tune.config`). It is split into tiles, each tile gets
one scale, and the scaled values are cast to an FP8 format:

==============  ============================  ==========================================
granularity     tile (rows x red)             scale shape
==============  ============================  ==========================================
``tensor``      the whole operand             ``(1, 1)``
``row``         ``1 x red`` (one per row)     ``(rows, 1)``
``block``       ``1 x 128`` activations /     ``(rows, ceil(red/128))``
                gradients; ``128 x 128``      ``(ceil(rows/128), ceil(red/128))``
                weights (``is_weight=True``)
``mx``          ``1 x 32``                    ``(rows, ceil(red/32))``
==============  ============================  ==========================================

Ragged edges: the last partial tile of a row (or of a 128x128 weight tile grid) is scaled
by the amax of the elements it actually holds.

Per tile: ``scale = fmax / amax`` (``fmax`` 448 for e4m3 and mxfp8 elements, 57344 for
e5m2), so that the tile's largest magnitude lands on the format's largest finite value;
then ``data = saturating_cast(x * scale)`` (clamp to ``[-fmax, fmax]``, then round to
nearest even by ``Tensor.to(float8_*)``), and ``dequantize(q) = data / scale``.

``scale`` is the *multiplier* applied before the cast (torchao's convention); the
dequantization factor handed to kernels such as ``torch._scaled_mm`` is
:meth:`QTensor.inv_scale`, ``1 / scale``. Scales are float32.

Guards:

- An all-zero tile (``amax == 0``) gets ``scale = 1``: it quantizes to exact zeros, no NaN.
- Scales are clamped to the finite float32 range, so tiny tiles (``amax`` below
  ``fmax / 3.4e38``) and huge ones (``amax`` up to float32's max) give finite scales;
  dequantized values are clamped to the finite range of the output dtype, so a tile at
  float32's maximum never dequantizes to ``inf``.
- Power-of-two rounding (``ScaleRounding.POW2``, always on for ``mx``) rounds the scale
  *down* to a power of two (``2**floor(log2(fmax / amax))``), so ``amax * scale <= fmax``
  still holds and nothing saturates. For ``mx`` this gives e8m0 dequantization factors
  ``2**e``, ``e`` clamped to ``[-127, 127]`` (the OCP MX e8m0 range); rounding the multiplier
  down is the overflow-free "RCEIL" variant of the MX scale rule (as in cuBLAS / torchao's
  ``RCEIL`` mode) rather than the spec's floor-of-amax rule, which saturates up to 2x.

Non-finite inputs: the quantizer does not check (a check would cost a device sync per
GEMM). A tile that holds ``inf`` or ``NaN`` has a non-finite amax; its scale becomes 0 (or
NaN) and the whole tile dequantizes to NaN. Callers that need better decide before
quantizing: :class:`loka_tune.kernels.linear.LokaLinear` detects non-finite operands and runs
that GEMM unquantized instead (counted in ``LokaLinear.nonfinite_fallbacks``), so a
non-finite value never spreads across a tile.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loka_tune.config import FP8_FORMATS, Format, Granularity, ScaleRounding

__all__ = [
    "FMAX",
    "F32_MAX",
    "FP8_DTYPE",
    "BLOCK",
    "WEIGHT_BLOCK",
    "MX_BLOCK",
    "QTensor",
    "tile_shape",
    "compute_scale",
    "quantize",
    "dequantize",
    "fake_quantize",
    "GUARD_FRAC",
    "sqnr_db",
    "mere",
    "RefErrors",
]

#: Largest finite magnitude of each format's elements.
FMAX: dict[Format, float] = {
    Format.E4M3: float(torch.finfo(torch.float8_e4m3fn).max),  # 448
    Format.E5M2: float(torch.finfo(torch.float8_e5m2).max),  # 57344
    Format.MXFP8: float(torch.finfo(torch.float8_e4m3fn).max),  # e4m3 elements
}

#: The torch dtype that stores each format's elements.
FP8_DTYPE: dict[Format, torch.dtype] = {
    Format.E4M3: torch.float8_e4m3fn,
    Format.E5M2: torch.float8_e5m2,
    Format.MXFP8: torch.float8_e4m3fn,
}

BLOCK = 128  # 1x128 activation / gradient tiles and 128x128 weight tiles (DeepSeek-V3)
WEIGHT_BLOCK = 128
MX_BLOCK = 32  # OCP MX: 32 elements share one e8m0 scale
_E8M0_MIN_EXP, _E8M0_MAX_EXP = -127, 127  # e8m0 exponent range (255 = NaN is not used)
F32_MAX = float(torch.finfo(torch.float32).max)  # the largest finite float32: scales are clamped to it
_F32_TINY = float(torch.finfo(torch.float32).tiny)  # smallest normal float32


@dataclass(frozen=True)
class QTensor:
    """A quantized canonical operand.

    ``data``: the FP8 elements, shape ``(rows, red)``, dtype ``FP8_DTYPE[fmt]``.
    ``scale``: float32 multipliers, one per tile (shape in the module docstring); the
    high-precision value is ``data / scale`` (see :meth:`inv_scale`).
    ``tile``: ``(tile_rows, tile_cols)`` of one scale (the full extent for ``tensor``/``row``).
    """

    data: torch.Tensor
    scale: torch.Tensor
    fmt: Format
    gran: Granularity
    rounding: ScaleRounding
    is_weight: bool
    tile: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def inv_scale(self) -> torch.Tensor:
        """Per-tile dequantization factors ``1 / scale`` (what scaled-GEMM kernels take)."""
        return self.scale.reciprocal()

    def expanded_scale(self) -> torch.Tensor:
        """The scale of every element, shape ``(rows, red)``."""
        return _expand(self.scale, self.tile, self.data.shape)

    def e8m0_exponents(self) -> torch.Tensor:
        """For ``mx``: the e8m0 exponents ``e`` of the dequantization factors ``2**e`` (int32)."""
        if self.gran != Granularity.MX:
            raise ValueError(f"e8m0 exponents exist for granularity 'mx' only, got {self.gran.value!r}")
        return (-torch.log2(self.scale)).round().to(torch.int32)


def tile_shape(gran: Granularity | str, rows: int, red: int, *, is_weight: bool) -> tuple[int, int]:
    """The ``(tile_rows, tile_cols)`` one scale covers for an operand of shape ``(rows, red)``."""
    gran = Granularity(gran)
    if gran == Granularity.TENSOR:
        return (max(rows, 1), max(red, 1))
    if gran == Granularity.ROW:
        return (1, max(red, 1))
    if gran == Granularity.BLOCK:
        return (WEIGHT_BLOCK, BLOCK) if is_weight else (1, BLOCK)
    if gran == Granularity.MX:
        return (1, MX_BLOCK)
    raise ValueError(f"granularity {gran.value!r} has no tiles: only FP8 operands are quantized")


def _pad_to_tiles(t: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    rows, red = t.shape
    pr, pc = (-rows) % tile[0], (-red) % tile[1]
    if pr or pc:
        t = F.pad(t, (0, pc, 0, pr))  # zeros never raise a tile's amax
    return t


def _tile_amax(t: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """amax of |t| per tile, float32, shape ``(ceil(rows/tr), ceil(red/tc))``."""
    tr, tc = tile
    rows, red = t.shape
    if tile == (max(rows, 1), max(red, 1)):  # tensorwise: one reduction
        return t.abs().amax().reshape(1, 1)
    if tr == 1 and tc >= red:  # rowwise
        return t.abs().amax(dim=1, keepdim=True)
    p = _pad_to_tiles(t, tile)  # (R, C), multiples of the tile
    nr, nc = p.shape[0] // tr, p.shape[1] // tc
    return p.abs().reshape(nr, tr, nc, tc).amax(dim=(1, 3))  # (nr, nc)


def _expand(scale: torch.Tensor, tile: tuple[int, int], shape: torch.Size | tuple[int, int]) -> torch.Tensor:
    rows, red = shape
    tr, tc = tile
    if scale.shape == (1, 1) or (tr == 1 and scale.shape[1] == 1):
        return scale.expand(rows, red)
    out = scale.repeat_interleave(tr, dim=0) if tr > 1 else scale
    out = out.repeat_interleave(tc, dim=1) if tc > 1 else out
    return out[:rows, :red]


def compute_scale(amax: torch.Tensor, fmt: Format | str, rounding: ScaleRounding | str) -> torch.Tensor:
    """Per-tile scales ``fmax / amax`` from float32 amaxes, with the guards of the module docstring."""
    fmt, rounding = Format(fmt), ScaleRounding(rounding)
    fmax = FMAX[fmt]
    amax = amax.to(torch.float32)
    # Clamp amax below so the scale stays finite; zero tiles are set to scale 1 afterwards.
    # A true IEEE division (a Python scalar over a tensor may become reciprocal-times).
    scale = torch.full_like(amax, fmax) / amax.clamp(min=fmax / F32_MAX)
    scale = scale.clamp(max=F32_MAX)
    if rounding == ScaleRounding.POW2 or fmt == Format.MXFP8:
        mant, exp = torch.frexp(scale)  # scale = mant * 2**exp, mant in [0.5, 1)
        exp = exp - 1  # 2**(exp-1) <= scale: round down
        if fmt == Format.MXFP8:
            exp = exp.clamp(-_E8M0_MAX_EXP, -_E8M0_MIN_EXP)  # dequant factor 2**-exp in e8m0 range
        else:
            exp = exp.clamp(-126, 127)  # keep the power of two a normal float32
        pow2 = torch.ldexp(torch.ones_like(scale), exp)
        ok = torch.isfinite(scale) & (scale > 0)  # 0 (inf amax) and NaN (NaN amax) stay as they are
        scale = torch.where(ok, pow2, scale)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def quantize(
    t: torch.Tensor,
    fmt: Format | str,
    gran: Granularity | str,
    rounding: ScaleRounding | str = ScaleRounding.EXACT,
    *,
    is_weight: bool = False,
) -> QTensor:
    """Quantize a canonical operand ``t`` of shape ``(rows, red)`` (reduction on the last dim).

    ``is_weight`` selects 128x128 tiles for ``block`` (the weight operand: B of fwd and
    dgrad); it does not matter for the other granularities. ``mx`` requires ``fmt=mxfp8``
    and always uses power-of-two scales. See the module docstring for the exact semantics.
    """
    fmt, gran, rounding = Format(fmt), Granularity(gran), ScaleRounding(rounding)
    if fmt not in FP8_FORMATS:
        raise ValueError(f"got format {fmt.value!r}; quantize takes one of {[f.value for f in FP8_FORMATS]}")
    if (fmt == Format.MXFP8) != (gran == Granularity.MX):
        raise ValueError(f"format {fmt.value!r} with granularity {gran.value!r}: mxfp8 goes with 'mx' only")
    if t.dim() != 2:
        raise ValueError(f"quantize takes a 2-D canonical operand (rows, red), got shape {tuple(t.shape)}")
    if fmt == Format.MXFP8:
        rounding = ScaleRounding.POW2
    rows, red = t.shape
    tile = tile_shape(gran, rows, red, is_weight=is_weight)
    x = t.to(torch.float32)  # (rows, red)
    if x.numel() == 0:
        nr, nc = math.ceil(rows / tile[0]), math.ceil(red / tile[1])
        scale = torch.ones(nr, nc, dtype=torch.float32, device=t.device)
        return QTensor(x.to(FP8_DTYPE[fmt]), scale, fmt, gran, rounding, is_weight, tile)
    scale = compute_scale(_tile_amax(x, tile), fmt, rounding)  # (nr, nc)
    fmax = FMAX[fmt]
    y = (x * _expand(scale, tile, x.shape)).clamp(-fmax, fmax)  # saturating; NaN stays NaN
    return QTensor(y.to(FP8_DTYPE[fmt]), scale, fmt, gran, rounding, is_weight, tile)


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q.data / scale`` in ``dtype``, clamped to ``dtype``'s finite range (never overflows to inf).

    Computed in float32 (float64 when ``dtype`` is float64). NaN stays NaN.
    """
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    out = q.data.to(wide) / q.expanded_scale().to(wide)  # (rows, red)
    if dtype != torch.float64:
        lim = float(torch.finfo(dtype).max)
        out = out.clamp(-lim, lim)
    return out.to(dtype)


def fake_quantize(
    t: torch.Tensor,
    fmt: Format | str,
    gran: Granularity | str,
    rounding: ScaleRounding | str = ScaleRounding.EXACT,
    *,
    is_weight: bool = False,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Quantize then dequantize ``t`` (``(rows, red)``); result in ``dtype`` (default ``t.dtype``).

    ``bf16`` format returns ``t`` unchanged (cast to ``dtype``): bf16 operands are not scaled.
    """
    if Format(fmt) == Format.BF16:
        return t if dtype is None else t.to(dtype)
    return dequantize(quantize(t, fmt, gran, rounding, is_weight=is_weight), t.dtype if dtype is None else dtype)


# ----------------------------------------------------------------------------- error metrics
# Both take the reference first: ``metric(ref, approx)``.

#: MERE guard: ``|ref|`` below 1% of ``rms(ref)`` counts as 1% of ``rms(ref)`` (why 1e-2 and
#: not 1e-3: :mod:`loka_tune.probe.measure`).
GUARD_FRAC = 1e-2


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``10 log10(|ref|^2 / |ref - approx|^2)`` in dB (float64).

    ``inf`` when identical; ``-inf`` when ``ref`` is all zero but ``approx`` is not.
    """
    r = ref.detach().to(torch.float64)
    e = (r - approx.detach().to(torch.float64)).pow(2).sum().item()
    s = r.pow(2).sum().item()
    if e == 0:
        return math.inf
    if s == 0:
        return -math.inf
    return 10.0 * math.log10(s / e)


def mere(ref: torch.Tensor, approx: torch.Tensor, guard_frac: float = GUARD_FRAC) -> float:
    """Mean element-wise relative error ``mean |approx - ref| / max(|ref|, guard_frac * rms(ref))``
    (float64): the probe's error metric (MERE). ``0`` when identical; ``inf`` when ``ref`` is all
    zero but ``approx`` is not."""
    approx, ref = approx.detach().to(torch.float64), ref.detach().to(torch.float64)
    rms = float(ref.pow(2).mean().sqrt())
    if rms == 0.0:
        return 0.0 if bool(torch.equal(approx, ref)) else math.inf
    denom = ref.abs().clamp_min(guard_frac * rms)
    return float(((approx - ref).abs() / denom).mean())


class RefErrors:
    """:func:`mere` and :func:`sqnr_db` of many approximations of one reference, without a host
    sync per call: the reference's terms (its float64 copy, ``|ref|^2``, its rms, the MERE
    denominator) are formed once, :meth:`terms` returns each approximation's terms as one
    float64 tensor on the reference's device, and :meth:`metrics` turns the terms read back
    (``tensor.tolist()``, once for many) into ``(mere, sqnr_db)``, the same values those two
    functions give (edge cases included: an all-zero reference, identical operands).

    The probe measures every candidate of a site against one reference per draw and GEMM
    (:mod:`loka_tune.probe.measure`); with a read-back per metric it waited on the GPU four
    times per candidate (on the H200 removing those waits did not shorten the measurement:
    BENCHMARKS.md, "Preparation on the H200, 2026-12-03")."""

    def __init__(self, ref: torch.Tensor, guard_frac: float = GUARD_FRAC) -> None:
        r = ref.detach().to(torch.float64)
        self.ref = r
        sq = r.pow(2)
        self.s = sq.sum()
        self.rms = sq.mean().sqrt()
        self.denom = r.abs().clamp_min(guard_frac * self.rms)

    def terms(self, approx: torch.Tensor) -> torch.Tensor:
        """``[mean |d| / denom, sum d^2, max |d|, sum ref^2, rms(ref)]`` with ``d = approx - ref``."""
        d = approx.detach().to(torch.float64) - self.ref
        ad = d.abs()
        return torch.stack(((ad / self.denom).mean(), d.pow(2).sum(), ad.amax(), self.s, self.rms))

    @staticmethod
    def metrics(terms: Sequence[float]) -> tuple[float, float]:
        """``(mere, sqnr_db)`` from one row of :meth:`terms` read back to the host."""
        m, e, dmax, s, rms = (float(v) for v in terms)
        if rms == 0.0:
            mer = 0.0 if dmax == 0.0 else math.inf  # NaN in approx: not equal, as torch.equal says
        else:
            mer = m
        if e == 0:
            db = math.inf
        elif s == 0:
            db = -math.inf
        else:
            db = 10.0 * math.log10(s / e)
        return mer, db
