"""benchmarks/cast_kernels.py on the CPU: inductor's generated source (in the form torch 2.11's
inductor writes it) joined with an e2e receipt's uncapped cast and amax kernel lists."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
from _bench import load_bench

# a transposing cast (2-D grid) with inductor's byte count (TORCHINDUCTOR_BENCHMARK_KERNEL=1) and a
# 1-D cast without it, in one module, as inductor's output code holds them
CAST_T = "triton_poi_fused__scaled_mm__to_copy_clamp_clone_mul_reciprocal_t_view_4"
CAST = "triton_poi_fused__scaled_mm__to_copy_clamp_hardswish_mul_7"
AMAX = "triton_per_fused__to_copy_abs_add_amax_div_expand_hardswish_hardswish_backward_mul_pow_sum_view_2"
SOURCE = f'''
import triton
import triton.language as tl
from torch._inductor.runtime import triton_heuristics

@triton_heuristics.pointwise(
    size_hints={{'y': 2048, 'x': 8192}}, tile_hint=TileHint.DEFAULT,
    filename=__file__,
    triton_meta={{'signature': {{'in_ptr0': '*bf16', 'in_ptr1': '*fp32', 'out_ptr0': '*fp8e4nv', 'ynumel': 'i32', 'xnumel': 'i32', 'YBLOCK': 'constexpr', 'XBLOCK': 'constexpr'}}, 'constants': {{}}}},
    inductor_meta={{'grid_type': 'Grid2D', 'kernel_name': '{CAST_T}', 'mutated_arg_names': [], 'num_load': 2, 'num_store': 1, 'kernel_num_gb': 0.050331648, 'kernel_flop': 0}},
    min_elem_per_thread=0
)
@triton.jit
def {CAST_T}(in_ptr0, in_ptr1, out_ptr0, ynumel, xnumel, YBLOCK : tl.constexpr, XBLOCK : tl.constexpr):
    ynumel = 2048
    xnumel = 8192
    yoffset = tl.program_id(1) * YBLOCK
    yindex = yoffset + tl.arange(0, YBLOCK)[:, None]
    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[None, :]
    tmp0 = tl.load(in_ptr0 + (yindex + 2048*xindex), None).to(tl.float32)
    tmp1 = tl.load(in_ptr1 + (0))
    tl.store(out_ptr0 + (xindex + 8192*yindex), (tmp0 * tmp1).to(tl.float8e4nv), None)


@triton_heuristics.pointwise(
    size_hints={{'x': 16777216}},
    filename=__file__,
    triton_meta={{'signature': {{'in_ptr0': '*bf16', 'in_ptr1': '*fp32', 'out_ptr0': '*fp8e4nv', 'xnumel': 'i32', 'XBLOCK': 'constexpr'}}, 'constants': {{}}}},
    inductor_meta={{'grid_type': 'Grid1D', 'kernel_name': '{CAST}', 'mutated_arg_names': [], 'num_load': 2}},
    min_elem_per_thread=0
)
@triton.jit
def {CAST}(in_ptr0, in_ptr1, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xnumel = 16777216
    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:]
    tmp0 = tl.load(in_ptr0 + (xindex), None).to(tl.float32)
    tmp1 = tl.load(in_ptr1 + (0))
    tl.store(out_ptr0 + (xindex), (tmp0 * tmp1).to(tl.float8e4nv), None)
'''


def _load():  # noqa: ANN202
    return load_bench("cast_kernels.py")


def _receipt(device: str = "NVIDIA H100 80GB HBM3") -> dict:
    def prof(scale: float) -> dict:
        return {"fp8_casts": {"ms": 0.0, "calls": 0.0, "kernels": [
                    {"name": CAST_T, "ms": 0.30 * scale, "calls": 10.0, "kind": "pointwise"},
                    {"name": CAST, "ms": 0.02 * scale, "calls": 1.0, "kind": "pointwise"}]},
                "amax": {"ms": 0.0, "calls": 0.0, "kernels": [
                    {"name": AMAX, "ms": 0.40 * scale, "calls": 10.0, "kind": "reduction"}]}}

    return {"meta": {"device": device, "batch": 8192, "torch": "2.11.0+cu130", "date": "2026-12-06"},
            "runs": [{"variant": "torchao_tensorwise_filter", "seed": 0, "profile": prof(1.0)},
                     {"variant": "torchao_tensorwise_filter", "seed": 1, "profile": prof(1.2)},
                     {"variant": "bf16_mods", "seed": 0, "profile": {"fp8_casts": {"ms": 0, "calls": 0, "kernels": []},
                                                                      "amax": {"ms": 0, "calls": 0, "kernels": []}}}]}


def test_parse_source_reads_inductors_bytes_and_estimates_the_rest() -> None:
    ck = _load()
    k = {r["name"]: r for r in ck.parse_source(SOURCE)}
    assert set(k) == {CAST_T, CAST}
    assert k[CAST_T]["gb"] == pytest.approx(0.050331648) and k[CAST_T]["bytes_from"] == "inductor"
    assert k[CAST_T]["tiled"] and k[CAST_T]["numel"] == 2048 * 8192
    # 16M elements: 2 bytes read + 1 written each, and the scale pointer read once at (0)
    assert k[CAST]["bytes_from"] == "estimated" and not k[CAST]["tiled"]
    assert k[CAST]["gb"] == pytest.approx((16777216 * 3 + 4) / 1e9)
    inplace = SOURCE.replace("'out_ptr0': '*fp8e4nv', 'xnumel'", "'in_out_ptr0': '*bf16', 'xnumel'")
    inplace = inplace.replace("(in_ptr0, in_ptr1, out_ptr0, xnumel,", "(in_ptr0, in_ptr1, in_out_ptr0, xnumel,")
    inplace = inplace.replace("tl.store(out_ptr0 + (xindex)", "tl.store(in_out_ptr0 + (xindex)")
    got = {r["name"]: r for r in ck.parse_source(inplace)}[CAST]
    assert got["gb"] == pytest.approx((16777216 * (2 + 2 * 2) + 4) / 1e9)  # an in_out pointer is read and written


def test_analyse_joins_the_profile_with_the_source_and_ranks_by_excess(tmp_path: Path) -> None:
    ck = _load()
    bundle = tmp_path / "cast_kernels.tgz"
    with tarfile.open(bundle, "w:gz") as tf:
        data = SOURCE.encode()
        info = tarfile.TarInfo("tmp/torchinductor_root/ab/cabcdef.py")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    res = ck.analyse(_receipt(), ck.read_sources(bundle))
    assert res["peak_gbs"] == 3350.0
    v = res["variants"]["torchao_tensorwise_filter"]
    rows = {r["name"]: r for r in v["kernels"]}
    t = rows[CAST_T]
    assert t["ms"] == pytest.approx(0.33) and t["calls"] == 10.0 and t["us_per_call"] == pytest.approx(33.0)
    assert t["floor_ms"] == pytest.approx(10 * 0.050331648 / 3350 * 1e3)
    assert t["excess_ms"] == pytest.approx(0.33 - t["floor_ms"])
    assert t["achieved_gbs"] == pytest.approx(10 * 0.050331648 / 0.33e-3)
    assert t["tiled"] and not t["ambiguous"] and t["bytes_from"] == "inductor"
    assert rows[AMAX]["gb_per_call"] is None and v["without_source"] == [AMAX]
    assert v["ms"] == pytest.approx(0.33 + 0.022 + 0.44)
    assert v["excess_ms"] == pytest.approx(t["excess_ms"] + rows[CAST]["excess_ms"])
    # ranked by excess, the kernels without source last; a variant without casts has no entry
    assert [r["name"] for r in v["kernels"]] == [CAST_T, CAST, AMAX]
    assert set(res["variants"]) == {"torchao_tensorwise_filter"}
    md = ck.table(res)
    assert "torchao_tensorwise_filter" in md and "| yes |" in md and "(est.)" in md and "1 without source" in md


def test_a_name_is_matched_whole_unless_the_profile_cut_it(tmp_path: Path) -> None:
    ck = _load()
    (tmp_path / "k.py").write_text(SOURCE.replace(f"def {CAST_T}(", f"def {CAST_T}1(")
                                   .replace(f"'kernel_name': '{CAST_T}'", f"'kernel_name': '{CAST_T}1'"))
    v = ck.analyse(_receipt(), ck.read_sources(tmp_path))["variants"]["torchao_tensorwise_filter"]
    assert CAST_T in v["without_source"]  # "..._4" is not "..._41"
    long = "triton_poi_fused__scaled_mm_" + "x" * 200
    assert ck._same(long, long[:160]) and not ck._same(CAST_T + "1", CAST_T)


def test_the_cli_writes_json_and_md_and_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ck = _load()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "k.py").write_text(SOURCE)
    res = tmp_path / "results.json"
    res.write_text(json.dumps(_receipt()))
    out = tmp_path / "o" / "cast_kernels.json"
    assert ck.main([str(res), "--src", str(tmp_path / "src"), "--out", str(out), "--md"]) == 0
    assert json.loads(out.read_text())["variants"]["torchao_tensorwise_filter"]["kernels"]
    assert out.with_suffix(".md").read_text().startswith("Cast and amax kernels against 3350 GB/s")
    with pytest.raises(SystemExit, match="no such file or directory"):
        ck.main([str(res), "--src", str(tmp_path / "nope.tgz")])
    with pytest.raises(SystemExit, match="a bandwidth is a positive number"):
        ck.main([str(res), "--src", str(tmp_path / "src"), "--peak-gbs", "-1"])
    with pytest.raises(SystemExit, match="no memory bandwidth known for device 'Some GPU'"):
        ck.analyse(_receipt("Some GPU"), {})
    old = {"meta": {"device": "NVIDIA H100"}, "runs": [{"variant": "x", "profile": {"top": []}}]}
    with pytest.raises(SystemExit, match="no 'fp8_casts' / 'amax' lists"):
        ck.analyse(old, {})
    assert ck.analyse(_receipt("Some GPU"), {}, peak_gbs=1000.0)["peak_gbs"] == 1000.0
