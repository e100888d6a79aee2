"""LokaLinear's direct call paths: traceable FP8 GEMMs that torch.compile sees whole.

``torch._scaled_mm`` runs on the CPU in the torch builds we support, so the traceable path
(:mod:`loka_tune.kernels.scaled`) is tested here for real: bit-exact quantization against the
reference, the GEMM against float64, and LokaLinear compiled with ``fullgraph=True``
(inductor) through a CPU test backend built exactly like the GPU ones. The GPU backends get
the same checks on the device (``tests/test_gpu_backends.py``).
"""

from __future__ import annotations

import copy
import pickle
from typing import Iterator

import pytest
import torch

from loka_tune.config import Format, GemmChoice, GemmRole, Granularity, ScaleRounding
from loka_tune.kernels import ops
from loka_tune.kernels.backends import GPUBackend
from loka_tune.kernels.linear import LokaLinear
from loka_tune.kernels.quant import compute_scale, quantize, sqnr_db
from loka_tune.kernels.registry import SHAPE_FALLBACKS, Shape, register_backend, unregister_backend
from loka_tune.kernels.scaled import cast_to_fp8, scale_from_amax, scaled_mm_gemm

FMTS = [Format.E4M3, Format.E5M2]
GRANS = [Granularity.TENSOR, Granularity.ROW]


@pytest.fixture
def cpu_scaled() -> Iterator[type[GPUBackend]]:
    """A CPU backend built like the GPU ones: traceable ``scaled_mm_gemm``, and a declared
    launch limit (m > 100 rows) checked at the real shape of each call."""

    @register_backend("cpu_scaled")
    class CPUScaled(GPUBackend):
        devices = frozenset({"cpu"})
        formats = frozenset({Format.E4M3, Format.E5M2})
        granularities = frozenset({Granularity.TENSOR, Granularity.ROW})
        fast_accum_modes = (False, True)
        alignment = 16
        traceable = True
        runtime_shape_check = True
        calls = 0

        def extra_reason(self, choice: GemmChoice, role: GemmRole, shape: Shape | None) -> str | None:
            if shape is not None and shape[0] is not None and shape[0] > 100:
                return f"m={shape[0]} > 100 rows"
            return None

        def gemm_impl(self, a: torch.Tensor, b: torch.Tensor, choice: GemmChoice, role: GemmRole) -> torch.Tensor:
            if not torch.compiler.is_compiling():  # no side effects inside a compiled autograd.Function
                type(self).calls += 1
            return scaled_mm_gemm(a, b, choice)

    SHAPE_FALLBACKS.clear()
    yield CPUScaled
    unregister_backend("cpu_scaled")
    SHAPE_FALLBACKS.clear()


# ------------------------------------------------------------------ quantization semantics
@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.value)
@pytest.mark.parametrize("rounding", list(ScaleRounding), ids=lambda r: r.value)
def test_scales_match_the_reference_bit_for_bit(fmt: Format, rounding: ScaleRounding) -> None:
    g = torch.Generator().manual_seed(0)
    mags = 10.0 ** torch.randint(-38, 38, (4000,), generator=g).float()
    amax = torch.cat([torch.rand(4000, generator=g) * mags,
                      torch.tensor([0.0, float("inf"), float("nan"), 3.4e38, 1e-45, 448.0, 447.99, 1.0, 57344.0])])
    ref = compute_scale(amax, fmt, rounding)
    got = scale_from_amax(amax, fmt, rounding == ScaleRounding.POW2)
    assert bool(((ref == got) | (ref.isnan() & got.isnan())).all())


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.value)
@pytest.mark.parametrize("gran", GRANS, ids=lambda g: g.value)
@pytest.mark.parametrize("rounding", list(ScaleRounding), ids=lambda r: r.value)
@pytest.mark.parametrize("layout", ["rowmajor", "transposed"])
def test_cast_matches_the_reference_quantizer(fmt: Format, gran: Granularity, rounding: ScaleRounding,
                                              layout: str) -> None:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(130, 77, generator=g) * 3).to(torch.bfloat16)
    x[5] = 0  # an all-zero row: scale 1, exact zeros
    x[7, 3] = 1e4  # an outlier row
    if layout == "transposed":
        x = x.t().contiguous().t()  # same values, reduction dim strided (wgrad's operands)
    data, inv = cast_to_fp8(x, fmt, gran, rounding)
    ref = quantize(x, fmt, gran, rounding)
    assert data.stride(-1) == 1 and data.dtype == ref.data.dtype
    assert torch.equal(data.view(torch.uint8), ref.data.contiguous().view(torch.uint8))
    assert torch.equal(inv.reshape(-1), ref.inv_scale().reshape(-1))
    assert inv.shape == (() if gran == Granularity.TENSOR else (130, 1))


@pytest.mark.parametrize("gran", GRANS, ids=lambda g: g.value)
def test_cast_compiled_equals_eager(gran: Granularity) -> None:
    x = (torch.randn(96, 160) * 5).to(torch.bfloat16)
    fn = lambda t: cast_to_fp8(t, Format.E4M3, gran, ScaleRounding.EXACT)  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True)
    for t in (x, x.t()):
        (d1, s1), (d2, s2) = fn(t), compiled(t)
        assert torch.equal(d1.view(torch.uint8), d2.view(torch.uint8)) and torch.equal(s1, s2)
        assert d2.stride(-1) == 1  # K-contiguous for the tensor cores, transposed views too


@pytest.mark.parametrize("choice", ["e4m3.row.x", "e4m3.tensor.x", "e4m3.row.pow2.fa.x", "e4m3.tensor.fa.x"])
def test_scaled_mm_gemm_vs_float64(choice: str) -> None:
    g = torch.Generator().manual_seed(2)
    a = torch.randn(70, 96, generator=g, dtype=torch.float64)
    b = torch.randn(48, 96, generator=g, dtype=torch.float64) / 96**0.5
    ref = a @ b.t()
    for aa, bb in ((a, b), (a.t().contiguous().t(), b.t().contiguous().t())):
        out = scaled_mm_gemm(aa.to(torch.bfloat16), bb.to(torch.bfloat16), GemmChoice.parse(choice))
        assert out.dtype == torch.bfloat16 and out.shape == (70, 48)
        assert sqnr_db(ref, out) >= 24.0, f"{sqnr_db(ref, out):.1f} dB is too low"


# ------------------------------------------------------------------ LokaLinear's call paths
def _step(fn: torch.nn.Module, lin: LokaLinear, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    xg = x.clone().requires_grad_()
    lin.weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fn(xg)
    y.backward(dy.to(y.dtype))
    return y.detach().double(), xg.grad.double(), lin.weight.grad.double()


def test_direct_path_is_resolved_once_and_skips_the_custom_op(cpu_scaled, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    lin = LokaLinear(64, 48, precision="e4m3.row.cpu_scaled")
    assert all(f is not None for f in lin._fns)
    import loka_tune.kernels.linear as linear_mod

    def no_lookup(name: str) -> None:
        raise AssertionError("a registry look-up per call")

    monkeypatch.setattr(linear_mod, "get_backend", no_lookup)
    monkeypatch.setattr(torch.ops.loka, "gemm", None)  # the custom op is never called
    cpu_scaled.calls = 0
    _step(lin, lin, torch.randn(20, 64), torch.randn(20, 48))
    assert cpu_scaled.calls == 3  # fwd, dgrad, wgrad each through the backend's own code


def test_forced_nonfinite_check_routes_through_the_custom_op(cpu_scaled) -> None:  # type: ignore[no-untyped-def]
    lin = LokaLinear(64, 48, precision="e4m3.row.cpu_scaled")
    x = torch.randn(20, 64)
    x[3, 5] = float("inf")
    prev = ops.set_nonfinite_check(True)
    try:
        lin.reset_nonfinite_fallbacks()
        with torch.no_grad():
            lin(x)
        assert lin.nonfinite_fallbacks == 1
    finally:
        ops.set_nonfinite_check(prev)


def test_compiled_lokalinear_is_one_graph_and_accurate(cpu_scaled) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 30, 64, generator=g)  # a 3-D input: 90 rows
    dy = torch.randn(3, 30, 48, generator=g)
    lin = LokaLinear(64, 48, precision="e4m3.row.cpu_scaled|e4m3.tensor.cpu_scaled|e4m3.row.pow2.cpu_scaled")
    ref_lin = torch.nn.Linear(64, 48).double()
    with torch.no_grad():
        ref_lin.weight.copy_(lin.weight)
        ref_lin.bias.copy_(lin.bias)
    xr = x.double().requires_grad_()
    yr = ref_lin(xr)
    yr.backward(dy.double())
    ref = (yr.detach(), xr.grad, ref_lin.weight.grad)

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(lin, fullgraph=True)  # raises on any graph break
    eager = _step(lin, lin, x, dy)
    comp = _step(compiled, lin, x, dy)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    for name, r, e, c in zip(("y", "dx", "dw"), ref, eager, comp):
        assert sqnr_db(r, c) >= 24.0, f"{name}: compiled {sqnr_db(r, c):.1f} dB"
        # eager and compiled differ only by inductor keeping fp32 where eager rounds to bf16
        assert sqnr_db(e, c) >= 30.0, f"{name}: compiled vs eager {sqnr_db(e, c):.1f} dB"


def test_unsupported_real_shape_runs_bf16_eager_and_compiled(cpu_scaled) -> None:  # type: ignore[no-untyped-def]
    lin = LokaLinear(64, 48, bias=False, precision="e4m3.row.cpu_scaled")
    plain = torch.nn.Linear(64, 48, bias=False)
    plain.weight = lin.weight
    x, dy = torch.randn(200, 64), torch.randn(200, 48)  # m = 200 > 100: fwd and dgrad refused, wgrad (m = 48) runs
    torch._dynamo.reset()
    for fn in (lin, torch.compile(lin, fullgraph=True)):
        SHAPE_FALLBACKS.clear()
        y, dx, dw = _step(fn, lin, x, dy)
        yb, dxb, dwb = _step(plain, plain, x, dy)  # type: ignore[arg-type]
        assert torch.equal(y, yb) and torch.equal(dx, dxb)  # bf16 where refused
        assert not torch.equal(dw, dwb) and sqnr_db(dwb, dw) > 20  # FP8 where it fits
        assert set(SHAPE_FALLBACKS) == {
            ("cpu_scaled", "e4m3.row.cpu_scaled", "fwd", 200, 64, 48),
            ("cpu_scaled", "e4m3.row.cpu_scaled", "dgrad", 200, 48, 64),
        }
        assert all("m=200 > 100 rows" == r for r in SHAPE_FALLBACKS.values())


def test_copies_and_pickles_resolve_again(cpu_scaled) -> None:  # type: ignore[no-untyped-def]
    lin = LokaLinear(64, 48, precision="e4m3.row.cpu_scaled")
    for other in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
        assert all(f is not None for f in other._fns) and other._tag != lin._tag
        x = torch.randn(8, 64)
        with torch.no_grad():
            assert torch.equal(other(x), lin(x))


def test_unimportable_backend_still_fails_at_the_first_call_with_the_install_hint() -> None:
    lin = LokaLinear(32, 32, precision="e4m3.row.no_such_backend")
    assert lin._fns == (None, None, None)
    with pytest.raises(Exception, match="no_such_backend"):
        lin(torch.randn(4, 32))
