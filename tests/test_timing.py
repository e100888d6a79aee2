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
