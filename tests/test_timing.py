"""The timing cache (CPU) and the GPU-only guards of the timing harness."""

from __future__ import annotations

import json

import pytest
import torch

from loka_tune.errors import BackendError, ConfigError
from loka_tune.kernels.timing import TimingCache, TimingResult, make_operands, time_gemm, timing_key


def test_cache_round_trip_and_keys(tmp_path) -> None:
    path = tmp_path / "cache.json"
    c = TimingCache(path, device="NVIDIA H200", versions="torch=2.11")
    assert c.get("bf16", 8192, 256, 256, "fwd") is None
    c.put("bf16", 8192, 256, 256, "fwd", TimingResult(8.8e-6, 0.02, 700, "graph"))
    c.put("e4m3.row.triton", 8192, 256, 256, "wgrad", 2.1e-5)
    again = TimingCache(path, device="NVIDIA H200", versions="torch=2.11")
    assert again.get("bf16", 8192, 256, 256, "fwd") == pytest.approx(8.8e-6)
    assert again.entry("bf16", 8192, 256, 256, "fwd")["method"] == "graph"
    assert again.get("e4m3.row.triton", 8192, 256, 256, "wgrad") == pytest.approx(2.1e-5)
    # another role, shape, device or library version is another key
    assert again.get("e4m3.row.triton", 8192, 256, 256, "fwd") is None
    assert again.get("bf16", 8192, 256, 512, "fwd") is None
    assert TimingCache(path, device="NVIDIA H100", versions="torch=2.11").get("bf16", 8192, 256, 256, "fwd") is None
    assert TimingCache(path, device="NVIDIA H200", versions="torch=2.12").get("bf16", 8192, 256, 256, "fwd") is None
    assert timing_key("bf16", 1, 2, 3, "dgrad", "d", "v") == "d|v|dgrad|1x2x3|bf16"
    assert len(again) == 2 and json.loads(path.read_text())["version"] == 1


def test_cache_rejects_bad_values_and_files(tmp_path) -> None:
    c = TimingCache(tmp_path / "c.json", device="x", versions="y")
    with pytest.raises(ValueError, match="positive"):
        c.put("bf16", 1, 1, 1, "fwd", 0.0)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="delete it"):
        TimingCache(bad)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"version": 0, "entries": {}}))
    with pytest.raises(ConfigError, match="version"):
        TimingCache(old)


def test_operand_layouts_follow_the_role() -> None:
    a, b = make_operands(64, 32, 16, "fwd", device="cpu", dtype=torch.float32)
    assert a.shape == (64, 32) and b.shape == (16, 32) and a.is_contiguous() and b.is_contiguous()
    a, b = make_operands(64, 32, 16, "dgrad", device="cpu", dtype=torch.float32)
    assert a.is_contiguous() and not b.is_contiguous() and b.shape == (16, 32)
    a, b = make_operands(64, 32, 16, "wgrad", device="cpu", dtype=torch.float32)
    assert not a.is_contiguous() and not b.is_contiguous() and a.shape == (64, 32)
    assert a.abs().sum() > 0  # never zeros


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error path")
def test_timing_without_gpu_is_a_backend_error(tmp_path) -> None:
    with pytest.raises(BackendError, match="cost model"):
        time_gemm("bf16", 128, 128, 128, "fwd")
    # a cached value is still served without a GPU
    c = TimingCache(tmp_path / "c.json")
    c.put("bf16", 128, 128, 128, "fwd", 1e-5)
    assert time_gemm("bf16", 128, 128, 128, "fwd", cache=c) == pytest.approx(1e-5)


# kernel names as the device's profiles recorded them (benchmarks/results: the H100 and H200 e2e
# receipts and gemm_autotune_*), with what each does
NAMED_KERNELS = [
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "gemm"),  # cuBLASLt bf16
    ("nvjet_sm90_qqtst_128x256_128x4_2x1_v_bz_coopA_TNN", "gemm_fp8"),  # cuBLASLt FP8 (_scaled_mm)
    ("nvjet_sm90_qrtst_128x128_128x6_2x1_v_bz_coopA_algo2_TNT", "gemm_fp8"),  # torchao's _scaled_mm
    ("triton_tem_fused__scaled_mm__to_copy_clamp_clone_div_eq_full_like_mul_ones_like_reciprocal_t_where_4",
     "gemm_fp8"),  # inductor's scaled-mm template, its prologue cast fused in
    ("triton_tem_fused_mm_3", "gemm"),  # inductor's mm template
    ("void cutlass::device_kernel<f8f8bf16_rowwise>", "gemm_fp8"),
    ("_fp8_gemm_kernel", "gemm_fp8"),  # ours
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "gemm"),
    # inductor's casts that feed an FP8 GEMM: named after _scaled_mm, no matrix product
    ("triton_poi_fused__scaled_mm__to_copy_clamp_clone_div_eq_full_like_hardswish_hardswish_backward_mul_"
     "ones_like_t_where_4", "pointwise"),
    ("triton_poi_fused__scaled_mm__to_copy_clamp_hardswish_mul_t_4", "pointwise"),
    ("triton_red_fused_abs_amax_hardswish_0", "reduction"),
    ("triton_per_fused__to_copy_add_native_layer_norm_backward_transpose_view_25", "reduction"),
    ("triton_red_fused__scaled_mm__to_copy_abs_amax_1", "reduction"),
    ("void (anonymous namespace)::indexing_backward_kernel<float, 4>(long const*, long const*, float const*)",
     "embedding"),
    ("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<at::native::index_put_", "embedding"),
    ("void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int, long)", "embedding"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "FusedOptimizerTensorListMetadata<4>", "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "pointwise"),
    ("_tensor_cast_kernel", "pointwise"),  # our Triton quantization
    ("_tensor_amax_kernel", "reduction"),
    ("Memcpy HtoD (Pageable -> Device)", "copy"),
    ("Memset (Device)", "copy"),
    ("void some_library::mystery<3>", "other"),
]


@pytest.mark.parametrize("name, kind", NAMED_KERNELS)
def test_kernel_kind_reads_the_names_the_profiles_hold(name: str, kind: str) -> None:
    from loka_tune.kernels.timing import KERNEL_KINDS, is_gemm_kernel, kernel_kind

    assert kernel_kind(name) == kind and kind in KERNEL_KINDS
    assert is_gemm_kernel(name) == kind.startswith("gemm")


def test_gemm_time_leaves_out_inductors_casts_named_after_scaled_mm() -> None:
    """The largest FP8 price cell on the H100 (gemm_autotune_h100_s25: three cuBLASLt FP8 GEMMs and
    inductor's casts): before 2026-12-06 the casts named ``triton_poi_fused__scaled_mm_...`` were
    counted as GEMM time."""
    from loka_tune.kernels.timing import kernel_summary

    cell = [("nvjet_sm90_qqtst_192x192_128x4_1x2_h_bz_coopB_TNN", 736.1),
            ("nvjet_sm90_qqtst_320x128_128x3_1x2_h_bz_coopB_TNT", 732.9),
            ("nvjet_sm90_qqtst_128x256_128x4_2x1_v_bz_coopA_TNN", 689.3),
            ("triton_poi_fused__scaled_mm__to_copy_clamp_clone_div_eq_full_like_hardswish_hardswish_backward_4", 314.4),
            ("triton_red_fused_abs_amax_hardswish_0", 217.9),
            ("triton_poi_fused__scaled_mm__to_copy_clamp_hardswish_mul_t_4", 144.3)]
    s = kernel_summary(cell, steps=1)
    assert s["gemm_ms"] == pytest.approx(2.1583) and s["kinds"]["gemm_fp8"] == pytest.approx(2.1583)
    assert s["kinds"]["pointwise"] == pytest.approx(0.4587) and s["kinds"]["reduction"] == pytest.approx(0.2179)
    assert s["gemm_share"] == pytest.approx(2.1583 / 2.8349)
    assert [t["kind"] for t in s["top"]] == ["gemm_fp8"] * 3 + ["pointwise", "reduction", "pointwise"]
    assert s["fp8_casts"]["ms"] == pytest.approx(0.4587) and s["fp8_casts"]["calls"] == 2
    assert s["amax"]["ms"] == pytest.approx(0.2179) and s["amax"]["calls"] == 1
    few = kernel_summary(cell, steps=2, top=1)  # the cast and amax lists are not cut to ``top``
    assert len(few["top"]) == 1 and len(few["fp8_casts"]["kernels"]) == 2
    assert few["fp8_casts"]["ms"] == pytest.approx(0.4587 / 2) and few["fp8_casts"]["calls"] == 1
    assert [k["ms"] for k in few["fp8_casts"]["kernels"]] == pytest.approx([0.1572, 0.07215])


# inductor's kernels from the e2e receipts of 2026-12-06 (e2e_static_h100_s27_seed*.json): whether
# each writes an FP8 operand (named after the _scaled_mm it feeds) and whether it takes an amax
CAST_AND_AMAX = [
    ("triton_poi_fused__scaled_mm__to_copy_clamp_clone_mul_reciprocal_t_view_4", True, False),  # torchao's
    ("triton_poi_fused__scaled_mm__to_copy_clamp_clone_div_eq_full_like_hardswish_mul_ones_like_reciprocal_t_view_"
     "where_6", True, False),  # ours
    ("triton_poi_fused__scaled_mm__to_copy_clamp_clone_hardswish_mul_t_view_21", True, False),
    ("triton_per_fused__to_copy_abs_add_amax_div_expand_hardswish_hardswish_backward_mul_pow_sum_view_2", False, True),
    ("triton_per_fused__to_copy_abs_add_div_expand_hardswish_hardswish_backward_max_mul_pow_sum_view_2", False, True),
    ("triton_red_fused__to_copy__unsafe_view_abs_add_amax_cat_mean_mul_pow_rsqrt_transpose_view_34", False, True),
    ("triton_red_fused__scaled_mm__to_copy_abs_amax_1", True, True),
    ("triton_per_fused__to_copy_add_div_expand_hardswish_hardswish_backward_mul_pow_sum_view_3", False, False),
    ("triton_poi_fused__to_copy_add_clone_div_expand_mul_pow_slice_transpose_view_14", False, False),
    ("triton_red_fused__to_copy__unsafe_view_add_cat_clone_mean_mul_pow_rsqrt_transpose_view_21", False, False),
    ("nvjet_sm90_qqtst_128x256_128x4_2x1_v_bz_coopA_TNN", False, False),
    ("triton_tem_fused__scaled_mm__to_copy_clamp_clone_div_eq_full_like_mul_ones_like_reciprocal_t_where_4", False,
     False),  # a GEMM template with its prologue cast: GEMM time
    ("_tensor_amax_kernel", False, False),  # our eager Triton quantization: not inductor's
    ("_dual_cast_kernel", True, False),  # the dual cast (inline form: inductor launches it; 2026-12-07, H100)
    ("_fp8cast_norm_bwd_kernel", True, False),  # benchmarks/fp8_chain.py's norms that write FP8 operands
    ("_fp8cast_dual_amax_kernel", True, False),  # benchmarks/delayed_scales.py's cast with its amax
]


@pytest.mark.parametrize("name, cast, amax", CAST_AND_AMAX)
def test_cast_and_amax_kernels_are_read_from_inductors_names(name: str, cast: bool, amax: bool) -> None:
    from loka_tune.kernels.timing import is_amax_kernel, is_fp8_cast_kernel

    assert is_fp8_cast_kernel(name) is cast and is_amax_kernel(name) is amax
