"""Quantize once, use twice (issue 11): tensorwise operands of a LokaLinear shared between its
GEMMs give bit for bit the GEMMs that quantize each operand themselves, and under
torch.compile the shared path is the one taken."""

from __future__ import annotations

import pytest
import torch

from loka_tune.config import GemmChoice, SitePrecision
from loka_tune.kernels import linear as L
from loka_tune.kernels.linear import LokaLinear
from loka_tune.kernels.scaled import SharePlan, scaled_mm_gemm, share_plan

T = "e4m3.tensor.torch_scaled_mm"


def _plan(fwd: str, dgrad: str, wgrad: str) -> SharePlan:
    return share_plan(*(GemmChoice.parse(c) for c in (fwd, dgrad, wgrad)))


@pytest.mark.parametrize("site, want", [
    ((T, T, T), SharePlan(x=True, w=True, dy=True)),
    (("e4m3.tensor.pow2.torch_scaled_mm",) * 3, SharePlan(x=True, w=True, dy=True)),
    (("e4m3.row.torch_scaled_mm",) * 3, SharePlan()),  # rowwise scales run along different axes
    (("e4m3.tensor.torchao",) * 3, SharePlan()),  # only our own torch._scaled_mm path shares
    ((T, "e5m2+e4m3.tensor.torch_scaled_mm", "e5m2+e4m3.tensor.torch_scaled_mm"), SharePlan(x=True, w=True, dy=True)),
    ((T, "e5m2+e4m3.tensor.torch_scaled_mm", T), SharePlan(x=True, w=True, dy=False)),  # dY: e5m2 vs e4m3
    ((T, T, "bf16"), SharePlan(x=False, w=True, dy=False)),
    ((T, "bf16", T), SharePlan(x=True, w=False, dy=False)),
    (("bf16", T, T), SharePlan(x=False, w=False, dy=True)),
    ((T, "e4m3.tensor.pow2.torch_scaled_mm", T), SharePlan(x=True, w=False, dy=False)),  # W: two roundings
    ((T, "e4m3.tensor.fa.torch_scaled_mm", T), SharePlan(x=True, w=True, dy=True)),  # fast_accum: the GEMM only
])
def test_share_plan(site: tuple[str, str, str], want: SharePlan) -> None:
    assert _plan(*site) == want


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dy: torch.Tensor, site: SitePrecision,
               dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Each GEMM quantizing its own operands (scaled_mm_gemm), as without sharing."""
    xc, wc, dyc = x.to(dtype), w.to(dtype), dy.to(dtype)

    def gemm(a: torch.Tensor, bb: torch.Tensor, c: GemmChoice) -> torch.Tensor:
        return a @ bb.t() if c.is_bf16 else scaled_mm_gemm(a, bb, c)

    y = gemm(xc, wc, site.fwd)
    if b is not None:
        y = y + b.to(dtype)
    dx = gemm(dyc, wc.t(), site.dgrad).to(x.dtype)
    dw = gemm(dyc.t(), xc.t(), site.wgrad).to(w.dtype)
    return y, dx, dw


SITES = [
    T,
    "e4m3.tensor.pow2.torch_scaled_mm",
    f"{T}|e5m2+e4m3.tensor.torch_scaled_mm|{T}",
    f"{T}|{T}|bf16",
    f"bf16|{T}|{T}",
    f"{T}|bf16|{T}",
    f"{T}|e4m3.tensor.fa.torch_scaled_mm|e5m2+e4m3.tensor.torch_scaled_mm",
]


@pytest.mark.parametrize("site_id", SITES)
@pytest.mark.parametrize("m, k, n", [(64, 32, 48), (48, 80, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_shared_operands_are_bit_identical_to_quantizing_per_gemm(
    monkeypatch: pytest.MonkeyPatch, site_id: str, m: int, k: int, n: int, dtype: torch.dtype, bias: bool
) -> None:
    monkeypatch.setattr(L, "SHARE_IN_EAGER", True)
    torch.manual_seed(m + k + n)
    layer = LokaLinear(k, n, bias=bias, precision=site_id)
    assert layer._share.any
    x = (torch.randn(m, k) * 3).requires_grad_(True)
    dy = torch.randn(m, n) * 0.01
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        y = layer(x)
        # the reference under the same autocast (torch._scaled_mm on the CPU is autocast-sensitive)
        ry, _, _ = _reference(x.detach(), layer.weight.detach(), layer.bias, dy, layer.precision, dtype)
    y.backward(dy)  # backward runs outside the autocast region, and so does its reference
    _, rdx, rdw = _reference(x.detach(), layer.weight.detach(), layer.bias, dy, layer.precision, dtype)
    assert y.dtype == dtype
    assert torch.equal(y.detach(), ry.detach())
    assert torch.equal(x.grad, rdx)
    assert torch.equal(layer.weight.grad, rdw)
    if bias:
        assert torch.allclose(layer.bias.grad, dy.to(dtype).float().sum(0))


def test_the_fp8_copies_not_the_bf16_tensors_are_saved(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(L, "SHARE_IN_EAGER", True)
    layer = LokaLinear(32, 16, precision=T)
    x = torch.randn(64, 32, requires_grad=True)
    saved: list[torch.dtype] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x).sum().backward()
    assert saved.count(torch.float8_e4m3fn) == 2 and torch.float32 in saved  # X's and W's data; their scales
    assert saved.count(torch.float32) == 2  # the two () scales, no (64, 32) float32 X, no float32 W


def _count(gm: torch.fx.GraphModule, op: object) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is op)


def test_compiled_layer_takes_the_shared_path_and_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.compile (dynamo + AOT autograd, the graphs inductor would get) the backward
    quantizes dY only (one amax, not four) and reuses the forward's FP8 X and W."""
    import torch._dynamo
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    monkeypatch.setattr(L, "SHARE_IN_EAGER", True)  # the eager reference runs the same torch ops
    torch.manual_seed(0)
    layer = LokaLinear(64, 32, precision=T)
    x = torch.randn(128, 64)
    dy = torch.randn(128, 32) * 0.1
    x1 = x.clone().requires_grad_(True)
    y1 = layer(x1)
    y1.backward(dy)
    ref = (y1.detach(), x1.grad.clone(), layer.weight.grad.clone())
    layer.weight.grad = None
    monkeypatch.setattr(L, "SHARE_IN_EAGER", False)  # compiled: shared because compiling
    graphs: dict[str, torch.fx.GraphModule] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        def keep(name: str):
            def compiler(g: torch.fx.GraphModule, _: list) -> object:
                graphs[name] = g
                return make_boxed_func(g.forward)
            return compiler

        return aot_module_simplified(gm, example_inputs, fw_compiler=keep("fw"), bw_compiler=keep("bw"))

    torch._dynamo.reset()
    try:
        f = torch.compile(layer, backend=backend, fullgraph=True)
        x2 = x.clone().requires_grad_(True)
        y2 = f(x2)
        y2.backward(dy)
    finally:
        torch._dynamo.reset()
    amax, mm = torch.ops.aten.amax.default, torch.ops.aten._scaled_mm.default
    assert (_count(graphs["fw"], amax), _count(graphs["fw"], mm)) == (2, 1)  # X and W, once each
    assert (_count(graphs["bw"], amax), _count(graphs["bw"], mm)) == (1, 2)  # dY only; W^T and X^T reused
    assert torch.equal(y2.detach(), ref[0])
    assert torch.equal(x2.grad, ref[1]) and torch.equal(layer.weight.grad, ref[2])
