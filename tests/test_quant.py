"""Reference FP8 quantization (loka_tune.kernels.quant) against float64 references.

SQNR floors of a cast (quantize-dequantize of N(0, 1) data), and why:

- e4m3 (3 mantissa bits): >= 25 dB (torchao's floor for an FP8 cast). Measured ~31.5 dB.
- e5m2 (2 mantissa bits): one bit less halves the rounding step and costs 20 log10(2) =
  6.02 dB, so the matching floor is 25 - 6 = 19 dB. Measured ~25.5 dB (31.5 - 6.0: the
  6 dB-per-bit rule holds).
- mxfp8 (e4m3 elements, power-of-two scales): as e4m3, >= 25 dB. Measured ~31.5 dB.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from loka_tune.config import Format, Granularity, ScaleRounding
from loka_tune.kernels.quant import (
    FMAX,
    FP8_DTYPE,
    GUARD_FRAC,
    RefErrors,
    compute_scale,
    dequantize,
    fake_quantize,
    mere,
    quantize,
    sqnr_db,
    tile_shape,
)

MANTISSA_BITS = {Format.E4M3: 3, Format.E5M2: 2, Format.MXFP8: 3}
MIN_NORMAL_EXP = {Format.E4M3: -6, Format.E5M2: -14, Format.MXFP8: -6}
CAST_FLOOR_DB = {Format.E4M3: 25.0, Format.E5M2: 19.0, Format.MXFP8: 25.0}

FMT_GRAN = [
    (Format.E4M3, Granularity.TENSOR),
    (Format.E4M3, Granularity.ROW),
    (Format.E4M3, Granularity.BLOCK),
    (Format.E5M2, Granularity.TENSOR),
    (Format.E5M2, Granularity.ROW),
    (Format.E5M2, Granularity.BLOCK),
    (Format.MXFP8, Granularity.MX),
]
SHAPES = [(33, 70), (129, 130), (256, 129), (1, 300), (200, 45)]


def _ids(v: object) -> str:
    return getattr(v, "value", str(v))


def _randn(shape: tuple[int, int], seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


# ------------------------------------------------------------------------------------ SQNR
@pytest.mark.parametrize("fmt, gran", FMT_GRAN, ids=_ids)
@pytest.mark.parametrize("rounding", list(ScaleRounding), ids=_ids)
@pytest.mark.parametrize("is_weight", [False, True], ids=["act", "weight"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_cast_sqnr_floor(
    fmt: Format, gran: Granularity, rounding: ScaleRounding, is_weight: bool, shape: tuple[int, int]
) -> None:
    x = _randn(shape, seed=shape[0] * 1000 + shape[1])  # (rows, red), float64 reference
    y = fake_quantize(x, fmt, gran, rounding, is_weight=is_weight)
    assert y.dtype == torch.float64 and y.shape == x.shape
    assert sqnr_db(x, y) >= CAST_FLOOR_DB[fmt]


@pytest.mark.parametrize("fmt, gran", FMT_GRAN, ids=_ids)
def test_finer_tiles_never_hurt_on_outlier_rows(fmt: Format, gran: Granularity) -> None:
    """Rows of very different magnitude: per-row / per-tile scales keep every row accurate,
    a tensorwise scale crushes the small rows (the reason finer granularities exist)."""
    x = _randn((64, 256), seed=1)
    x[::2] *= 1e-10  # every other row is 10^10 smaller: below both formats' range under one scale
    y = fake_quantize(x, fmt, gran)
    small = sqnr_db(x[::2], y[::2])
    if gran == Granularity.TENSOR:
        assert small < 3.0
    else:
        assert small >= CAST_FLOOR_DB[fmt]


def test_sqnr_db() -> None:
    x = torch.ones(10, dtype=torch.float64)
    assert sqnr_db(x, x) == math.inf
    assert sqnr_db(x, 1.1 * x) == pytest.approx(20.0)
    assert sqnr_db(torch.zeros(3), torch.ones(3)) == -math.inf


def _ref_cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=g, dtype=torch.float64)
    ill = x * torch.logspace(-6, 6, 48, dtype=torch.float64)  # columns 12 decades apart
    return [
        ("gaussian, bf16", x, x.to(torch.bfloat16)),
        ("ill-conditioned, e4m3", ill, fake_quantize(ill.float(), Format.E4M3, Granularity.TENSOR, ScaleRounding.EXACT)),
        ("identical", x, x.clone()),
        ("all-zero reference", torch.zeros(8, 8), torch.ones(8, 8)),
        ("all-zero both", torch.zeros(8, 8), torch.zeros(8, 8)),
        ("constant", torch.full((8, 8), 3.0), torch.full((8, 8), 3.5)),
        ("NaN in approx", x, torch.where(x > 2, torch.nan, x)),
        ("huge range", x * 1e30, x.to(torch.bfloat16).double() * 1e30),
    ]


@pytest.mark.parametrize("guard", [GUARD_FRAC, 0.0, 0.5])
def test_ref_errors_give_mere_and_sqnr_exactly(guard: float) -> None:
    """The probe's batched errors (one read-back for many candidates) are the metrics' own values."""
    cases = _ref_cases()
    for name, ref, approx in cases:
        re = RefErrors(ref, guard)
        got = RefErrors.metrics(re.terms(approx).tolist())
        want = (mere(ref, approx, guard), sqnr_db(ref, approx))
        for g_, w_ in zip(got, want):
            assert (math.isnan(g_) and math.isnan(w_)) or g_ == w_, (name, got, want)
    # many approximations of one reference, read back at once
    ref, approxs = cases[0][1], [cases[0][2], cases[0][1] * 1.01, cases[0][1]]
    re = RefErrors(ref, guard)
    rows = torch.stack([re.terms(a) for a in approxs]).tolist()
    assert [RefErrors.metrics(r) for r in rows] == [(mere(ref, a, guard), sqnr_db(ref, a)) for a in approxs]


# ------------------------------------------------------------------------------------ tiles
def _reference_fake_quant(
    x: torch.Tensor, fmt: Format, tile: tuple[int, int], pow2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent per-tile loop: (dequantized values, scales), float64 arithmetic for amax."""
    rows, red = x.shape
    tr, tc = tile
    nr, nc = -(-rows // tr), -(-red // tc)
    scales = torch.empty(nr, nc, dtype=torch.float32)
    out = torch.empty(rows, red, dtype=torch.float32)
    fmax = FMAX[fmt]
    for i in range(nr):
        for j in range(nc):
            t = x[i * tr : (i + 1) * tr, j * tc : (j + 1) * tc].to(torch.float32)
            amax = float(t.abs().max())
            s = torch.tensor(fmax, dtype=torch.float32) / torch.tensor(amax, dtype=torch.float32) if amax else torch.tensor(1.0)
            if pow2 and amax:
                s = torch.tensor(2.0 ** math.floor(math.log2(float(s))), dtype=torch.float32)
            scales[i, j] = s
            q = (t * s).clamp(-fmax, fmax).to(FP8_DTYPE[fmt]).to(torch.float32)
            out[i * tr : (i + 1) * tr, j * tc : (j + 1) * tc] = q / s
    return out, scales


@pytest.mark.parametrize("fmt, gran", FMT_GRAN, ids=_ids)
@pytest.mark.parametrize("is_weight", [False, True], ids=["act", "weight"])
@pytest.mark.parametrize("shape", [(129, 140), (3, 33), (257, 129)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_tiles_match_a_per_tile_loop(fmt: Format, gran: Granularity, is_weight: bool, shape: tuple[int, int]) -> None:
    x = _randn(shape, seed=7, dtype=torch.float32)
    x[:, -1] *= 50.0  # the last (ragged) tile holds the row's largest value
    rows, red = shape
    tile = tile_shape(gran, rows, red, is_weight=is_weight)
    expected_tile = {
        Granularity.TENSOR: (rows, red),
        Granularity.ROW: (1, red),
        Granularity.BLOCK: (128, 128) if is_weight else (1, 128),
        Granularity.MX: (1, 32),
    }[gran]
    assert tile == expected_tile
    q = quantize(x, fmt, gran, is_weight=is_weight)
    assert q.data.dtype == FP8_DTYPE[fmt]
    assert q.scale.shape == (-(-rows // tile[0]), -(-red // tile[1]))
    ref, ref_scale = _reference_fake_quant(x, fmt, tile, pow2=(fmt == Format.MXFP8))
    torch.testing.assert_close(q.scale, ref_scale, rtol=0, atol=0)
    torch.testing.assert_close(dequantize(q), ref, rtol=0, atol=0)


def test_ragged_last_tile_uses_its_own_amax() -> None:
    x = torch.ones(2, 130)
    x[:, 128:] = torch.tensor([[0.5, -0.25], [2.0, 1.0]])  # last tile: 2 elements
    q = quantize(x, Format.E4M3, Granularity.BLOCK)
    assert q.scale.shape == (2, 2)
    torch.testing.assert_close(q.scale[:, 0], torch.full((2,), 448.0))
    torch.testing.assert_close(q.scale[:, 1], torch.tensor([448.0 / 0.5, 448.0 / 2.0]))
    assert torch.equal(dequantize(q), x)  # all values exactly representable after scaling
    w = torch.ones(130, 130)
    w[128:, 128:] = 3.0  # the 2x2 corner tile of a weight
    qw = quantize(w, Format.E4M3, Granularity.BLOCK, is_weight=True)
    assert qw.scale.shape == (2, 2)
    torch.testing.assert_close(qw.scale, torch.tensor([[448.0, 448.0], [448.0, 448.0 / 3.0]]))


def test_tile_shape_rejects_none() -> None:
    with pytest.raises(ValueError, match="none"):
        tile_shape(Granularity.NONE, 4, 4, is_weight=False)


# ----------------------------------------------------------------------------- scale guards
@pytest.mark.parametrize("fmt, gran", FMT_GRAN, ids=_ids)
def test_all_zero_input_gives_exact_zeros(fmt: Format, gran: Granularity) -> None:
    x = torch.zeros(5, 70)
    q = quantize(x, fmt, gran)
    assert torch.all(q.scale == 1.0)
    y = dequantize(q)
    assert torch.equal(y, x) and not torch.isnan(y).any()


@pytest.mark.parametrize("fmt, gran", FMT_GRAN, ids=_ids)
def test_zero_tile_beside_nonzero_tiles(fmt: Format, gran: Granularity) -> None:
    x = _randn((4, 256), seed=3, dtype=torch.float32)
    x[1] = 0.0  # a whole zero row: a zero tile for every granularity but tensorwise
    y = fake_quantize(x, fmt, gran)
    assert torch.isfinite(y).all()
    assert torch.equal(y[1], torch.zeros(256))
    assert sqnr_db(x, y) >= CAST_FLOOR_DB[fmt]


@pytest.mark.parametrize("fmt, gran", FMT_GRAN, ids=_ids)
@pytest.mark.parametrize("magnitude", [1e30, 3.0e38, 1e-30, 1e-37], ids=lambda m: f"{m:g}")
def test_extreme_magnitudes_stay_finite_and_accurate(fmt: Format, gran: Granularity, magnitude: float) -> None:
    x64 = _randn((8, 96), seed=5)
    x64 = x64 / x64.abs().max() * magnitude  # amax == magnitude (<= float32 max)
    x = x64.to(torch.float32)
    q = quantize(x, fmt, gran)
    assert torch.isfinite(q.scale).all() and (q.scale > 0).all()
    y = dequantize(q)
    assert torch.isfinite(y).all()
    # relative to the input, the cast keeps its normal accuracy at every scale
    assert sqnr_db(x.double(), y.double()) >= CAST_FLOOR_DB[fmt]


def test_float32_max_does_not_overflow() -> None:
    fmax32 = torch.finfo(torch.float32).max
    x = torch.tensor([[fmax32, -fmax32, 1.0, fmax32 / 3]])
    for fmt, gran in FMT_GRAN:
        y = fake_quantize(x, fmt, gran)
        assert torch.isfinite(y).all(), (fmt, gran, y)
        assert abs(float(y[0, 0]) - fmax32) / fmax32 < 2.0 ** -MANTISSA_BITS[fmt]


def test_subnormal_float32_tile() -> None:
    x = torch.tensor([[1e-40, -3e-41, 0.0, 1e-39]])  # float32 subnormals
    for fmt, gran in FMT_GRAN:
        q = quantize(x, fmt, gran)
        y = dequantize(q)
        assert torch.isfinite(q.scale).all() and torch.isfinite(y).all()
        assert float(y.abs().max()) <= 2e-39


@pytest.mark.parametrize("fmt", [Format.E4M3, Format.E5M2], ids=_ids)
@pytest.mark.parametrize("gran", [Granularity.TENSOR, Granularity.ROW, Granularity.BLOCK], ids=_ids)
def test_pow2_scales_round_down(fmt: Format, gran: Granularity) -> None:
    x = _randn((40, 200), seed=11, dtype=torch.float32) * 37.0
    exact = quantize(x, fmt, gran, ScaleRounding.EXACT)
    p2 = quantize(x, fmt, gran, ScaleRounding.POW2)
    m, _ = torch.frexp(p2.scale)
    assert torch.all(m == 0.5)  # powers of two
    assert torch.all(p2.scale <= exact.scale) and torch.all(p2.scale > exact.scale / 2)
    # nothing saturates: every |x * scale| <= fmax before the cast
    assert float((x.abs() * p2.expanded_scale()).max()) <= FMAX[fmt]


def test_mx_scales_are_e8m0() -> None:
    x = _randn((3, 100), seed=2, dtype=torch.float32)
    x[0] *= 1e20
    x[1] *= 1e-20
    q = quantize(x, Format.MXFP8, Granularity.MX)
    assert q.rounding == ScaleRounding.POW2 and q.scale.shape == (3, 4)
    e = q.e8m0_exponents()
    assert e.dtype == torch.int32 and int(e.min()) >= -127 and int(e.max()) <= 127
    torch.testing.assert_close(q.inv_scale(), torch.ldexp(torch.ones(3, 4), e))
    assert float((x.abs() * q.expanded_scale()).max()) <= FMAX[Format.MXFP8]
    with pytest.raises(ValueError, match="mx"):
        quantize(x, Format.E4M3, Granularity.ROW).e8m0_exponents()


def test_compute_scale_guards() -> None:
    amax = torch.tensor([0.0, 1.0, 448.0, 1e-45, float("inf")])
    s = compute_scale(amax, Format.E4M3, ScaleRounding.EXACT)
    assert s[0] == 1.0 and s[1] == 448.0 and s[2] == 1.0
    assert torch.isfinite(s[3]) and s[3] > 1e30
    assert s[4] == 0.0  # inf amax: the tile dequantizes to NaN (documented)


def test_nonfinite_input_poisons_only_its_tile() -> None:
    """Documented behaviour: a tile holding inf/NaN dequantizes to NaN; other tiles are intact.
    (LokaLinear avoids this by running that GEMM unquantized; see test_linear.py.)"""
    x = _randn((4, 64), seed=9, dtype=torch.float32)
    x[1, 3] = float("inf")
    x[2, 5] = float("nan")
    y = fake_quantize(x, Format.E4M3, Granularity.ROW)
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all()
    assert torch.isfinite(y[[0, 3]]).all()
    assert sqnr_db(x[[0, 3]], y[[0, 3]]) >= 25.0


def test_dtypes_and_validation() -> None:
    x = _randn((16, 64), seed=4, dtype=torch.bfloat16)
    assert fake_quantize(x, "e4m3", "row").dtype == torch.bfloat16
    assert fake_quantize(x, "e4m3", "row", dtype=torch.float32).dtype == torch.float32
    assert fake_quantize(x, "bf16", "none") is x
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.zeros(2, 3, 4), "e4m3", "row")
    with pytest.raises(ValueError, match="bf16"):
        quantize(x, "bf16", "row")
    with pytest.raises(ValueError, match="mxfp8"):
        quantize(x, "mxfp8", "row")
    empty = quantize(torch.zeros(0, 64), "e4m3", "row")
    assert dequantize(empty).shape == (0, 64)


# ------------------------------------------------------------------ hypothesis properties
def _half_ulp(v: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Half the spacing of the format's grid at |v| (normal and subnormal range)."""
    m, emin = MANTISSA_BITS[fmt], MIN_NORMAL_EXP[fmt]
    a = v.abs().to(torch.float64)
    exp = torch.floor(torch.log2(a.clamp(min=2.0**emin)))
    return torch.pow(2.0, exp - m - 1)


_elements = st.floats(
    min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False, allow_subnormal=False, width=32
)


@st.composite
def _operands(draw: st.DrawFn) -> tuple[np.ndarray, float]:
    rows = draw(st.integers(1, 12))
    red = draw(st.integers(1, 160))
    arr = draw(hnp.arrays(np.float32, (rows, red), elements=_elements))
    arr[np.abs(arr) < 1e-20] = 0.0  # keep magnitudes where float32 is normal after scaling
    magnitude = draw(st.sampled_from([1e-12, 1e-3, 1.0, 1e3, 1e12]))
    return arr, magnitude


@settings(max_examples=150, deadline=None)
@given(
    _operands(),
    st.sampled_from(FMT_GRAN),
    st.sampled_from(list(ScaleRounding)),
    st.booleans(),
)
def test_property_error_bound_and_idempotence(
    op: tuple[np.ndarray, float], fmt_gran: tuple[Format, Granularity], rounding: ScaleRounding, is_weight: bool
) -> None:

    arr, magnitude = op
    fmt, gran = fmt_gran
    x = torch.from_numpy(arr) * magnitude  # (rows, red) float32
    q = quantize(x, fmt, gran, rounding, is_weight=is_weight)
    y = dequantize(q)
    assert torch.isfinite(y).all()
    s = q.expanded_scale().to(torch.float64)
    x64 = x.to(torch.float64)
    # |x - deq| <= half an ulp of the format at x*scale, divided by the scale (+ float32 slack)
    bound = _half_ulp(x64 * s, fmt) / s * (1 + 1e-6) + x64.abs() * 2e-7
    err = (x64 - y.to(torch.float64)).abs()
    assert torch.all(err <= bound), float((err - bound).max())
    # zeros stay exact zeros
    assert torch.all(y[x == 0] == 0)
    # idempotence: fake quantization is a projection, dequantize(quantize(y)) == y exactly
    q2 = quantize(y, fmt, gran, rounding, is_weight=is_weight)
    assert torch.equal(dequantize(q2), y)
    if q.rounding == ScaleRounding.EXACT:
        # exact scales: the tile max maps to fmax again, so even the representation repeats
        assert torch.equal(q2.data.view(torch.uint8), q.data.view(torch.uint8))
        torch.testing.assert_close(q2.scale, q.scale, rtol=1e-6, atol=0)
    else:
        # pow2: if the tile max rounded down into the lower binade (e.g. 228.7 -> 224 <= 448/2),
        # the new scale is 2x and the data 2x: same values. Scales only grow, by powers of two.
        ratio = q2.scale / q.scale
        m, _ = torch.frexp(ratio)
        assert torch.all(m == 0.5) and torch.all(ratio >= 1)
