"""benchmarks/gemm_autotune.py: inductor's GEMM templates against cuBLAS at the largest sites (a
GPU hint for issue 21). The GPU numbers are a receipt's; here, its summary and its refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._bench import load_bench

ga = load_bench("gemm_autotune.py")


def _row(shape: str, prec: str, mode: str, ms: float | None) -> dict[str, object]:
    return {"shape": shape, "prec": prec, "mode": mode, **({} if ms is None else {"gpu_ms": ms})}


def test_the_summary_compares_each_mode_and_prices_fp8_against_bf16_under_the_default_lowering() -> None:
    fp8 = "e4m3.tensor.fa.torch_scaled_mm"
    rows = [_row("8192x16384x4096", fp8, "default", 3.2), _row("8192x16384x4096", fp8, "autotune", 2.5),
            _row("8192x16384x4096", "bf16", "default", 4.8), _row("8192x16384x4096", "bf16", "autotune", 4.0),
            _row("8192x16384x4096", fp8, "autotune_tma", 2.0),
            _row("8192x2048x8192", fp8, "default", 0.9), _row("8192x2048x8192", fp8, "autotune", None)]
    s = {(r["shape"], r["prec"]): r for r in ga.summarize(rows)}
    big = s[("8192x16384x4096", fp8)]
    assert big["autotune_vs_default"] == pytest.approx(3.2 / 2.5)
    assert big["default_speedup_vs_bf16_default"] == pytest.approx(4.8 / 3.2)
    assert big["autotune_speedup_vs_bf16_default"] == pytest.approx(4.8 / 2.5)
    assert big["autotune_tma_vs_default"] == pytest.approx(3.2 / 2.0)
    assert s[("8192x16384x4096", "bf16")]["autotune_vs_default"] == pytest.approx(4.8 / 4.0)
    assert "default_speedup_vs_bf16_default" not in s[("8192x16384x4096", "bf16")]
    small = s[("8192x2048x8192", fp8)]  # its autotune cell failed; no bf16 cell at this shape
    assert small == {"shape": "8192x2048x8192", "prec": fp8, "default_ms": 0.9}


@pytest.mark.parametrize("args, says", [
    (["--shapes", "8192x2048"], "'8192x2048' is not MxKxN"),
    (["--shapes", "8192x0x16"], "below 1"),
    (["--modes", "default,fast"], "unknown 'fast'; choose among default, autotune, autotune_tma"),
    (["--precs", "e4m3.tensor.nope"], "names backend 'nope'; choose among"),
    (["--precs", "e9m9.tensor.torch_scaled_mm"], "'e9m9'"),
])
def test_bad_arguments_are_refused_with_the_value_and_the_fix(tmp_path: Path, args: list[str], says: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(BaseException) as e:
        ga.main([*args, "--out", str(tmp_path / "r.json")])
    text = str(e.value) + capsys.readouterr().err
    assert says in text, text
    assert not (tmp_path / "r.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_on_a_cpu_it_says_it_needs_a_gpu_and_writes_nothing(tmp_path: Path) -> None:
    from loka_tune.errors import BackendError

    with pytest.raises(BackendError, match="needs a CUDA GPU"):
        ga.main(["--out", str(tmp_path / "r.json")])
    assert not (tmp_path / "r.json").exists()
