"""Fused Linear -> BlockNorm -> Hard Swish epilogue (issue 6, point 3).

CPU: the pure-torch reference path of :mod:`loka_tune.kernels.fused` (the oracle, with a
hand-written backward like the Triton kernel's) equals the unfused chain
``LokaLinear(emulated) -> BlockNorm -> Hardswish`` (torch autograd), and the fuse pass finds
and swaps the chains of our models. GPU (``@pytest.mark.gpu``): the Triton fused kernel
matches the emulated unfused chain, forward and backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loka_tune.config import SitePrecision
from loka_tune.errors import UnsupportedChoiceError
from loka_tune.kernels.fused import (
    FusedLinearBlockNormHardswish,
    epilogue_supports,
    fused_linear_blocknorm_hardswish,
    reference_epilogue,
    reference_epilogue_backward,
)
from loka_tune.kernels.linear import LokaLinear
from loka_tune.kernels.quant import quantize
from loka_tune.layers import BlockNorm
from loka_tune.mods import blocknorm
from loka_tune.mods.fuse import fuse_epilogues

EMU = "e4m3.row.emulated"


def _unfused(lin: nn.Linear, block: int, eps: float | None, choice: str) -> nn.Sequential:
    return nn.Sequential(LokaLinear.from_linear(lin, choice), BlockNorm(block, eps=eps), nn.Hardswish())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm().clamp_min(1e-30))


def _data(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 0, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g) * 0.5)
    lin = lin.to(dtype)
    x = (torch.randn(m, k, generator=g) * 2).to(dtype)
    dh = torch.randn(m, n, generator=g).to(dtype)
    return lin, x, dh


def _fwd_bwd(mod: nn.Module, lin: nn.Linear, x: torch.Tensor, dh: torch.Tensor):
    for p in lin.parameters():
        p.grad = None
    xx = x.clone().requires_grad_()
    h = mod(xx)
    h.backward(dh)
    grads = [xx.grad, lin.weight.grad] + ([lin.bias.grad] if lin.bias is not None else [])
    return h.detach(), [g.clone() for g in grads]


# ----------------------------------------------------------------------------- CPU: reference path
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("m,k,n,block,bias", [(37, 48, 64, 16, True), (20, 33, 96, 32, False), (8, 16, 24, 64, True)])
def test_reference_path_equals_unfused_chain(dtype, tol, m, k, n, block, bias):
    """Same forward (bit for bit in structure: same emulated GEMM, same norm ops) and the
    hand-written backward equals torch autograd through BlockNorm and Hardswish."""
    lin, x, dh = _data(m, k, n, dtype, seed=m + n, bias=bias)
    eps = 1e-6
    ref_h, ref_g = _fwd_bwd(_unfused(lin, block, eps, EMU), lin, x, dh)
    fused = FusedLinearBlockNormHardswish(lin, BlockNorm(block, eps=eps), nn.Hardswish(), choice=EMU)
    h, g = _fwd_bwd(fused, lin, x, dh)
    assert h.dtype == dtype
    assert torch.equal(h, ref_h) or _rel(h, ref_h) < tol
    for a, b in zip(g, ref_g):
        assert _rel(a, b) < tol, (_rel(a, b), tol)
    # the FP8 quantization really happened: differs from the plain bf16-free chain
    plain = nn.Sequential(lin, BlockNorm(block, eps=eps), nn.Hardswish())
    with torch.no_grad():
        assert _rel(h, plain(x)) > 1e-3


def test_reference_path_bf16_and_eps_none():
    """bf16 compute (statistics in float32 as BlockNorm does) and eps=None (finfo eps)."""
    lin, x, dh = _data(50, 64, 128, torch.bfloat16, seed=3)
    ref_h, ref_g = _fwd_bwd(_unfused(lin, 32, None, EMU), lin, x, dh)
    h, g = _fwd_bwd(FusedLinearBlockNormHardswish(lin, BlockNorm(32, eps=None), choice=EMU), lin, x, dh)
    assert torch.equal(h, ref_h)  # same ops in the same dtypes
    for a, b in zip(g, ref_g):  # backward: fp32 math on bf16-saved values vs bf16 autograd
        assert _rel(a, b) < 2e-2


def test_epilogue_backward_matches_autograd_float64():
    torch.manual_seed(0)
    y = torch.randn(9, 48, dtype=torch.float64) * 3
    y[0, 0], y[1, 5], y[2, 20] = 30.0, -30.0, 3e-3  # outliers: z beyond +-3 in their blocks
    dh = torch.randn(9, 48, dtype=torch.float64)
    yy = y.clone().requires_grad_()
    h, rstd = reference_epilogue(yy, 16, 1e-6)
    h.backward(dh)
    dy = reference_epilogue_backward(dh, y, rstd.detach(), 16)
    assert _rel(dy, yy.grad) < 1e-12
    # Hard Swish saturation regions present (z < -3 and z > 3 happen with blocks of 16)
    z = (y.view(9, 3, 16) * rstd.detach().unsqueeze(-1)).flatten(-2)
    assert (z > 3).any() and (z < -3).any()


def test_block_equal_width_is_rmsnorm():
    lin, x, _ = _data(10, 32, 64, torch.float64, seed=1)
    h, _, _ = fused_linear_blocknorm_hardswish(x, lin.weight, lin.bias, block=512, eps=1e-6, precision=EMU)
    y = LokaLinear.from_linear(lin, EMU)(x)
    assert _rel(h, F.hardswish(F.rms_norm(y, (64,), eps=1e-6))) < 1e-12


def test_out_fp8_reference_semantics():
    lin, x, _ = _data(12, 32, 64, torch.float32, seed=2)
    h, q, qs = fused_linear_blocknorm_hardswish(x, lin.weight, lin.bias, block=32, precision=EMU, out_fp8=True)
    ref = quantize(h.detach(), "e4m3", "row")
    assert q.dtype == torch.float8_e4m3fn and qs.shape == (12, 1)
    assert torch.equal(q.float(), ref.data.float()) and torch.equal(qs, ref.inv_scale())


def test_unsupported_choices_are_reported():
    assert epilogue_supports("e4m3.row.fa.triton", n=100, block=64) is not None  # ragged
    assert "CUDA" in epilogue_supports("e4m3.row.fa.triton", n=256, block=64, device="cpu")
    assert "rowwise" in epilogue_supports("e4m3.block.triton", n=256, block=64)
    assert epilogue_supports("e4m3.row.fbgemm", n=256, block=64) is not None
    assert epilogue_supports("e4m3.block.emulated", n=256, block=64) is None
    assert epilogue_supports("e4m3.row.fa.triton", n=256, block=64) is None
    lin, x, _ = _data(4, 16, 64, torch.float32)
    mod = FusedLinearBlockNormHardswish(lin, BlockNorm(64), choice="e4m3.row.fa.triton")
    with pytest.raises(UnsupportedChoiceError, match="CUDA"):
        mod(x)
    with pytest.raises(UnsupportedChoiceError, match="ragged"):
        FusedLinearBlockNormHardswish(nn.Linear(8, 100), BlockNorm(64), choice=EMU)


# ----------------------------------------------------------------------------- CPU: the model pass
@pytest.mark.parametrize("name", ["wukong", "dlrm"])
def test_fuse_pass_on_models(name):
    from loka_tune.models import build_model

    torch.manual_seed(0)
    model = build_model(name, "tiny", num_dense=13, cardinalities=[50] * 8, norm="rmsnorm", activation="hardswish")
    blocknorm(model, 8)
    keys = set(model.state_dict())
    dense = torch.randn(16, 13)
    sparse = torch.randint(0, 50, (16, 8))
    report = fuse_epilogues(model, choice=EMU)
    assert report.fused, str(report)
    fused = [n for n, m in model.named_modules() if isinstance(m, FusedLinearBlockNormHardswish)]
    assert sorted(fused) == sorted(report.fused)
    assert set(model.state_dict()) == keys  # parameter names unchanged
    assert fuse_epilogues(model, choice=EMU).fused == []  # idempotent
    # the fused model equals the unfused model with the same emulated precision on those linears
    ref = build_model(name, "tiny", num_dense=13, cardinalities=[50] * 8, norm="rmsnorm", activation="hardswish")
    blocknorm(ref, 8)
    ref.load_state_dict(model.state_dict())
    for n in report.fused:
        blk = ref.get_submodule(n)
        blk.linear = LokaLinear.from_linear(blk.linear, EMU)
    out, out_ref = model(dense, sparse), ref(dense, sparse)
    assert _rel(out, out_ref) < 1e-5
    out.sum().backward()
    out_ref.sum().backward()
    for (pn, p), (_, pr) in zip(model.named_parameters(), ref.named_parameters()):
        if pr.grad is not None and not pr.grad.is_sparse and pr.grad.abs().sum() > 0:
            assert _rel(p.grad, pr.grad) < 1e-4, pn


def test_fuse_pass_sequential_and_skips():
    seq = nn.Sequential(
        nn.Linear(16, 32), BlockNorm(8), nn.Hardswish(),  # fused
        nn.Linear(32, 30), BlockNorm(8), nn.Hardswish(),  # ragged: skipped
        nn.Linear(30, 32), BlockNorm(8, weight_dim=32), nn.Hardswish(),  # affine: skipped
        nn.Linear(32, 8), nn.ReLU(),
    )
    x = torch.randn(5, 16)
    report = fuse_epilogues(seq, choice=EMU)
    assert report.fused == ["0"]
    assert [n for n, _ in report.skipped] == ["3", "6"]
    assert "ragged" in report.skipped[0][1] and "affine" in report.skipped[1][1]
    assert isinstance(seq[0], FusedLinearBlockNormHardswish) and isinstance(seq[1], nn.Identity)
    assert seq(x).shape == (5, 8)
    assert "1 fused" in str(report)


def test_fuse_pass_keeps_lokalinear_backward_choices():
    lin = LokaLinear.from_linear(nn.Linear(16, 32), SitePrecision.parse("bf16|e5m2+e4m3.row.emulated|e4m3.block.emulated"))

    class MLPBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.norm, self.act = lin, BlockNorm(16), nn.Hardswish()

        def forward(self, x):
            return self.act(self.norm(self.linear(x)))

    model = nn.Sequential(MLPBlock())
    rep = fuse_epilogues(model, choice=EMU)
    assert rep.fused == ["0"]
    assert model[0].precision.short_str() == "e4m3.row.emulated|e5m2+e4m3.row.emulated|e4m3.block.emulated"


# ----------------------------------------------------------------------------- GPU: the Triton kernel
TRITON = "e4m3.row.fa.triton"
# (M, K, N, block): M not a multiple of 128 (1000, 777, 300), K not a multiple of 128 (1040);
# tiles of one block (BN == b) and of several blocks (b=128 in BN=256, b=64 in BN=128); b=512
GPU_SHAPES = [(1000, 512, 512, 256), (777, 1040, 768, 128), (4096, 2048, 2048, 256), (300, 256, 1024, 64),
              (8192, 512, 1024, 128), (64, 128, 512, 512)]


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,block", GPU_SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_triton_fused_matches_emulated_chain(m, k, n, block, bias):
    """Bound: relative Frobenius error < 2e-2 vs the emulated e4m3 rowwise unfused chain
    (same quantization of X and W; the kernel's epilogue is fp32 with fast accumulation, the
    chain rounds to bf16 between ops), forward and every gradient. The backward GEMMs are
    bf16 on both sides here, so the gradients compare the epilogue backward alone (with FP8
    backward GEMMs, one-ulp e4m3 flips of slightly different dY add ~2%: next test).
    And the difference is far below the FP8 error itself."""
    lin, x, dh = _data(m, k, n, torch.float32, seed=m, bias=bias)
    lin, x, dh = lin.cuda().to(torch.bfloat16), x.cuda().to(torch.bfloat16), dh.cuda().to(torch.bfloat16)
    ref_h, ref_g = _fwd_bwd(_unfused(lin, block, 1e-6, "e4m3.row.emulated|bf16|bf16"), lin, x, dh)
    mod = FusedLinearBlockNormHardswish(lin, BlockNorm(block, eps=1e-6), choice=TRITON, dgrad="bf16", wgrad="bf16")
    h, g = _fwd_bwd(mod, lin, x, dh)
    assert h.dtype == torch.bfloat16 and h.shape == (m, n)
    err = _rel(h, ref_h)
    assert err < 2e-2, err
    for a, b in zip(g, ref_g):
        assert torch.isfinite(a).all()
        assert _rel(a, b) < 2e-2, _rel(a, b)
    # sanity: the FP8 error (vs the bf16 chain) is much larger than fused-vs-emulated
    plain_h, _ = _fwd_bwd(nn.Sequential(lin, BlockNorm(block, eps=1e-6), nn.Hardswish()), lin, x, dh)
    assert err < 0.5 * _rel(plain_h, ref_h)


@pytest.mark.gpu
def test_triton_fused_with_triton_backward_and_fp8_output():
    m, k, n, block = 2000, 1024, 2048, 256
    lin, x, dh = _data(m, k, n, torch.float32, seed=7)
    lin, x, dh = lin.cuda().to(torch.bfloat16), x.cuda().to(torch.bfloat16), dh.cuda().to(torch.bfloat16)
    ref_h, ref_g = _fwd_bwd(_unfused(lin, block, 1e-6, "e4m3.row.emulated"), lin, x, dh)
    mod = FusedLinearBlockNormHardswish(lin, BlockNorm(block, eps=1e-6), choice=TRITON)  # dgrad/wgrad triton
    h, g = _fwd_bwd(mod, lin, x, dh)
    assert _rel(h, ref_h) < 2e-2
    plain_h, plain_g = _fwd_bwd(nn.Sequential(lin, BlockNorm(block, eps=1e-6), nn.Hardswish()), lin, x, dh)
    for a, b, p in zip(g, ref_g, plain_g):
        # FP8 backward GEMMs on both sides (triton fa vs emulated) of slightly different dY
        assert _rel(a, b) < 5e-2 and _rel(a, b) < _rel(p, b), (_rel(a, b), _rel(p, b))
    with torch.no_grad():
        h2, q, qs = mod.forward_fp8(x)
        qr = quantize(h2, "e4m3", "row")  # the reference quantization of the kernel's bf16 output
        assert torch.equal(qs, qr.inv_scale())
        assert (q.float() != qr.data.float()).float().mean() < 1e-3  # same codes up to rare ties
        one_tile = FusedLinearBlockNormHardswish(nn.Linear(k, 256).cuda().bfloat16(), BlockNorm(256), choice=TRITON)
        h3, q3, qs3 = one_tile.forward_fp8(x)  # N fits one tile: the cast happens in the epilogue
        qr3 = quantize(h3, "e4m3", "row")
        assert torch.equal(qs3, qr3.inv_scale())
        assert (q3.float() != qr3.data.float()).float().mean() < 1e-3


@pytest.mark.gpu
def test_triton_fused_under_autocast_and_3d_input():
    lin, x, dh = _data(6 * 50, 256, 512, torch.float32, seed=11)
    lin, x = lin.cuda(), x.cuda().view(6, 50, 256)
    mod = FusedLinearBlockNormHardswish(lin, BlockNorm(128), choice=TRITON)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = mod(x)
        ref = _unfused(lin, 128, 1e-6, "e4m3.row.emulated")(x)
    assert h.shape == (6, 50, 512) and h.dtype == torch.bfloat16
    assert _rel(h, ref) < 2e-2
    h.float().sum().backward()
    assert lin.weight.grad is not None and torch.isfinite(lin.weight.grad).all()
