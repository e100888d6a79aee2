"""benchmarks/fp8_chain.py on the CPU: the norm kernels' references against float64 autograd, an
FP8 chain against the float64 MLP it replaces, eager and compiled, its delayed amaxes, the swap and
e2e's site split; the Triton kernels under the interpreter (where triton is installed) and on a GPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from _bench import load_bench, run_under_triton_interpreter
from torch import nn

from loka_tune.kernels.quant import sqnr_db as _sqnr
from loka_tune.layers import BlockNorm
from loka_tune.models.base import MLPBlock

REPO = Path(__file__).resolve().parents[1]
BENCH = str(REPO / "benchmarks")


def _load():  # noqa: ANN202
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)  # its sibling delayed_scales
    return load_bench("fp8_chain.py", "fp8_chain_bench", register=True)


def _block(k: int, n: int) -> MLPBlock:
    b = MLPBlock(k, n, norm="none", activation="relu", bias=False)
    b.norm, b.act = BlockNorm(256), nn.Hardswish()  # what the Mods make of it
    return b


def _mlp64(blocks: list[MLPBlock], tail: nn.Linear | None, x: torch.Tensor, g: torch.Tensor):  # noqa: ANN202
    """The float64 forward and gradients (input, each weight) of the blocks (and tail)."""
    x64 = x.double().requires_grad_(True)
    ws = [b.linear.weight.detach().double().requires_grad_(True) for b in blocks]
    h = x64
    for w in ws:
        y = (h @ w.t()).unflatten(-1, (-1, 256))
        h = nn.functional.hardswish(y * torch.rsqrt(y.square().mean(-1, keepdim=True) + 1e-6)).flatten(-2)
    wt = None
    if tail is not None:
        wt = tail.weight.detach().double().requires_grad_(True)
        h = h @ wt.t()
    h.backward(g.double())
    return h.detach(), x64.grad, [w.grad for w in ws] + ([wt.grad] if wt is not None else [])


def _eager_then_compiled(chain, x: torch.Tensor, g: torch.Tensor):  # noqa: ANN001, ANN202
    """One step of ``chain`` eagerly, then compiled whole (``fullgraph``), each from its calibrated
    amaxes under bf16 autocast: ``[(out, dx, [dw ...], amax after), ...]``."""
    calibrated = chain.amax.clone()
    res = []
    for fn in (chain, torch.compile(chain, fullgraph=True)):
        chain.amax.copy_(calibrated)
        for w in chain.weights:  # the tail's too: the chain holds it unregistered
            w.grad = None
        xg = x.clone().requires_grad_(True)
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            out = fn(xg)
        out.float().backward(g)
        res.append((out.detach().float(), xg.grad.clone(), [w.grad.clone() for w in chain.weights], chain.amax.clone()))
    return res


def test_the_norm_references_are_blocknorm_and_hard_swish_and_their_gradient() -> None:
    ch = _load()
    torch.manual_seed(0)
    y = (torch.randn(48, 512) * torch.logspace(-2, 2, 512)).to(torch.bfloat16)
    s = torch.tensor(20.0)
    q, qt, rstd, amax = ch.norm_fwd_cast_reference(y, s, 1e-6)
    y64 = y.double().requires_grad_(True)
    x64 = nn.functional.hardswish(BlockNorm(256, eps=1e-6)(y64))
    assert _sqnr(x64, q.float() / 20.0) > 25.0  # e4m3 of the fp32 math (~28 dB)
    assert torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))
    assert float(amax) == pytest.approx(float(x64.abs().max()), rel=1e-5)
    assert rstd.shape == (48, 2)
    rstd_out, x_bf16 = ch.norm_fwd_cast_reference(y, s, 1e-6, out_bf16=True)
    assert torch.equal(rstd_out, rstd) and x_bf16.dtype == torch.bfloat16 and _sqnr(x64, x_bf16) > 40.0
    g = torch.randn(48, 512)
    x64.backward(g.double())
    dy_ref = y64.grad
    sd = 400.0 / float(dy_ref.abs().max())
    qd, qdt, damax = ch.norm_bwd_cast_reference(g.to(torch.bfloat16), y, rstd, torch.tensor(sd))
    assert _sqnr(dy_ref, qd.float() / sd) > 24.0  # e4m3 (~28 dB) of the bf16 gradient's fp32 math
    assert float(damax) == pytest.approx(float(dy_ref.abs().max()), rel=2e-2)
    with pytest.raises(ValueError, match="features a multiple of 256, got \\(4, 300\\)"):
        ch.norm_fwd_cast(torch.zeros(4, 300), s, 1e-6)


@pytest.mark.parametrize("tail,grad_format", [(False, "e4m3"), (True, "e4m3"), (False, "e5m2"), (True, "e5m2")])
def test_a_chain_trains_within_fp8_error_of_the_float64_mlp(tail: bool, grad_format: str) -> None:
    ch = _load()
    torch.manual_seed(1)
    blocks = [_block(64, 256), _block(256, 512)]
    t = nn.Linear(512, 128, bias=False) if tail else None
    chain = ch.ChainMLP(blocks, t, grad_format=grad_format)
    assert chain.amax.shape == (3 * (2 + tail),) and not chain.calibrated
    x = torch.randn(96, 64) * 2.0
    g = torch.randn(96, 128 if tail else 512)
    seen = ch.calibrate(nn.Sequential(chain), [(x,)], lambda out, i: (out.float() * g).sum())
    assert chain.calibrated and set(seen) == {"0"} and all(p.grad is None for p in chain.parameters())
    h64, dx64, dws64 = _mlp64(blocks, t, x, g)
    xg = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = chain(xg)
    assert out.dtype == torch.bfloat16 and out.shape == h64.shape
    out.float().backward(g)
    # two or three e4m3 GEMMs in a row (~28 dB each operand) and the norms between them; e5m2
    # gradients have one mantissa bit less (here 19-22 dB from float64 where e4m3's are 22-24)
    assert _sqnr(h64, out) > 18.0
    assert _sqnr(dx64, xg.grad) > 15.0
    for w, dw64 in zip(chain.weights, dws64):
        assert w.grad is not None and w.grad.dtype == torch.float32 and _sqnr(dw64, w.grad) > 15.0


@pytest.mark.parametrize("grad_format", ["e4m3", "e5m2"])
def test_the_chain_compiled_whole_matches_eager_and_keeps_its_amaxes_one_call_behind(grad_format: str) -> None:
    ch = _load()
    torch.manual_seed(2)
    chain = ch.ChainMLP([_block(64, 256), _block(256, 256)], nn.Linear(256, 64, bias=False), grad_format=grad_format)
    x = torch.randn(64, 64)
    g = torch.randn(64, 64)
    ch.calibrate(nn.Sequential(chain), [(x,)], lambda out, i: (out.float() * g).sum())
    calibrated = chain.amax.clone()
    (oe, dxe, dwe, ae), (oc, dxc, dwc, ac) = _eager_then_compiled(chain, x, g)
    # two FP8 roundings of the same math; e5m2 gradients keep a mantissa bit less (~6 dB; 21.8 dB seen)
    bar = 25.0 if grad_format == "e4m3" else 19.0
    assert _sqnr(oe, oc) > 25.0 and _sqnr(dxe, dxc) > bar and all(_sqnr(a, b) > bar for a, b in zip(dwe, dwc))
    # the same inputs as the calibration: every amax comes back to within bf16's rounding
    assert torch.allclose(ae, calibrated, rtol=2e-2) and torch.allclose(ac, calibrated, rtol=2e-2)
    # a call on 4x the input: its scales are the old ones (its x_0 saturates at margin x old amax), its amaxes the new
    chain.amax.copy_(calibrated)
    with torch.no_grad():
        chain(x * 4.0)
    assert float(chain.amax[0]) == pytest.approx(4.0 * float(calibrated[0]), rel=1e-2)


def test_swap_chain_folds_the_tail_keeps_the_state_dict_keys_and_unchains() -> None:
    ch = _load()
    mlp = nn.Sequential(_block(13, 256), _block(256, 256), _block(256, 256))

    class Host(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp, self.out = mlp, nn.Linear(256, 32, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.mlp(x))

    host = Host()
    keys, out_lin = list(host.state_dict()), host.out
    names = ch.swap_chain(host, "mlp", "out")
    assert names == ["mlp.1.linear", "mlp.2.linear", "out"]
    chain = host.mlp
    assert isinstance(chain, ch.ChainMLP) and chain.start == 1 and isinstance(chain[0], MLPBlock)
    assert isinstance(host.out, ch.FoldedTail) and host.out.weight is out_lin.weight
    assert chain.tail is out_lin and chain.weights[-1] is out_lin.weight
    assert list(host.state_dict()) == keys  # the same keys: blocks where they were, the tail's weight at out
    assert sum(p is out_lin.weight for p in host.parameters()) == 1
    with pytest.raises(ValueError, match="is an FP8 chain already"):
        ch.swap_chain(host, "mlp")
    ch.calibrate(host, [(torch.randn(8, 13),)], lambda out, i: out.float().square().sum())
    assert host(torch.randn(8, 13)).shape == (8, 32)
    assert host(torch.randn(2, 4, 13)).shape == (2, 4, 32)  # leading dims flattened and restored
    assert ch.unchain(host) == ["mlp"] and host.mlp is mlp and host.out is out_lin
    assert list(host.state_dict()) == keys
    relu = nn.Sequential(MLPBlock(256, 256, norm="none", activation="relu", bias=False))
    with pytest.raises(ValueError, match="no block of 'm' can join an FP8 chain: its norm is not a parameter-free BlockNorm"):
        ch.swap_chain(nn.ModuleDict({"m": relu}), "m")
    with pytest.raises(ValueError, match="the tail must be a bias-free nn.Linear"):
        ch.ChainMLP([_block(256, 256)], nn.Linear(256, 32))
    with pytest.raises(ValueError, match="a chain needs at least one"):
        ch.ChainMLP([])


def test_e2e_splits_wukongs_sites_into_chains_and_single_layers() -> None:
    """e2e.py's ``chain_tensorwise_filter`` on a small Wukong with the Mods: every FMB's MLP and its
    ``out`` one chain, the head MLP one, the dense MLP from its first FP8-able block; trains a step."""
    from loka_tune import apply
    from loka_tune.config import ModsConfig, PrecisionConfig
    from loka_tune.models.wukong import Wukong

    _load()
    e2e = load_bench("e2e.py", "e2e_bench_chain")
    torch.manual_seed(3)
    model = Wukong(5, [10] * 12, embedding_dim=16, num_layers=2, num_fmb=8, num_lcb=8, fmb_rank=16,
                   fmb_mlp=(256, 256), dense_mlp=(256, 256), head_mlp=(256,), dense_embeddings=1, activation="silu")
    apply(model, PrecisionConfig(mods=ModsConfig(no_bias=True, blocknorm=256, hardswish=True)))
    lin = sorted(n for n, m in model.named_modules() if type(m) is nn.Linear and m.in_features % 16 == 0
                 and m.out_features % 16 == 0 and m.out_features > 1)
    chained, rest = e2e.chain_sites(model, lin)
    assert "layers.0.fmb.out" in chained and "layers.1.fmb.mlp.0.linear" in chained and "head_mlp.0.linear" in chained
    assert "dense_mlp.1.linear" in chained and "dense_mlp.0.linear" not in chained + rest  # K = 5: never FP8
    assert set(chained) | set(rest) == set(lin) and not set(chained) & set(rest)
    assert all(type(model.get_submodule(n)).__name__ == "DelayedScaleLinear" for n in rest)
    dense, sparse = torch.randn(32, 5), torch.randint(0, 10, (32, 12))
    labels = torch.randint(0, 2, (32,)).float()
    import delayed_scales
    import fp8_chain

    def loss(out: torch.Tensor, i: int) -> torch.Tensor:
        return nn.functional.binary_cross_entropy_with_logits(out.float(), labels)

    for m in model.modules():
        if isinstance(m, delayed_scales.DelayedScaleLinear):
            m.own_scales = True
    fp8_chain.calibrate(model, [(dense, sparse)], loss)
    for m in model.modules():
        if isinstance(m, delayed_scales.DelayedScaleLinear):
            m.own_scales = False
    delayed_scales.calibrate(model, [(dense, sparse)], loss)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(dense, sparse)
    loss(out, 0).backward()
    assert torch.isfinite(out).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for n, p in model.named_parameters()
               if "fmb.mlp" in n or "head_mlp" in n)


def test_the_kernels_under_the_triton_interpreter() -> None:
    """Where triton is installed (not in CI): the two kernels on the CPU under TRITON_INTERPRET=1
    against the references: rstd and amax to fp32 rounding, and the FP8 bytes against the fp32
    values the references compute cast by the product's dual-cast kernel under the same
    interpreter (which rounds to FP8 its own way: 127.86 became 64, not 128, on triton 3.9): at most
    0.1% of the bytes differ (ties of the fp32 math); the transposed copy is the same bytes."""
    code = (
        "import sys, torch\n"
        f"sys.path.insert(0, {BENCH!r})\n"
        "import fp8_chain as ch\n"
        "from loka_tune.config import Format\n"
        "from loka_tune.kernels.triton_quant import dual_cast\n"
        "torch.manual_seed(0)\n"
        "y = (torch.randn(70, 512) * torch.logspace(-2, 2, 512)).to(torch.bfloat16)\n"
        "g = torch.randn(70, 512).to(torch.bfloat16)\n"
        "s = torch.tensor(30.0)\n"
        "def same(q, qt, v):\n"
        "    rq, _ = dual_cast(v.contiguous(), s, Format.E4M3)\n"
        "    assert (q.view(torch.uint8) != rq.view(torch.uint8)).float().mean() <= 1e-3\n"
        "    assert torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))\n"
        "q, qt, r, a = ch.norm_fwd_cast(y, s, 1e-6)\n"
        "_, _, rr, ra = ch.norm_fwd_cast_reference(y, s, 1e-6)\n"
        "assert torch.allclose(r, rr, rtol=1e-5) and torch.allclose(a, ra, rtol=1e-5)\n"
        "z = y.float().view(70, 2, 256) * rr[..., None]\n"
        "x = (z * (z + 3).clamp(0, 6) / 6).reshape(70, 512)\n"
        "same(q, qt, x)\n"
        "r2, x2 = ch.norm_fwd_cast(y, s, 1e-6, out_bf16=True)\n"
        "assert torch.allclose(r2, rr, rtol=1e-5) and torch.allclose(x2.float(), x, rtol=1e-2, atol=1e-2)\n"
        "d, dt, da = ch.norm_bwd_cast(g, y, rr, s)\n"
        "_, _, rda = ch.norm_bwd_cast_reference(g, y, rr, s)\n"
        "assert torch.allclose(da, rda, rtol=1e-4)\n"
        "gz = g.float().view(70, 2, 256) * torch.where(z < -3, 0.0, torch.where(z <= 3, z / 3 + 0.5, 1.0))\n"
        "dy = (rr[..., None] * (gz - z * (gz * z).mean(-1, keepdim=True))).reshape(70, 512)\n"
        "same(d, dt, dy)\n"
        "def same5(q, qt, v):\n"  # e5m2 gradients: against the dual cast's e5m2 under the same interpreter
        "    rq, _ = dual_cast(v.contiguous(), s, Format.E5M2)\n"
        "    assert q.dtype == torch.float8_e5m2\n"
        "    assert (q.view(torch.uint8) != rq.view(torch.uint8)).float().mean() <= 1e-3\n"
        "    assert torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))\n"
        "d5, d5t, da5 = ch.norm_bwd_cast(g, y, rr, s, out=torch.float8_e5m2)\n"
        "assert torch.equal(da5, da)\n"
        "same5(d5, d5t, dy)\n"
        "from loka_tune.kernels.chain import cast_dual_amax\n"
        "c5, c5t, ca = cast_dual_amax(g, s, out=torch.float8_e5m2)\n"
        "assert torch.allclose(ca, g.float().abs().amax().reshape(1))\n"
        "same5(c5, c5t, g.float())\n"
        "print('ok')\n"
    )
    run_under_triton_interpreter(code)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n", [(1, 256), (70, 512), (8192, 2048)])
def test_the_norm_kernels_match_their_references_on_a_gpu(m: int, n: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ch = _load()
    torch.manual_seed(4)
    y = (torch.randn(m, n, device="cuda") * torch.logspace(-3, 3, n, device="cuda")).to(torch.bfloat16)
    y[0, :256] = 0.0  # an all-zero block: rstd = 1 / sqrt(eps), x = 0
    g = (torch.randn(m, n, device="cuda") * 1e-4).to(torch.bfloat16)
    s = torch.tensor(30.0, device="cuda")
    q, qt, r, a = ch.norm_fwd_cast(y, s, 1e-6)
    rq, _, rr, ra = ch.norm_fwd_cast_reference(y, s, 1e-6)
    assert torch.allclose(r, rr, rtol=1e-5) and torch.allclose(a, ra, rtol=1e-5)
    assert (q.view(torch.uint8) != rq.view(torch.uint8)).float().mean() < 1e-3  # ties of the fp32 math only
    assert torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))
    d, dt, da = ch.norm_bwd_cast(g, y, rr, torch.tensor(400.0, device="cuda") / ra.reshape(()))
    rd, _, rda = ch.norm_bwd_cast_reference(g, y, rr, torch.tensor(400.0, device="cuda") / ra.reshape(()))
    assert torch.allclose(da, rda, rtol=1e-4)
    assert (d.view(torch.uint8) != rd.view(torch.uint8)).float().mean() < 1e-3
    assert torch.equal(dt.view(torch.uint8), d.t().contiguous().view(torch.uint8))
    e5 = torch.float8_e5m2  # the gradients in e5m2 (ChainMLP(grad_format="e5m2"))
    d5, d5t, da5 = ch.norm_bwd_cast(g, y, rr, torch.tensor(400.0, device="cuda") / ra.reshape(()), out=e5)
    rd5, _, _ = ch.norm_bwd_cast_reference(g, y, rr, torch.tensor(400.0, device="cuda") / ra.reshape(()), out=e5)
    assert d5.dtype == e5 and torch.allclose(da5, rda, rtol=1e-4)
    assert (d5.view(torch.uint8) != rd5.view(torch.uint8)).float().mean() < 1e-3
    assert torch.equal(d5t.view(torch.uint8), d5.t().contiguous().view(torch.uint8))


@pytest.mark.gpu
def test_the_chain_compiles_whole_on_a_gpu_and_matches_eager_and_float64() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ch = _load()
    torch.manual_seed(5)
    blocks = [_block(512, 1024), _block(1024, 1024)]
    chain = ch.ChainMLP(blocks, nn.Linear(1024, 512, bias=False)).cuda()
    x = torch.randn(2048, 512, device="cuda")
    g = torch.randn(2048, 512, device="cuda")
    ch.calibrate(nn.Sequential(chain), [(x,)], lambda out, i: (out.float() * g).sum())
    (oe, dxe, dwe, _), (oc, dxc, dwc, _) = _eager_then_compiled(chain, x, g)
    # eager and compiled are two FP8 roundings of the same math, not one: on the CPU (references,
    # this model and data) they are 25-26 dB apart and each 22-23 dB from float64 (2026-12-07); on
    # an H100 the output matched exactly and the input gradient was 29.55 dB apart. The float64
    # comparison below is the accuracy bar; this one catches a broken compiled path
    assert _sqnr(oe, oc) > 25.0 and _sqnr(dxe, dxc) > 25.0 and all(_sqnr(a, b) > 25.0 for a, b in zip(dwe, dwc))
    h64, dx64, dws64 = _mlp64(blocks, chain.tail, x, g)  # float64 on the GPU, the modules where they are
    assert _sqnr(h64, oc) > 18.0 and _sqnr(dx64, dxc) > 15.0
    assert all(_sqnr(d64, d) > 15.0 for d64, d in zip(dws64, dwc))


def test_the_norm_kernels_compile_for_sm90_with_inductors_argument_types() -> None:
    """Inductor launches the kernels from its own code and types a Python float argument fp64;
    Triton 3.6 then failed to lower the forward kernel's fp64 square root (make_llir, on an H100,
    2026-12-07), so ``eps`` is a constexpr. Compiled here for sm_90 on the CPU (Triton's NVIDIA
    backend needs no GPU to build PTX), with 32- and 64-bit sizes as inductor may give them; and the
    dual-amax cast's kernel, which no GPU has run since it saturates with ``tl.where``."""
    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    ch = _load()
    _, kf, kb = ch._kernels()
    for ity in ("i32", "i64"):
        fwd_sig = {"y_ptr": "*bf16", "s_ptr": "*fp32", "q_ptr": "*fp8e4nv", "qt_ptr": "*fp8e4nv",
                   "rstd_ptr": "*fp32", "amax_ptr": "*fp32", "x_ptr": "*bf16", "M": ity, "N": ity, "NB": ity,
                   "EPS": "constexpr", "ACT": "constexpr", "OUT": "constexpr", "BR": "constexpr", "BLK": "constexpr"}
        bwd_sig = {"g_ptr": "*bf16", "y_ptr": "*bf16", "rstd_ptr": "*fp32", "s_ptr": "*fp32", "q_ptr": "*fp8e4nv",
                   "qt_ptr": "*fp8e4nv", "amax_ptr": "*fp32", "M": ity, "N": ity, "NB": ity,
                   "ACT": "constexpr", "BR": "constexpr", "BLK": "constexpr"}
        for out in (False, True):
            consts = {"EPS": 0.0078125, "ACT": True, "OUT": out, "BR": 32, "BLK": ch.BLOCK}
            k = compile(ASTSource(fn=kf, signature=fwd_sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": 4})
            assert "ptx" in k.asm
        for e5 in (False, True):  # dy in e4m3 or e5m2
            f8 = "*fp8e5" if e5 else "*fp8e4nv"
            sig = {**bwd_sig, "q_ptr": f8, "qt_ptr": f8, "E5": "constexpr"}
            k = compile(ASTSource(fn=kb, signature=sig, constexprs={"ACT": True, "BR": 32, "BLK": ch.BLOCK, "E5": e5}),
                        target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
            assert "ptx" in k.asm
    # the dual-amax cast (delayed scales' operands: cast_dual_amax) at its launch's tiles, from a bf16
    # activation and (VIA 1) an fp32 master weight rounded through bf16 as it is read
    from loka_tune.kernels.chain import _kernel

    _, kd = _kernel()
    for xty, via in (("*bf16", 0), ("*fp32", 1)):
        for e5, f8 in ((False, "*fp8e4nv"), (True, "*fp8e5")):
            sig = {"x_ptr": xty, "s_ptr": "*fp32", "y_ptr": f8, "yt_ptr": f8, "amax_ptr": "*fp32",
                   "R": "i32", "C": "i32", "sxr": "i32", "sxc": "i32", "VIA": "constexpr", "BR": "constexpr",
                   "BC": "constexpr", "E5": "constexpr"}
            for br, bc in ((512, 16), (128, 128)):
                k = compile(ASTSource(fn=kd, signature=sig, constexprs={"VIA": via, "BR": br, "BC": bc, "E5": e5}),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
                assert "ptx" in k.asm


def test_the_amax_trace_names_the_operand_that_outgrew_its_margin() -> None:
    """AmaxTrace reads growth between consecutive steps' amaxes: an operand whose amax grew past
    the margin saturated that step. Amaxes set by hand: dy0 triples at step 3, w1 grows 1.5x
    (within the margin of 2), and nothing else moves."""
    ch = _load()
    chain = ch.ChainMLP([_block(64, 256), _block(256, 256)], nn.Linear(256, 64, bias=False))
    names = ch.slot_names(3)
    assert names == ["x0", "w0", "w1", "w2", "x1", "x2", "dy0", "dy1", "dy2"] and chain.amax.numel() == 9
    trace = ch.AmaxTrace(nn.Sequential(chain))
    base = torch.arange(1.0, 10.0)
    for step, (slot, factor) in enumerate([(None, 1.0), ("w1", 1.5), ("dy0", 3.0), (None, 1.0)], start=1):
        if slot is not None:
            base[names.index(slot)] *= factor
        chain.amax.copy_(base)
        trace(step)
    s = trace.summary()["0"]
    assert s["steps"] == 4 and s["margin"] == ch.MARGIN and s["over_margin"] == 1
    assert s["dy"] == {"max_growth": 3.0, "at_step": 3, "operand": "dy0", "steps_over_margin": 1}
    assert s["w"]["max_growth"] == 1.5 and s["w"]["operand"] == "w1" and s["w"]["steps_over_margin"] == 0
    assert s["x"]["max_growth"] == 1.0 and s["first"]["dy0"] == 7.0 and s["last"]["dy0"] == 21.0
    assert ch.set_margin(nn.Sequential(chain), 4.0) == 1 and chain.margin == 4.0
    assert ch.set_grad_format(chain, "e5m2") == 1 and chain.grad_format == "e5m2"
    with pytest.raises(ValueError, match="grad_format='fp16'"):
        ch.set_grad_format(chain, "fp16")
    with pytest.raises(ValueError, match="margin=0.5"):
        ch.set_margin(chain, 0.5)


def _wukong_study(tmp_path: Path, width: int = 256) -> Path:
    """The quickstart study with a Wukong whose MLPs are ``width`` wide (chains need BlockNorm(256))."""
    text = (REPO / "studies" / "quickstart.toml").read_text()
    text = text.replace('name = "dlrm"', 'name = "wukong"')
    start, end = text.index("[model.overrides]"), text.index("[data]")
    text = text[:start] + (f"[model.overrides]\nfmb_mlp = [{width}, {width}]\nhead_mlp = [{width}, {width}]\n"
                           'dense_mlp = [256]\nactivation = "silu"\n\n') + text[end:]
    study = tmp_path / f"wukong_{width}.toml"
    study.write_text(text)
    return study


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path (the GPU runs it in the e2e calls)")
def test_e2e_reports_the_chains_amax_growth_and_takes_a_margin(tmp_path: Path) -> None:
    """e2e.py's ``config`` variant of a config with the fp8_chain Mod, on the CPU (the chains' torch
    references): the run's record holds the margin it was given and each chain's amax summary."""
    from loka_tune.config import ModsConfig, PrecisionConfig, SitePrecision

    e2e = load_bench("e2e.py", "e2e_bench")
    study = _wukong_study(tmp_path)
    tw = SitePrecision.parse("e4m3.tensor.torch_scaled_mm")
    cfg = PrecisionConfig(mods=ModsConfig(no_bias=True, blocknorm=256, hardswish=True, fp8_chain=True),
                          sites={r"re:.*mlp\.\d+\.linear": tw, r"re:.*fmb\.out": tw})
    (tmp_path / "best.json").write_text(cfg.to_json())
    rc = e2e.main(["--study", str(study), "--steps", "3", "--warmup", "1", "--seeds", "0", "--variants", "config",
                   "--config", str(tmp_path / "best.json"), "--chain-margin", "3", "--chain-grad", "e5m2", "--chain-trace",
                   "--out", str(tmp_path / "out")])
    assert rc == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    (run,) = res["runs"]
    assert run["status"] == "ok" and run["chain_margin"] == 3.0 and res["meta"]["chain_trace"] is True
    assert run["chain_grad"] == "e5m2" and res["meta"]["chain_grad"] == "e5m2"
    assert set(run["chain_amax"]) == set(run["chains"]) and run["chains"]
    for s in run["chain_amax"].values():
        assert s["margin"] == 3.0 and s["grad_format"] == "e5m2" and s["steps"] == 3
        assert set(s) >= {"x", "w", "dy", "over_margin", "first", "last"}
        assert all(v > 0 for v in s["last"].values())


def test_e2e_runs_the_chain_only_where_the_variant_names_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An export with the fp8_chain Mod (the study's e2e passes it to every variant) chains in
    ``config`` and ``*_chain_filter`` only: ``scaled_mm_tensorwise_filter``, the reference issue
    21's bar compares the export with, stays the plain recipe, and bf16 + Mods has no chain Mod."""
    from loka_tune.config import ModsConfig, PrecisionConfig, SitePrecision
    from loka_tune.kernels.chain import ChainMLP
    from loka_tune.recipes import SIZE_FILTERS
    from loka_tune.tuner.build import make_model, make_source
    from loka_tune.tuner.study import load_study

    e2e = load_bench("e2e.py", "e2e_bench")
    keep = SIZE_FILTERS["tensorwise"]
    monkeypatch.setattr(e2e, "_torchao_filtered", lambda model, recipe: {  # torchao's filter, restated
        n for n, m in model.named_modules() if type(m) is nn.Linear and keep.keeps(m.in_features, m.out_features)})
    tw = SitePrecision.parse("e4m3.tensor.torch_scaled_mm")
    cfg = PrecisionConfig(mods=ModsConfig(no_bias=True, blocknorm=256, hardswish=True, fp8_chain=True),
                          sites={r"re:.*mlp\.\d+\.linear": tw, r"re:.*fmb\.out": tw})
    # the recipe on those sites (torch_scaled_mm declines CPU tensors: uniform_config would keep bf16)
    monkeypatch.setattr(e2e, "uniform_config", lambda model, choice, source, batch, device, only=None: (
        PrecisionConfig(sites={n: SitePrecision.parse(choice) for n in sorted(only or ())}), 0))
    study = load_study(_wukong_study(tmp_path, 2048))  # out = 2048: kept by the tensorwise filter
    src = make_source(study)
    runs = {}
    for name in ("bf16_mods", "scaled_mm_tensorwise_filter", "scaled_mm_tensorwise_chain_filter", "config"):
        m = make_model(study, src)
        rec = e2e.prepare(name, m, cfg, source=src, batch_size=64)
        runs[name] = (rec, sum(isinstance(c, ChainMLP) for c in m.modules()))
    assert runs["bf16_mods"] == ({"fp8_sites": 0, "mods": "nobias+bn256+hswish"}, 0)
    plain, n_plain = runs["scaled_mm_tensorwise_filter"]
    assert n_plain == 0 and plain["mods"] == "nobias+bn256+hswish" and "chains" not in plain
    assert plain["fp8_sites"] + plain["fallbacks"] == 5  # the filter's sites, unchained (on the CPU: fallbacks)
    for name in ("scaled_mm_tensorwise_chain_filter", "config"):
        rec, n = runs[name]
        assert n > 0 and rec["mods"].endswith("+chain") and rec["chains"], name


def test_e5m2_gradients_saturate_at_57344_and_an_unknown_format_is_refused() -> None:
    """The gradient format reaches the references and the chain: e5m2 copies of ``dy`` (both
    layouts) saturated at +-57344, the e4m3 ones at +-448; the chain's two formats give different
    input gradients from the same weights and data; anything else is refused in one line."""
    ch = _load()
    from loka_tune.kernels.chain import E5M2, cast_dual_amax_reference

    torch.manual_seed(6)
    y = torch.randn(8, 256).to(torch.bfloat16)
    g = torch.randn(8, 256).to(torch.bfloat16) * 1e3
    _, _, rstd, _ = ch.norm_fwd_cast_reference(y, torch.tensor(1.0), 1e-6)
    big = torch.tensor(1e6)  # every value saturates
    q5, qt5, _ = ch.norm_bwd_cast_reference(g, y, rstd, big, out=E5M2)
    q4, _, _ = ch.norm_bwd_cast_reference(g, y, rstd, big)
    assert q5.dtype == E5M2 and q5.float().abs().max() == 57344.0 and q4.float().abs().max() == 448.0
    assert torch.equal(qt5.view(torch.uint8), q5.t().contiguous().view(torch.uint8))
    d5, d5t, _ = cast_dual_amax_reference(g, big, out=E5M2)
    assert d5.dtype == E5M2 and d5t.shape == (256, 8) and d5.float().abs().max() == 57344.0
    grads = {}
    for fmt in ("e4m3", "e5m2"):
        torch.manual_seed(7)
        chain = ch.ChainMLP([_block(64, 256), _block(256, 256)], nn.Linear(256, 64, bias=False), grad_format=fmt)
        x = torch.randn(32, 64, requires_grad=True)
        chain(x).float().square().sum().backward()
        grads[fmt] = x.grad
    assert not torch.equal(grads["e4m3"], grads["e5m2"]) and _sqnr(grads["e4m3"], grads["e5m2"]) > 12.0
    with pytest.raises(ValueError, match="grad_format='e3m4'"):
        ch.ChainMLP([_block(64, 256)], grad_format="e3m4")
    with pytest.raises(ValueError, match="float8_e4m3fn or float8_e5m2"):
        ch.norm_bwd_cast(g, y, rstd, big, out=torch.bfloat16)
