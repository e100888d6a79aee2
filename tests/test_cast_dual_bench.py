"""benchmarks/cast_dual.py: one cast writing both FP8 layouts of an operand (the torch reference
on the CPU, its Triton kernel on a GPU), and a Linear trained through it, against float64
references with explicit floors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _bench import assert_compiled_matches_eager_and_float64, linear_grads64, load_bench
from torch import nn

from loka_tune.kernels.quant import sqnr_db as _sqnr

REPO = Path(__file__).resolve().parents[1]


def _load():  # noqa: ANN202
    return load_bench("cast_dual.py", "cast_dual_bench", register=True)


def test_the_cast_writes_the_data_and_its_transpose_saturated() -> None:
    cd = _load()
    x = torch.tensor([[1.0, -2.0, 1000.0], [0.0, 3.5, -1e6]])
    y, yt = cd.cast_dual(x, torch.tensor(2.0))  # the product's op
    assert y.dtype == torch.float8_e4m3fn and y.shape == (2, 3) and yt.shape == (3, 2)
    assert y.is_contiguous() and yt.is_contiguous()
    assert y.float().tolist() == [[2.0, -4.0, 448.0], [0.0, 7.0, -448.0]]  # 2000 and -2e6 saturate
    assert torch.equal(yt.float(), y.float().t())
    ref_y, ref_yt = cd.cast_dual_reference(x.t(), torch.tensor(2.0))  # any strides in
    assert torch.equal(ref_y.float(), y.float().t()) and torch.equal(ref_yt.float(), y.float())
    with pytest.raises(ValueError, match=r"2-D operand \(rows, cols\), got shape \(4,\)"):
        cd.cast_dual(torch.ones(4), torch.tensor(1.0))


@pytest.mark.parametrize("m,k,n", [(32, 64, 32), (64, 128, 48), (48, 32, 160)])
def test_a_dual_cast_linear_trains_within_fp8_error(m: int, k: int, n: int) -> None:
    cd = _load()
    torch.manual_seed(m + k + n)
    lin = cd.DualCastLinear.from_linear(nn.Linear(k, n, bias=False))
    x = torch.randn(m, k) * 3.0
    dy = torch.randn(m, n)
    xg = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(xg)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    y.float().backward(dy)
    y64, dx64, dw64 = linear_grads64(lin.weight, None, x, dy)
    # e4m3 carries 3 mantissa bits (~28 dB per operand); two quantized operands per GEMM
    assert _sqnr(y64, y) > 22.0 and _sqnr(dx64, xg.grad) > 22.0 and _sqnr(dw64, lin.weight.grad) > 22.0
    assert lin.weight.grad.dtype == torch.float32 and xg.grad.dtype == torch.float32


def test_adversarial_operands_huge_range_a_constant_and_zeros() -> None:
    cd = _load()
    torch.manual_seed(5)
    lin = cd.DualCastLinear.from_linear(nn.Linear(64, 32, bias=False))
    x = torch.randn(32, 64) * torch.logspace(-3, 4, 64)  # columns spanning 7 decades
    dy = torch.randn(32, 32)
    xg = x.clone().requires_grad_(True)
    y = lin(xg)
    y.backward(dy)
    y64, dx64, dw64 = linear_grads64(lin.weight, None, x, dy)
    assert torch.isfinite(y).all() and _sqnr(y64, y) > 20.0 and _sqnr(dw64, lin.weight.grad) > 20.0
    assert _sqnr(dx64, xg.grad) > 22.0
    c = torch.full((16, 64), 0.75)
    assert _sqnr(c.double() @ lin.weight.detach().double().t(), lin(c)) > 22.0
    z = torch.zeros(8, 64, requires_grad=True)
    out = lin(z)
    out.sum().backward()
    assert torch.equal(out, torch.zeros(8, 32)) and torch.isfinite(z.grad).all()  # amax 0: scale 1, no NaN


def test_it_compiles_whole_on_the_cpu_and_matches_eager() -> None:
    cd = _load()
    torch.manual_seed(6)
    block = nn.Sequential(nn.Hardswish(), cd.DualCastLinear.from_linear(nn.Linear(64, 32, bias=False)))
    x = torch.randn(48, 64) * 2.0
    dy = torch.randn(48, 32)
    grads = []
    for fn in (block, torch.compile(block, fullgraph=True)):
        xg = x.clone().requires_grad_(True)
        block.zero_grad()
        y = fn(xg)
        y.backward(dy)
        grads.append((y.detach(), xg.grad.clone(), block[1].weight.grad.clone()))
    (ye, dxe, dwe), (yc, dxc, dwc) = grads
    assert _sqnr(ye, yc) > 30.0 and _sqnr(dxe, dxc) > 30.0 and _sqnr(dwe, dwc) > 30.0


def test_swap_refuses_names_that_are_no_plain_linear() -> None:
    cd = _load()
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    assert cd.swap_dual(model, ["2", "0"]) == ["0", "2"]
    assert isinstance(model[0], cd.DualCastLinear) and model[0].weight.shape == (32, 32)
    with pytest.raises(ValueError, match=r"no plain nn.Linear named \['1'\]"):
        cd.swap_dual(model, ["1"])


def test_e2e_prepares_the_dualcast_variant_on_the_filter_sites() -> None:
    """e2e.py's ``dualcast_tensorwise_filter``: torchao's tensorwise size filter picks the sites (a
    GPU run trains and times it; on a CPU e2e.py skips it)."""
    from loka_tune.config import ModsConfig, PrecisionConfig
    from loka_tune.tuner.build import make_model, make_source
    from loka_tune.tuner.study import load_study

    e2e = load_bench("e2e.py", "e2e_bench_dualcast")
    assert "dualcast_tensorwise_filter" in e2e.VARIANTS and "dualcast_tensorwise_filter" in e2e._GPU_ONLY
    cfg = load_study(REPO / "studies" / "quickstart.toml")
    source = make_source(cfg)
    model = make_model(cfg, source, seed=0)
    info = e2e.prepare("dualcast_tensorwise_filter", model, PrecisionConfig(mods=ModsConfig(no_bias=True)),
                       source=source, batch_size=16, device=torch.device("cpu"))
    assert info["sites"] == ["top_mlp.1.linear"] and info["fp8_sites"] == 1 and info["mods"] == "nobias"
    swapped = [n for n, m in model.named_modules() if type(m).__name__ == "DualCastLinear"]
    assert swapped == ["top_mlp.1.linear"] and model.get_submodule("top_mlp.1.linear").bias is None


@pytest.mark.gpu
def test_the_dual_cast_layer_compiles_whole_on_a_gpu_and_matches_eager() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cd = _load()
    torch.manual_seed(7)
    block = nn.Sequential(nn.Hardswish(), cd.DualCastLinear.from_linear(nn.Linear(512, 256, bias=False))).cuda()
    x = torch.randn(1024, 512, device="cuda") * torch.logspace(-2, 2, 512, device="cuda")
    dy = torch.randn(1024, 256, device="cuda")
    assert_compiled_matches_eager_and_float64(block, x, dy)
