"""benchmarks/static_scales.py on the CPU (``torch._scaled_mm`` runs e4m3 tensorwise here): a
Linear trained with a calibrated input scale, against float64 references with explicit floors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _bench import assert_compiled_matches_eager_and_float64, load_bench
from _bench import linear_grads64 as _grads64
from torch import nn

from loka_tune.kernels.quant import sqnr_db as _sqnr

REPO = Path(__file__).resolve().parents[1]


def _load():  # noqa: ANN202
    return load_bench('static_scales.py', 'static_scales_bench', register=True)


@pytest.mark.parametrize("m,k,n", [(32, 64, 32), (64, 128, 48), (48, 32, 160)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_statically_scaled_linear_trains_within_fp8_error(m: int, k: int, n: int, bias: bool) -> None:
    ss = _load()
    torch.manual_seed(m + k + n)
    lin = ss.StaticScaleLinear(k, n, bias=bias)
    x = torch.randn(m, k) * 3.0
    ss.calibrate(lin, [(x,)], autocast=None)
    assert lin.calibrated and float(lin.x_scale) == pytest.approx(448.0 / (float(x.abs().amax()) * 2.0), rel=1e-6)
    assert float(lin.x_inv) == pytest.approx(1.0 / float(lin.x_scale), rel=1e-6)
    dy = torch.randn(m, n)
    xg = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(xg)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    y.float().backward(dy)
    y64, dx64, dw64 = _grads64(lin.weight, lin.bias, x, dy)
    # e4m3 carries 3 mantissa bits (~28 dB per operand); two quantized operands per GEMM
    assert _sqnr(y64, y) > 22.0
    assert _sqnr(dx64, xg.grad) > 22.0
    assert _sqnr(dw64, lin.weight.grad) > 22.0
    if bias:
        assert _sqnr(dy.double().sum(0), lin.bias.grad) > 40.0  # the bias add runs in bf16 under autocast


def test_before_calibration_it_is_the_plain_linear_and_records_the_amax() -> None:
    ss = _load()
    torch.manual_seed(0)
    plain = nn.Linear(32, 16)
    lin = ss.StaticScaleLinear.from_linear(plain)
    x = torch.randn(8, 32)
    assert not lin.calibrated and torch.equal(lin(x), plain(x))
    lin(x * 5)
    assert float(lin.seen_amax) == float((x * 5).abs().amax())
    assert lin.weight is plain.weight  # shared, not copied


def test_inputs_past_the_calibration_saturate_and_stay_finite() -> None:
    ss = _load()
    torch.manual_seed(1)
    lin = ss.StaticScaleLinear(64, 32, bias=False, margin=1.0)
    ss.calibrate(lin, [(torch.ones(16, 64),)], autocast=None)  # amax 1: the format's max maps to |x| = 1
    x = torch.randn(32, 64) * 4.0  # most of it past 1: saturates at +-1
    dy = torch.randn(32, 32)
    xg = x.clone().requires_grad_(True)
    y = lin(xg)
    y.backward(dy)
    assert torch.isfinite(y).all() and torch.isfinite(xg.grad).all()
    y64, _, dw64 = _grads64(lin.weight, None, x, dy, clamp=1.0)
    assert _sqnr(y64, y) > 22.0 and _sqnr(dw64, lin.weight.grad) > 22.0  # the clamped input's GEMMs
    y_unclamped = x.double() @ lin.weight.detach().double().t()
    assert _sqnr(y_unclamped, y) < 15.0  # and not the input itself: the saturation is real


def test_adversarial_inputs_huge_range_and_a_constant() -> None:
    ss = _load()
    torch.manual_seed(2)
    lin = ss.StaticScaleLinear(64, 32, bias=False)
    x = torch.randn(32, 64) * torch.logspace(-3, 4, 64)  # columns spanning 7 decades
    ss.calibrate(lin, [(x,)], autocast=None)
    dy = torch.randn(32, 32)
    xg = x.clone().requires_grad_(True)
    y = lin(xg)
    y.backward(dy)
    y64, dx64, dw64 = _grads64(lin.weight, None, x, dy)
    assert torch.isfinite(y).all() and _sqnr(y64, y) > 20.0 and _sqnr(dw64, lin.weight.grad) > 20.0
    assert _sqnr(dx64, xg.grad) > 22.0  # dx does not involve x
    const = ss.StaticScaleLinear(64, 32, bias=False)
    c = torch.full((16, 64), 0.75)
    ss.calibrate(const, [(c,)], autocast=None)
    y = const(c)
    assert _sqnr(c.double() @ const.weight.detach().double().t(), y) > 22.0


def test_swap_and_calibrate_refuse_bad_inputs_in_one_line() -> None:
    ss = _load()
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    assert ss.swap_static(model, ["2", "0"]) == ["0", "2"]
    assert isinstance(model[0], ss.StaticScaleLinear) and isinstance(model[2], ss.StaticScaleLinear)
    with pytest.raises(ValueError, match=r"no nn.Linear named \['9'\]"):
        ss.swap_static(nn.Sequential(nn.Linear(4, 4)), ["9"])
    with pytest.raises(ValueError, match="margin=0.5: a calibration margin is a factor >= 1.0"):
        ss.StaticScaleLinear(16, 16, margin=0.5)
    with pytest.raises(ValueError, match="calibrate needs at least one batch"):
        ss.calibrate(model, [])
    zero = ss.StaticScaleLinear(16, 16)
    with pytest.raises(ValueError, match="finite and not all zero"):
        ss.calibrate(zero, [(torch.zeros(4, 16),)], autocast=None)
    amax = ss.calibrate(model, [(torch.randn(8, 32),)], autocast=None)
    assert set(amax) == {"0", "2"} and all(v > 0 for v in amax.values())
    assert ss.calibrate(model, [(torch.randn(8, 32),)]) == {}  # every layer calibrated: nothing to do


def test_e2e_prepares_the_static_variant_on_the_filter_sites(tmp_path: Path) -> None:
    """e2e.py's ``static_tensorwise_filter``: torchao's tensorwise size filter picks the sites,
    each calibrated on training batches (a GPU run trains and times it: on a CPU e2e.py skips it,
    torch._scaled_mm being a slow reference loop there)."""
    from loka_tune.config import ModsConfig, PrecisionConfig
    from loka_tune.tuner.build import make_model, make_source
    from loka_tune.tuner.study import load_study

    e2e = load_bench('e2e.py', 'e2e_bench_static')
    cfg = load_study(REPO / "studies" / "quickstart.toml")
    source = make_source(cfg)
    model = make_model(cfg, source, seed=0)
    info = e2e.prepare("static_tensorwise_filter", model, PrecisionConfig(mods=ModsConfig(no_bias=True)),
                       source=source, batch_size=16, device=torch.device("cpu"))
    assert info["sites"] == ["top_mlp.1.linear"] and info["fp8_sites"] == 1 and info["mods"] == "nobias"
    layer = model.get_submodule("top_mlp.1.linear")
    assert type(layer).__name__ == "StaticScaleLinear" and layer.calibrated and layer.bias is None
    assert info["calibration_amax"]["top_mlp.1.linear"] > 0 and info["calibration"]["margin"] == 2.0
    others = [n for n, m in model.named_modules() if type(m).__name__ == "StaticScaleLinear"]
    assert others == ["top_mlp.1.linear"]  # every other Linear stays as it was


@pytest.mark.gpu
def test_the_static_layer_compiles_whole_on_a_gpu_and_matches_eager() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ss = _load()
    torch.manual_seed(3)
    block = nn.Sequential(nn.Hardswish(), ss.StaticScaleLinear(512, 256, bias=False)).cuda()
    x = torch.randn(1024, 512, device="cuda") * torch.logspace(-2, 2, 512, device="cuda")  # 4 decades
    ss.calibrate(block, [(x,)])
    dy = torch.randn(1024, 256, device="cuda")
    assert_compiled_matches_eager_and_float64(block, x, dy)
