"""benchmarks/delayed_scales.py on the CPU (``torch._scaled_mm`` runs e4m3 tensorwise here): a
Linear trained with delayed input and gradient scales, against float64 references with explicit
floors, its amax buffers stepping one call behind, eager and compiled."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _bench import assert_compiled_matches_eager_and_float64, load_bench, run_under_triton_interpreter
from _bench import linear_grads64 as _grads64
from torch import nn

from loka_tune.kernels.quant import sqnr_db as _sqnr

REPO = Path(__file__).resolve().parents[1]
FMAX = 448.0


def _load():  # noqa: ANN202
    return load_bench('delayed_scales.py', 'delayed_scales_bench', register=True)


def _dy_loss(dy: torch.Tensor):  # noqa: ANN202
    """A loss whose gradient at the layer's output is ``dy``."""
    return lambda out, i: (out.float() * dy).sum()


@pytest.mark.parametrize("m,k,n", [(32, 64, 32), (64, 128, 48), (48, 32, 160)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_delayed_scale_linear_trains_within_fp8_error(m: int, k: int, n: int, bias: bool) -> None:
    ds = _load()
    torch.manual_seed(m + k + n)
    lin = ds.DelayedScaleLinear(k, n, bias=bias)
    x = torch.randn(m, k) * 3.0
    dy = torch.randn(m, n)
    seen = ds.calibrate(lin, [(x,)], _dy_loss(dy), autocast=None)
    assert lin.calibrated and lin.weight.grad is None  # calibration leaves no gradient behind
    assert seen[""] == (pytest.approx(float(x.abs().amax())), pytest.approx(float(dy.abs().amax())))
    xg = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(xg)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    y.float().backward(dy)
    y64, dx64, dw64 = _grads64(lin.weight, lin.bias, x, dy)
    # e4m3 carries 3 mantissa bits (~28 dB per operand), the margin of 2 costs one binade of range
    assert _sqnr(y64, y) > 22.0
    assert _sqnr(dx64, xg.grad) > 22.0
    assert _sqnr(dw64, lin.weight.grad) > 22.0
    if bias:
        assert _sqnr(dy.double().sum(0), lin.bias.grad) > 40.0


def test_each_call_casts_with_the_last_calls_amax_and_leaves_its_own() -> None:
    """The scale is one call behind: a call whose input is 4x the last one's saturates at the
    last amax times the margin (2), and its own amax is what the next call takes."""
    ds = _load()
    torch.manual_seed(1)
    lin = ds.DelayedScaleLinear(64, 32, bias=False)
    base = torch.rand(16, 64) * 2 - 1
    base[0, 0] = 1.0  # amax exactly 1
    dy0 = torch.randn(16, 32)
    ds.calibrate(lin, [(base,)], _dy_loss(dy0), autocast=None)
    assert float(lin.x_amax) == 1.0 and float(lin.g_amax) == float(dy0.abs().amax())
    x = torch.randn(32, 64) * 4.0  # past 2 (= margin x last amax) for many entries: saturates there
    dy = torch.randn(32, 32) * 10.0  # the gradient grew 10x: saturates at 2 x its last amax
    xg = x.clone().requires_grad_(True)
    y = lin(xg)
    y.backward(dy)
    assert float(lin.x_amax) == pytest.approx(float(x.abs().amax()))  # left for the next call
    assert float(lin.g_amax) == pytest.approx(float(dy.abs().amax()))
    assert torch.isfinite(y).all() and torch.isfinite(xg.grad).all() and torch.isfinite(lin.weight.grad).all()
    y64, _, _ = _grads64(lin.weight, None, x, dy, clamp=2.0)
    assert _sqnr(y64, y) > 22.0  # the clamped input's GEMM
    assert _sqnr(x.double() @ lin.weight.detach().double().t(), y) < 15.0  # the saturation is real
    g_clip = 2.0 * float(dy0.abs().amax())
    dx64 = dy.double().clamp(-g_clip, g_clip) @ lin.weight.detach().double()
    assert _sqnr(dx64, xg.grad) > 22.0
    # the next call, with the new amaxes, is back within FP8's error of the unclamped references
    lin.weight.grad = None
    xg2 = x.clone().requires_grad_(True)
    y2 = lin(xg2)
    y2.backward(dy)
    y64, dx64, dw64 = _grads64(lin.weight, None, x, dy)
    assert _sqnr(y64, y2) > 22.0 and _sqnr(dx64, xg2.grad) > 22.0 and _sqnr(dw64, lin.weight.grad) > 22.0


def test_adversarial_inputs_huge_range_and_a_constant() -> None:
    ds = _load()
    torch.manual_seed(2)
    lin = ds.DelayedScaleLinear(64, 32, bias=False)
    x = torch.randn(32, 64) * torch.logspace(-3, 4, 64)  # columns spanning 7 decades
    dy = torch.randn(32, 32) * torch.logspace(-4, 2, 32)
    ds.calibrate(lin, [(x,)], _dy_loss(dy), autocast=None)
    xg = x.clone().requires_grad_(True)
    y = lin(xg)
    y.backward(dy)
    y64, dx64, dw64 = _grads64(lin.weight, None, x, dy)
    assert torch.isfinite(y).all() and _sqnr(y64, y) > 20.0 and _sqnr(dw64, lin.weight.grad) > 20.0
    assert _sqnr(dx64, xg.grad) > 20.0
    const = ds.DelayedScaleLinear(64, 32, bias=False)
    c = torch.full((16, 64), 0.75)
    dc = torch.full((16, 32), -0.5)
    ds.calibrate(const, [(c,)], _dy_loss(dc), autocast=None)
    cg = c.clone().requires_grad_(True)
    y = const(cg)
    y.backward(dc)
    y64, dx64, dw64 = _grads64(const.weight, None, c, dc)
    assert _sqnr(y64, y) > 22.0 and _sqnr(dx64, cg.grad) > 22.0 and _sqnr(dw64, const.weight.grad) > 22.0


def test_compiled_whole_it_matches_eager_and_updates_its_buffers_in_the_graph() -> None:
    """One graph (``fullgraph=True``): the amax buffers are written in the compiled forward and
    backward, one call behind, as eagerly."""
    ds = _load()
    torch.manual_seed(3)
    block = nn.Sequential(nn.Hardswish(), ds.DelayedScaleLinear(128, 64, bias=False))
    x = torch.randn(96, 128) * torch.logspace(-2, 2, 128)
    dy = torch.randn(96, 64)
    ds.calibrate(block, [(x,)], _dy_loss(dy))
    assert_compiled_matches_eager_and_float64(block, x, dy)
    lin = block[1]
    compiled = torch.compile(block, fullgraph=True)
    x2, dy2 = x * 3.0, dy * 5.0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = compiled(x2.requires_grad_(True))
    assert float(lin.x_amax) == pytest.approx(float(nn.functional.hardswish(x2.detach()).abs().amax()), rel=1e-2)
    y.float().backward(dy2)
    assert float(lin.g_amax) == pytest.approx(float(dy2.abs().amax()), rel=1e-2)  # bf16 dy


def test_swap_and_calibrate_refuse_bad_inputs_in_one_line() -> None:
    ds = _load()
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    assert ds.swap_delayed(model, ["2", "0"]) == ["0", "2"]
    assert isinstance(model[0], ds.DelayedScaleLinear) and isinstance(model[2], ds.DelayedScaleLinear)
    assert model[0].x_amax.device.type == "cpu" and not model[0].calibrated
    with pytest.raises(ValueError, match=r"no plain nn.Linear named \['9'\]"):
        ds.swap_delayed(nn.Sequential(nn.Linear(4, 4)), ["9"])
    with pytest.raises(ValueError, match="margin=0.5: a delayed scale's margin is a factor >= 1.0"):
        ds.DelayedScaleLinear(16, 16, margin=0.5)
    with pytest.raises(ValueError, match="calibrate needs at least one batch"):
        ds.calibrate(model, [], _dy_loss(torch.ones(1)))
    zero = ds.DelayedScaleLinear(16, 16)
    with pytest.raises(ValueError, match="finite and not all zero"):
        ds.calibrate(zero, [(torch.zeros(4, 16),)], lambda out, i: out.sum(), autocast=None)
    assert not zero.own_scales  # reset even when calibration fails
    seen = ds.calibrate(model, [(torch.randn(8, 32),)], lambda out, i: out.square().sum(), autocast=None)
    assert set(seen) == {"0", "2"} and all(a > 0 and g > 0 for a, g in seen.values())
    assert ds.calibrate(nn.Sequential(nn.Linear(4, 4)), [(torch.randn(2, 4),)], lambda out, i: out.sum()) == {}


@pytest.mark.parametrize("variant", ["delayed_tensorwise_filter", "delayed_dualcast_tensorwise_filter"])
def test_e2e_prepares_the_delayed_variant_on_the_filter_sites(variant: str) -> None:
    """e2e.py's ``delayed_tensorwise_filter``: torchao's tensorwise size filter picks the sites,
    each calibrated by a forward and backward of a training batch (a GPU run trains and times it:
    on a CPU e2e.py skips it, torch._scaled_mm being a slow reference loop there)."""
    from loka_tune.config import ModsConfig, PrecisionConfig
    from loka_tune.tuner.build import make_model, make_source
    from loka_tune.tuner.study import load_study

    e2e = load_bench('e2e.py', 'e2e_bench_delayed')
    cfg = load_study(REPO / "studies" / "quickstart.toml")
    source = make_source(cfg)
    model = make_model(cfg, source, seed=0)
    info = e2e.prepare(variant, model, PrecisionConfig(mods=ModsConfig(no_bias=True)),
                       source=source, batch_size=16, device=torch.device("cpu"))
    dual = variant.startswith("delayed_dual")
    assert info["dual"] is dual
    assert info["sites"] == ["top_mlp.1.linear"] and info["fp8_sites"] == 1 and info["mods"] == "nobias"
    layer = model.get_submodule("top_mlp.1.linear")
    assert type(layer).__name__ == "DelayedScaleLinear" and layer.calibrated and layer.bias is None
    assert layer.dual is dual and (float(layer.w_amax) > 0) is dual
    xa, ga = info["calibration_amax"]["top_mlp.1.linear"]
    assert xa > 0 and ga > 0 and info["calibration"]["margin"] == 2.0
    assert all(p.grad is None for p in model.parameters())  # calibration moved and kept nothing
    others = [n for n, m in model.named_modules() if type(m).__name__ == "DelayedScaleLinear"]
    assert others == ["top_mlp.1.linear"]


@pytest.mark.gpu
def test_the_delayed_layer_compiles_whole_on_a_gpu_and_matches_eager() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ds = _load()
    torch.manual_seed(3)
    block = nn.Sequential(nn.Hardswish(), ds.DelayedScaleLinear(512, 256, bias=False)).cuda()
    x = torch.randn(1024, 512, device="cuda") * torch.logspace(-2, 2, 512, device="cuda")  # 4 decades
    dy = torch.randn(1024, 256, device="cuda")
    ds.calibrate(block, [(x,)], _dy_loss(dy))
    assert_compiled_matches_eager_and_float64(block, x, dy)
    assert block[1].calibrated and float(block[1].g_amax) == pytest.approx(float(dy.abs().amax()), rel=1e-2)


# ------------------------------------------------------------------ dual: every operand in one kernel
def test_the_dual_amax_reference_is_the_products_dual_cast_plus_the_amax() -> None:
    ds = _load()
    from loka_tune.config import Format
    from loka_tune.kernels.dualcast import cast_dual_reference

    torch.manual_seed(4)
    x = torch.randn(37, 50) * torch.logspace(-6, 6, 50)  # 12 decades: saturation and underflow both
    s = torch.tensor(0.5)
    for via in (None, torch.bfloat16):
        y, yt, amax = ds.cast_dual_amax_reference(x, s, via)
        ry, ryt = cast_dual_reference(x, s, Format.E4M3, via)
        assert torch.equal(y.view(torch.uint8), ry.view(torch.uint8)) and torch.equal(yt.view(torch.uint8), ryt.view(torch.uint8))
        xv = x if via is None else x.to(via).float()
        assert amax.shape == (1,) and float(amax) == float(xv.abs().amax())
    zero = ds.cast_dual_amax(torch.zeros(4, 8), s)
    assert float(zero[2]) == 0.0 and zero[1].shape == (8, 4)
    with pytest.raises(ValueError, match="takes a 2-D operand"):
        ds.cast_dual_amax(torch.zeros(2, 3, 4), s)
    with pytest.raises(ValueError, match="rounds through bfloat16 or nothing"):
        ds.cast_dual_amax(torch.zeros(2, 3), s, via=torch.float16)


@pytest.mark.parametrize("bias", [False, True])
def test_a_dual_delayed_linear_trains_within_fp8_error_with_its_weight_scale_one_call_behind(bias: bool) -> None:
    ds = _load()
    torch.manual_seed(5)
    lin = ds.DelayedScaleLinear(96, 64, bias=bias, dual=True)
    assert not lin.calibrated and "dual=True" in repr(lin)
    x = torch.randn(48, 96) * 2.0
    dy = torch.randn(48, 64)
    ds.calibrate(lin, [(x,)], _dy_loss(dy), autocast=None)
    w0 = float(lin.weight.detach().abs().amax())
    assert lin.calibrated and float(lin.w_amax) == w0
    xg = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(xg)
    y.float().backward(dy)
    y64, dx64, dw64 = _grads64(lin.weight, lin.bias, x, dy)
    assert _sqnr(y64, y) > 22.0 and _sqnr(dx64, xg.grad) > 22.0 and _sqnr(dw64, lin.weight.grad) > 22.0
    assert lin.weight.grad.dtype == torch.float32  # the master weight's own gradient
    # the weight grew 8x: this call saturates it at 2x (margin) its last amax, and leaves the new amax
    with torch.no_grad():
        lin.weight.mul_(8.0)
    lin.weight.grad = None
    xg = x.clone().requires_grad_(True)
    y = lin(xg)
    y.backward(dy)
    assert float(lin.w_amax) == pytest.approx(8.0 * w0)
    w_clipped = lin.weight.detach().double().clamp(-2 * w0, 2 * w0)
    assert _sqnr(x.double() @ w_clipped.t(), y) > 22.0
    assert _sqnr(x.double() @ lin.weight.detach().double().t(), y) < 15.0  # the saturation is real
    y2 = lin(x)  # and the next call is back within FP8's error of the unclipped weight
    assert _sqnr(x.double() @ lin.weight.detach().double().t(), y2) > 22.0


def test_the_dual_layer_compiled_whole_matches_eager() -> None:
    ds = _load()
    torch.manual_seed(6)
    block = nn.Sequential(nn.Hardswish(), ds.DelayedScaleLinear(128, 64, bias=False, dual=True))
    x = torch.randn(96, 128) * torch.logspace(-2, 2, 128)
    dy = torch.randn(96, 64)
    ds.calibrate(block, [(x,)], _dy_loss(dy))
    assert_compiled_matches_eager_and_float64(block, x, dy)
    # the compiled reference path: inductor computes in fp32 without rounding the weight to bf16 first
    # (no emulated precision casts), so the amax is the fp32 weight's to within bf16's rounding
    assert float(block[1].w_amax) == pytest.approx(float(block[1].weight.detach().abs().amax()), rel=2**-8)


def test_swap_dual_and_a_zero_weight_refused_in_one_line() -> None:
    ds = _load()
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    assert ds.swap_delayed(model, ["0"], dual=True) == ["0"]
    assert model[0].dual and type(model[2]) is nn.Linear
    with torch.no_grad():
        model[0].weight.zero_()
    with pytest.raises(ValueError, match="0: its weight's amax is 0.0; a delayed weight scale needs a finite, nonzero weight"):
        ds.calibrate(model, [(torch.randn(8, 32),)], lambda out, i: out.square().sum(), autocast=None)


def test_the_kernel_under_the_triton_interpreter() -> None:
    """Where triton is installed (not in CI), the kernel runs on the CPU under TRITON_INTERPRET=1 and
    writes the bytes of the product's dual-cast kernel (the interpreter's own FP8 rounding on both,
    which differs from torch's) and the reference's amax: any strides, ragged tiles, the fp32
    weight through bf16. On a GPU the next test holds it to the torch reference bit for bit."""
    code = (
        "import sys, torch\n"
        f"sys.path.insert(0, {str(REPO / 'benchmarks')!r})\n"
        "import delayed_scales as ds\n"
        "from loka_tune.config import Format\n"
        "from loka_tune.kernels.triton_quant import dual_cast\n"
        "torch.manual_seed(0)\n"
        "x = (torch.randn(300, 130) * torch.logspace(-5, 5, 130))\n"
        "s = torch.tensor(0.37)\n"
        "for xx, via in ((x.to(torch.bfloat16), None), (x.to(torch.bfloat16).t().contiguous().t(), None), (x, torch.bfloat16)):\n"
        "    y, yt, a = ds.cast_dual_amax(xx, s, via)\n"
        "    _, _, ra = ds.cast_dual_amax_reference(xx, s, via)\n"
        "    py, pyt = dual_cast(xx, s, Format.E4M3, torch.float32 if via is None else via)\n"
        "    assert torch.equal(y.view(torch.uint8), py.view(torch.uint8))\n"
        "    assert torch.equal(yt.view(torch.uint8), pyt.view(torch.uint8))\n"
        "    assert torch.equal(a, ra), (a, ra)\n"
        "print('ok')\n"
    )
    run_under_triton_interpreter(code)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 129), (300, 130), (4100, 64), (8192, 2048)])
def test_the_dual_amax_kernel_is_the_reference_bit_for_bit_on_a_gpu(shape: tuple[int, int]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ds = _load()
    torch.manual_seed(7)
    r, c = shape
    base = torch.randn(r, c, device="cuda") * torch.logspace(-8, 8, c, device="cuda")  # 16 decades
    const = torch.full((r, c), -3.25, device="cuda")
    s = torch.tensor(1e-3, device="cuda")
    for xx, via in ((base.to(torch.bfloat16), None), (base.to(torch.bfloat16).t().contiguous().t(), None),
                    (base, torch.bfloat16), (const, None)):
        for out in (torch.float8_e4m3fn, torch.float8_e5m2):  # e5m2: an FP8 chain's gradients (grad_format)
            y, yt, a = ds.cast_dual_amax(xx, s, via, out=out)
            ry, ryt, ra = ds.cast_dual_amax_reference(xx, s, via, out=out)
            assert y.dtype == out and torch.equal(y.view(torch.uint8), ry.view(torch.uint8))
            assert torch.equal(yt.view(torch.uint8), ryt.view(torch.uint8))
            assert torch.equal(a, ra)


@pytest.mark.gpu
def test_the_dual_layer_compiles_whole_on_a_gpu_and_matches_eager() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ds = _load()
    torch.manual_seed(8)
    block = nn.Sequential(nn.Hardswish(), ds.DelayedScaleLinear(512, 256, bias=False, dual=True)).cuda()
    x = torch.randn(1024, 512, device="cuda") * torch.logspace(-2, 2, 512, device="cuda")
    dy = torch.randn(1024, 256, device="cuda")
    ds.calibrate(block, [(x,)], _dy_loss(dy))
    assert_compiled_matches_eager_and_float64(block, x, dy)
    assert block[1].calibrated and float(block[1].g_amax) == pytest.approx(float(dy.abs().amax()), rel=1e-2)
