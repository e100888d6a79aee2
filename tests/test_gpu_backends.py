"""GPU backends against the emulated oracle (run on the H200 through the device tool).

Every test here is marked ``gpu`` and skips without CUDA (tests/conftest.py). Bounds, as the
relative Frobenius error ``||out - emulated|| / ||emulated||`` on the same inputs:

- ``OWN_QUANT_BOUND`` = 1e-2 for backends quantizing with our Triton kernels (bit-identical
  FP8 data and scales to the reference, checked separately): what is left is the bf16
  rounding of the output (~2-4e-3) and the accumulation order / fast accumulation;
- ``LIB_QUANT_BOUND`` = 2e-2 for FBGEMM's and torchao's own quantizers, and for e5m2
  gradients (2-bit mantissa: the output-rounding share is larger; seen 1.01e-2 on the H200) (scales computed as
  ``amax / fmax`` or with an eps floor: single elements may round to the neighbouring FP8
  value, one FP8 ulp = 6-12% of that element).

Both are far below the error of FP8 itself (3-4% vs float64 for Gaussian data, asserted
too), so a wrong scale axis, a missed transpose or a wrong block index fails them.
"""

from __future__ import annotations

import importlib
import itertools
import zlib

import pytest
import torch

from loka_tune.config import GemmChoice, GemmRole
from loka_tune.errors import BackendError, UnsupportedChoiceError
from loka_tune.kernels.emulated import emulated_gemm
from loka_tune.kernels.registry import check_supported, get_backend

pytestmark = pytest.mark.gpu

OWN_QUANT_BOUND = 1e-2
LIB_QUANT_BOUND = 2e-2
ROLES = ("fwd", "dgrad", "wgrad")
# (m, k, n): aligned, K not a multiple of 128, odd M, tiny
SHAPES = [(1024, 512, 256), (2048, 1040, 528), (777, 256, 384), (256, 128, 64)]

CHOICES = {
    "torch_scaled_mm": ["e4m3.tensor.torch_scaled_mm", "e4m3.row.torch_scaled_mm", "e4m3.row.fa.torch_scaled_mm",
                        "e5m2+e4m3.tensor.torch_scaled_mm", "e4m3.tensor.pow2.torch_scaled_mm"],
    "fbgemm": ["e4m3.row.fbgemm", "e4m3.row.fa.fbgemm", "e4m3.tensor.fbgemm", "e4m3.block.fbgemm"],
    "triton": ["e4m3.tensor.triton", "e4m3.row.triton", "e4m3.row.fa.triton", "e4m3.block.triton",
               "e4m3.block.pow2.triton", "e5m2+e4m3.row.triton", "e5m2.tensor.triton"],
    "torchao": ["e4m3.tensor.torchao", "e4m3.row.pow2.torchao", "e4m3.row.torchao"],
}
LIB_QUANT = {"e4m3.row.fbgemm", "e4m3.row.fa.fbgemm", "e4m3.tensor.fbgemm"} | set(CHOICES["torchao"])


def _backend_or_skip(name: str):
    try:
        return get_backend(name)
    except BackendError as e:
        pytest.skip(f"{name}: {e}")


def _operands(m: int, k: int, n: int, role: str, seed: int):
    from loka_tune.kernels.timing import make_operands

    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return make_operands(m, k, n, role, generator=g)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()


CASES = [(be, c, role, shape) for be, cs in CHOICES.items() for c, role, shape in itertools.product(cs, ROLES, SHAPES)]


@pytest.mark.parametrize("backend,choice,role,shape", CASES,
                         ids=[f"{c}-{r}-{'x'.join(map(str, s))}" for _, c, r, s in CASES])
def test_backend_matches_emulated(backend: str, choice: str, role: str, shape: tuple[int, int, int]) -> None:
    be = _backend_or_skip(backend)
    c = GemmChoice.parse(choice)
    m, k, n = shape
    reason = be.supports(c, role, device="cuda", shape=shape)
    if reason is not None:
        with pytest.raises(UnsupportedChoiceError):
            check_supported(c, role, "cuda", shape)
        pytest.skip(f"declared unsupported: {reason}")
    a, b = _operands(m, k, n, role, seed=zlib.crc32(f'{choice}{role}{shape}'.encode()) % 10_000)
    out = be.gemm(a, b, c, GemmRole(role))
    assert out.shape == (m, n) and out.dtype == a.dtype
    assert torch.isfinite(out).all()
    emu = emulated_gemm(a, b, c, role)
    exact = a.double() @ b.double().t()
    err = _rel(out, emu)
    bound = LIB_QUANT_BOUND if (choice in LIB_QUANT or "e5m2" in choice) else OWN_QUANT_BOUND
    assert err < bound, f"{choice} {role} {shape}: rel. error vs emulated {err:.2e} >= {bound:.0e}"
    fp8_err = _rel(emu, exact)
    assert 5e-3 < fp8_err < 0.15, fp8_err  # the comparison is meaningful: FP8 error is much larger
    assert err < 0.5 * fp8_err


@pytest.mark.parametrize("gran,is_weight", [("tensor", False), ("row", False), ("block", False), ("block", True)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rounding", ["exact", "pow2"])
@pytest.mark.parametrize("transposed", [False, True])
def test_triton_quant_is_bit_exact(gran: str, is_weight: bool, fmt: str, rounding: str, transposed: bool) -> None:
    tq = pytest.importorskip("loka_tune.kernels.triton_quant")
    from loka_tune.kernels import quant

    torch.manual_seed(3)
    for rows, red in [(300, 1000), (4096, 256), (129, 8200)]:
        base = torch.randn((red, rows) if transposed else (rows, red), device="cuda") * 5
        base[0, :7] = 0  # a partly zero row
        x = (base.t() if transposed else base).to(torch.bfloat16)
        out = tq.quantize(x, fmt, gran, rounding, is_weight=is_weight)
        ref = quant.quantize(x.contiguous(), fmt, gran, rounding, is_weight=is_weight)
        assert out.data.is_contiguous()
        assert torch.equal(out.data.view(torch.uint8), ref.data.view(torch.uint8)), (rows, red)
        torch.testing.assert_close(out.inv_scale.reshape(ref.scale.shape), ref.inv_scale(), rtol=1e-6, atol=0)


def test_zero_operand_gives_zero_not_nan() -> None:
    be = _backend_or_skip("triton")
    a = torch.zeros(256, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    for c in ["e4m3.tensor.triton", "e4m3.row.triton", "e4m3.block.triton"]:
        out = be.gemm(a, b, GemmChoice.parse(c), GemmRole.FWD)
        assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("backend", list(CHOICES))
def test_backend_under_cuda_graph_and_compile(backend: str) -> None:
    be = _backend_or_skip(backend)
    c = GemmChoice.parse(CHOICES[backend][1 if backend != "torchao" else 0])
    a, b = _operands(2048, 1024, 512, "wgrad", seed=1)
    eager = be.gemm(a, b, c, GemmRole.WGRAD)
    # CUDA graph: capture, replay on new data copied into the captured inputs
    sa, sb = a.clone(), b.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        be.gemm(sa, sb, c, GemmRole.WGRAD)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = be.gemm(sa, sb, c, GemmRole.WGRAD)
    a2, b2 = _operands(2048, 1024, 512, "wgrad", seed=2)
    sa.copy_(a2)
    sb.copy_(b2)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(g_out, be.gemm(a2, b2, c, GemmRole.WGRAD), rtol=0, atol=0)
    if backend not in ("triton", "torch_scaled_mm"):
        return  # compile time is the same story for every backend: two suffice on a short lease
    # torch.compile: one opaque custom op, same numbers as eager
    from loka_tune.kernels.backends import _ensure_op

    _ensure_op()
    cid = c.short_str()
    fn = torch.compile(lambda x, y: torch.ops.loka_tune.fp8_gemm(x, y, backend, cid, "wgrad") * 2.0, fullgraph=True)
    torch.testing.assert_close(fn(a, b), eager * 2.0, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("backend", list(CHOICES))
def test_backend_inside_lokalinear(backend: str) -> None:
    linear = pytest.importorskip("loka_tune.kernels.linear")
    _backend_or_skip(backend)
    from loka_tune.config import SitePrecision

    choice = CHOICES[backend][1 if backend != "torchao" else 0]
    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 256, bias=True).cuda()
    ll = linear.LokaLinear.from_linear(lin, SitePrecision.uniform(choice))
    emu = linear.LokaLinear.from_linear(lin, SitePrecision.uniform(GemmChoice.parse(choice).with_backend("emulated")))
    x = torch.randn(4, 1024, 512, device="cuda")
    outs, grads = [], []
    for mod in (ll, emu):
        xi = x.clone().requires_grad_(True)
        mod.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = mod(xi)
        (y.float().square().mean()).backward()
        outs.append(y.float())
        grads.append((xi.grad.float().clone(), mod.weight.grad.float().clone()))
    bound = LIB_QUANT_BOUND if choice in LIB_QUANT else OWN_QUANT_BOUND
    assert _rel(outs[0], outs[1]) < bound
    assert _rel(grads[0][0], grads[1][0]) < 2 * bound  # dgrad
    assert _rel(grads[0][1], grads[1][1]) < 2 * bound  # wgrad


def test_timing_harness_measures_and_caches(tmp_path) -> None:
    from loka_tune.kernels.timing import TimingCache, time_gemm

    cache = TimingCache(tmp_path / "t.json")
    t_bf16 = time_gemm("bf16", 4096, 1024, 1024, "fwd", cache=cache)
    t_fp8 = time_gemm("e4m3.row.triton", 4096, 1024, 1024, "wgrad", cache=cache)
    assert 1e-6 < t_bf16 < 1e-2 and 1e-6 < t_fp8 < 1e-2
    again = TimingCache(tmp_path / "t.json")
    assert again.get("bf16", 4096, 1024, 1024, "fwd") == t_bf16
    assert len(again) == 2


def test_unknown_backend_module_is_a_clear_error() -> None:
    importlib.import_module("loka_tune.kernels.backends")
    with pytest.raises(BackendError, match="known backends"):
        get_backend("nosuch")
