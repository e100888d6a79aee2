"""The CPU cost model: shape behaviour, bf16/FP8 crossover, role handling, errors."""

from __future__ import annotations

import math

import pytest

from loka_tune.config import GemmChoice, GemmRole, SitePrecision
from loka_tune.errors import ConfigError, UnsupportedChoiceError
from loka_tune.kernels import costmodel as cm

ROW = "e4m3.row.torch_scaled_mm"


@pytest.mark.parametrize("device", sorted(cm.DEVICES))
@pytest.mark.parametrize("choice", ["bf16", ROW, "e4m3.tensor.triton", "e4m3.block.triton"])
def test_monotone_in_every_dimension(device: str, choice: str) -> None:
    base = (4096, 512, 512)
    t0 = cm.estimate_gemm_seconds(choice, *base, "fwd", device)
    assert t0 > 0 and math.isfinite(t0)
    for i in range(3):
        bigger = list(base)
        bigger[i] *= 4
        assert cm.estimate_gemm_seconds(choice, *bigger, "fwd", device) > t0


def test_large_gemms_reach_a_plausible_fraction_of_peak() -> None:
    m = k = n = 8192
    t = cm.estimate_gemm_seconds("bf16", m, k, n, "fwd", "h200")
    tflops = 2 * m * k * n / t / 1e12
    # measured on the H200: ~700-790 TFLOP/s bf16 (docs/gpu.md, KINDS.md); datasheet 989
    assert 550 < tflops < 989


@pytest.mark.parametrize("shape", [(8192, 256, 256), (4096, 128, 64), (65536, 1024, 64)])
def test_small_gemms_fp8_with_quantization_is_slower_than_bf16(shape: tuple[int, int, int]) -> None:
    # docs/gpu.md: fbgemm rowwise (quant + GEMM) at 8192x256x256 took 2.4x bf16
    bf16 = cm.estimate_gemm_seconds("bf16", *shape, "fwd")
    for c in [ROW, "e4m3.row.fbgemm", "e4m3.tensor.torchao"]:
        assert cm.estimate_gemm_seconds(c, *shape, "fwd") > bf16, c


@pytest.mark.parametrize("shape", [(32768, 4096, 4096), (16384, 8192, 8192)])
def test_big_gemms_fp8_is_faster_than_bf16(shape: tuple[int, int, int]) -> None:
    # docs/gpu.md: 1.6x faster at 32768x4096x4096 with quantization included (FBGEMM's default
    # use_fast_accum=True; without it FBGEMM's rowwise GEMM measured 2-3x slower on the H200)
    bf16 = cm.estimate_gemm_seconds("bf16", *shape, "fwd")
    for c in [ROW, "e4m3.row.fa.fbgemm", "e4m3.row.fa.torch_scaled_mm"]:
        s = bf16 / cm.estimate_gemm_seconds(c, *shape, "fwd")
        assert 1.2 < s < 2.0, (c, s)


def test_quantization_is_counted() -> None:
    steps = cm.gemm_breakdown(ROW, 32768, 1024, 1024, "fwd")
    names = [s.name for s in steps]
    assert any(n.startswith("quant A") for n in names) and any(n.startswith("quant B") for n in names)
    gemm_only = sum(s.seconds for s in steps if s.name.startswith("gemm"))
    assert cm.estimate_gemm_seconds(ROW, 32768, 1024, 1024, "fwd") > gemm_only


def test_tensorwise_needs_two_passes_rowwise_one() -> None:
    t = {s.name: s for s in cm.gemm_breakdown("e4m3.tensor.triton", 65536, 1024, 1024, "fwd")}
    r = {s.name: s for s in cm.gemm_breakdown("e4m3.row.triton", 65536, 1024, 1024, "fwd")}
    assert t["quant A triton_tensor"].bytes > 1.5 * r["quant A triton_row"].bytes


def test_roles_differ_by_transposition_cost() -> None:
    # fbgemm needs contiguous inputs: dgrad's W^T and wgrad's dY^T, X^T cost a copy each
    shape = (32768, 1024, 1024)
    fwd = cm.gemm_breakdown("e4m3.row.fbgemm", *shape, "fwd")
    wgrad = cm.gemm_breakdown("e4m3.row.fbgemm", *shape, "wgrad")
    assert not any(s.name.startswith("transpose") for s in fwd)
    assert sum(s.name.startswith("transpose") for s in wgrad) == 2
    # bf16 reads transposed views natively: same time for the same canonical shape
    assert cm.estimate_gemm_seconds("bf16", *shape, "fwd") == cm.estimate_gemm_seconds("bf16", *shape, "wgrad")


def test_site_seconds_uses_role_shapes() -> None:
    M, K, N = 16384, 1024, 256
    d = cm.estimate_site_seconds(SitePrecision.uniform("bf16"), M, K, N, "h200")
    assert set(d) == {"fwd", "dgrad", "wgrad"}
    for role in ("fwd", "dgrad", "wgrad"):
        assert d[role] == pytest.approx(cm.estimate_gemm_seconds("bf16", *GemmRole(role).shape(M, K, N), role))


def test_non_multiple_of_tile_costs_a_whole_tile() -> None:
    t128 = cm.estimate_gemm_seconds("bf16", 65536, 1024, 1280, "fwd")
    t129 = cm.estimate_gemm_seconds("bf16", 65536, 1024, 1281, "fwd")
    assert t129 > t128 * 1.03


def test_emulated_is_priced_as_the_fastest_real_backend() -> None:
    shape = (32768, 2048, 2048)
    em = cm.estimate_gemm_seconds("e4m3.row.emulated", *shape, "fwd")
    reals = []
    for be in ("torch_scaled_mm", "fbgemm", "triton", "torchao"):
        reals.append(cm.estimate_gemm_seconds(f"e4m3.row.{be}", *shape, "fwd"))
    assert em == pytest.approx(min(reals))


def test_faster_device_is_faster() -> None:
    shape = (32768, 4096, 4096)
    h100 = cm.estimate_gemm_seconds(ROW, *shape, "fwd", "h100")
    b200 = cm.estimate_gemm_seconds(ROW, *shape, "fwd", "b200")
    assert b200 < h100
    # memory-bound quantization benefits from the H200's bandwidth
    q = "e4m3.tensor.torchao"
    assert cm.estimate_gemm_seconds(q, 65536, 256, 64, "fwd", "h200") < cm.estimate_gemm_seconds(
        q, 65536, 256, 64, "fwd", "h100"
    )


def test_unknown_device_lists_devices() -> None:
    with pytest.raises(ConfigError) as e:
        cm.estimate_gemm_seconds("bf16", 128, 128, 128, "fwd", "tpu-v5")
    for d in cm.DEVICES:
        assert d in str(e.value)
    assert cm.device_key("NVIDIA H200") == "h200"


def test_unsupported_choices_raise() -> None:
    with pytest.raises(UnsupportedChoiceError, match="Blackwell"):
        cm.estimate_gemm_seconds("mxfp8.mx.emulated", 4096, 4096, 4096, "fwd", "h200")
    assert cm.estimate_gemm_seconds("mxfp8.mx.emulated", 4096, 4096, 4096, "fwd", "b200") > 0
    with pytest.raises(UnsupportedChoiceError, match="wgrad"):
        cm.estimate_gemm_seconds("e4m3.block.fbgemm", 4096, 4096, 4096, "wgrad")
    with pytest.raises(UnsupportedChoiceError, match="e5m2"):
        cm.estimate_gemm_seconds("e5m2.row.torch_scaled_mm", 4096, 4096, 4096, "dgrad")
    with pytest.raises(UnsupportedChoiceError, match="backend"):
        cm.estimate_gemm_seconds("e4m3.row.nosuch", 4096, 4096, 4096, "fwd")


def test_bad_dimensions_and_roles() -> None:
    with pytest.raises(ConfigError, match="m=0"):
        cm.estimate_gemm_seconds("bf16", 0, 128, 128, "fwd")
    with pytest.raises(ConfigError, match="role"):
        cm.estimate_gemm_seconds("bf16", 128, 128, 128, "backward")


def test_best_modeled_choice_respects_margin() -> None:
    cands = [GemmChoice.parse(ROW), GemmChoice.parse("e4m3.row.fbgemm")]
    small, _ = cm.best_modeled_choice(cands, 8192, 256, 256, "fwd")
    assert small.is_bf16
    big, t = cm.best_modeled_choice(cands, 32768, 4096, 4096, "fwd")
    assert not big.is_bf16 and t < cm.estimate_gemm_seconds("bf16", 32768, 4096, 4096, "fwd")
    never, _ = cm.best_modeled_choice(cands, 32768, 4096, 4096, "fwd", min_speedup=10.0)
    assert never.is_bf16


def test_calibration_override_changes_the_model(tmp_path) -> None:
    base = cm.estimate_gemm_seconds("bf16", 8192, 256, 256, "fwd")
    try:
        cm.set_calibration({"launch_s": 50e-6})
        assert cm.estimate_gemm_seconds("bf16", 8192, 256, 256, "fwd") > base + 40e-6
    finally:
        cm.set_calibration(None)
    assert cm.estimate_gemm_seconds("bf16", 8192, 256, 256, "fwd") == pytest.approx(base)
    with pytest.raises(ConfigError):
        cm.load_calibration(tmp_path / "missing.json")


def test_shipped_calibration_is_valid() -> None:
    cal = cm.load_calibration()
    assert cal["schema_version"] == 1
    for fam, g in cal["gemm"].items():
        assert 0 < g["rate_frac"] <= 1.0, fam
    for fam, q in cal["quant"].items():
        assert 0 < q["bw_frac"] <= 1.0, fam
