"""Tests of the Mods passes (No Bias, BlockNorm, Hard Swish, padding), their reports and apply_mods.

CPU only, fast. Numerics in float64 against explicit references (torch.nn.functional.rms_norm,
the unpadded layer) on random data with fixed seeds.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loka_tune.config import ModsConfig
from loka_tune.errors import ConfigError, ModError
from loka_tune.layers import SwishLayerNorm
from loka_tune.models import build_model
from loka_tune.mods import ModsReport, apply_mods, blocknorm, hardswish, no_bias, pad, unpad
from loka_tune.mods.norm import BlockNorm, block_layout
from loka_tune.mods.padding import PaddedLinear, padding_violations, rezero_padding_
from loka_tune.mods.pipeline import PASS_ORDER
from loka_tune.mods.report import PassReport
from loka_tune.mods.search import mod_choices, mods_from_params, mods_to_params

# ----------------------------------------------------------------------------- fixtures


class MySwish(nn.Module):
    """A custom Swish the hardswish pass must not replace blindly."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.5 * x)


class Zoo(nn.Module):
    """A model no pass has seen: nested Sequential / ModuleDict / ModuleList, 3-D inputs,
    a norm over two dims, a shared activation, aligned and unaligned linears."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            nn.Sequential(nn.Linear(13, 40), nn.LayerNorm(40), nn.SiLU()),
            nn.ModuleDict({"proj": nn.Linear(40, 32), "norm": nn.RMSNorm(32), "act": SwishLayerNorm(32)}),
        )
        self.towers = nn.ModuleList([nn.Linear(32, 32), nn.Linear(32, 20, bias=False), nn.Linear(32, 16)])
        self.norm2d = nn.LayerNorm((5, 68))  # over the last two dims: must be skipped
        self.gelu = nn.GELU()
        self.custom = MySwish()
        self.out = nn.Linear(68, 3)
        self.score = nn.Linear(3, 1)  # the head: the last linear with out_features == 1
        self.alias = self.blocks[0][2]  # the same SiLU registered under a second name

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 5, 13) -> (B, 5)
        h = self.blocks[0](x)  # (B, 5, 40)
        d = self.blocks[1]
        h = d["act"](d["norm"](d["proj"](h)))  # (B, 5, 32)
        h = torch.cat([t(h) for t in self.towers], dim=-1)  # (B, 5, 68)
        h = self.custom(self.gelu(self.norm2d(h)))
        h = self.alias(self.out(h))  # (B, 5, 3)
        return self.score(h).squeeze(-1)


def _zoo(dtype: torch.dtype = torch.float32, seed: int = 0) -> Zoo:
    torch.manual_seed(seed)
    m = Zoo().to(dtype)
    with torch.no_grad():  # non-trivial affine parameters everywhere
        for mod in m.modules():
            if isinstance(mod, (nn.LayerNorm, nn.RMSNorm)):
                mod.weight.uniform_(0.5, 1.5)
                if getattr(mod, "bias", None) is not None:
                    mod.bias.uniform_(-0.5, 0.5)
    return m


def _x(dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 5, 13, generator=g, dtype=dtype)


def _snapshot(model: nn.Module) -> tuple[str, dict[str, torch.Tensor]]:
    return repr(model), {k: v.clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model: nn.Module, snap: tuple[str, dict[str, torch.Tensor]]) -> None:
    text, sd = snap
    assert repr(model) == text
    now = model.state_dict()
    assert now.keys() == sd.keys()
    for k in sd:
        assert torch.equal(now[k], sd[k]), k


# ----------------------------------------------------------------------------- BlockNorm


@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 48), (2, 3, 4, 32)])
@pytest.mark.parametrize("eps", [1e-6, 1e-5, None])
def test_blocknorm_full_width_equals_rmsnorm(shape: tuple[int, ...], eps: float | None) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * 3 + 0.5
    n = shape[-1]
    ref = F.rms_norm(x, (n,), eps=eps)
    for block in (n, 2 * n, 10_000):  # block >= width: one block per row
        y = BlockNorm(block, eps=eps)(x)
        assert y.shape == x.shape and y.dtype == torch.float64
        assert (y - ref).abs().max().item() < 1e-6
        assert torch.allclose(y, ref, rtol=0, atol=1e-12)


def test_blocknorm_blocks_and_ragged_last_block() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 3, 40, generator=g, dtype=torch.float64) * torch.linspace(0.1, 10, 40, dtype=torch.float64)
    # 40 = 5 x 8: five independent blocks
    y = BlockNorm(8, eps=1e-6)(x)
    ref = torch.cat([F.rms_norm(x[..., i : i + 8], (8,), eps=1e-6) for i in range(0, 40, 8)], dim=-1)
    assert torch.allclose(y, ref, rtol=0, atol=1e-12)
    # 40 = 16 + 16 + ragged 8, the ragged block normalized over its own size
    y = BlockNorm(16, eps=1e-6)(x)
    ref = torch.cat([F.rms_norm(x[..., a:b], (b - a,), eps=1e-6) for a, b in ((0, 16), (16, 32), (32, 40))], dim=-1)
    assert torch.allclose(y, ref, rtol=0, atol=1e-12)
    # each full block has unit RMS (eps aside)
    rms = y[..., :32].unflatten(-1, (2, 16)).square().mean(-1).sqrt()
    assert torch.allclose(rms, torch.ones_like(rms), atol=1e-6)
    # an outlier only squashes its own block
    x2 = x.clone()
    x2[..., 3] = 1e6
    y2 = BlockNorm(16, eps=1e-6)(x2)
    assert torch.allclose(y2[..., 16:], y[..., 16:], rtol=0, atol=1e-12)
    assert not torch.allclose(y2[..., :16], y[..., :16])
    assert block_layout(40, 16) == (2, 16, 8)
    assert block_layout(40, 8) == (5, 8, 0)
    assert block_layout(12, 256) == (1, 12, 0)


def test_blocknorm_low_precision_noncontiguous_weight_and_grad() -> None:
    g = torch.Generator().manual_seed(2)
    x64 = torch.randn(4, 64, 6, generator=g, dtype=torch.float64).transpose(1, 2)  # (4, 6, 64), non-contiguous
    assert not x64.is_contiguous()
    ref = BlockNorm(32)(x64.contiguous())
    assert torch.allclose(BlockNorm(32)(x64), ref, rtol=0, atol=1e-12)
    yb = BlockNorm(32)(x64.to(torch.bfloat16))
    assert yb.dtype == torch.bfloat16
    assert (yb.double() - ref).abs().max().item() < 0.05  # bf16 output rounding only
    w = BlockNorm(32, weight_dim=64, dtype=torch.float64)
    with torch.no_grad():
        w.weight.uniform_(0.5, 2.0)
    assert torch.allclose(w(x64), ref * w.weight, rtol=0, atol=1e-12)
    xg = torch.randn(3, 20, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(BlockNorm(8, eps=1e-3), (xg,))  # ragged 8 + 8 + 4


def test_blocknorm_rejects_bad_arguments() -> None:
    for bad in (0, -4, 2.5, True, "64"):
        with pytest.raises(ModError, match="positive integer"):
            BlockNorm(bad)  # type: ignore[arg-type]
    with pytest.raises(ModError, match="eps"):
        BlockNorm(16, eps=-1.0)
    with pytest.raises(ModError, match="got 0"):
        blocknorm(_zoo(), 0)


def test_blocknorm_and_padded_linear_compile_without_graph_breaks() -> None:
    x = torch.randn(2, 3, 40)
    bn = BlockNorm(16)
    y = torch.compile(bn, fullgraph=True, backend="eager")(x)  # fullgraph: a graph break raises
    assert torch.allclose(y, bn(x))
    p = PaddedLinear.from_linear(nn.Linear(13, 40))
    xi = torch.randn(2, 3, 13)
    y = torch.compile(p, fullgraph=True, backend="aot_eager")(xi)
    y.sum().backward()
    assert torch.allclose(y, p(xi))


# ----------------------------------------------------------------------------- no_bias


def test_no_bias_on_unseen_model() -> None:
    model = _zoo()
    weights = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    rep = no_bias(model)
    assert isinstance(rep, PassReport) and rep.name == "no_bias"
    assert rep.params["head"] == "score"
    expected = ["blocks.0.0", "blocks.1.proj", "towers.0", "towers.2", "out"]  # towers.1 has none
    assert rep.changed_modules == expected
    assert "prediction head" in rep.skipped_modules["score"]
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear):
            assert (m.bias is not None) == (n == "score"), n
            assert torch.equal(m.weight, weights[n])  # weights kept as they are
    assert "bias" not in dict(model.blocks[0][0].named_parameters())
    assert torch.isfinite(model(_x())).all()
    c = rep.changed[0]
    assert c.before.startswith("bias (40,)") and c.after == "bias None"
    snap = _snapshot(model)
    again = no_bias(model)
    assert again.n_changed == 0 and "score" in again.skipped_modules
    _assert_unchanged(model, snap)


def test_no_bias_keep_names_head_attribute_and_errors() -> None:
    model = _zoo()
    rep = no_bias(model, keep=("out", "blocks.1"))
    assert model.out.bias is not None and model.blocks[1]["proj"].bias is not None
    assert model.blocks[0][0].bias is None and model.score.bias is not None
    assert "keep" in rep.skipped_modules["out"] and "keep" in rep.skipped_modules["blocks.1.proj"]

    model = _zoo()
    model.prediction_head = "out"  # the attribute wins over the out_features == 1 rule
    rep = no_bias(model)
    assert rep.params["head"] == "out" and model.out.bias is not None and model.score.bias is None

    model = _zoo()
    no_bias(model, keep_head=False)
    assert all(m.bias is None for m in model.modules() if isinstance(m, nn.Linear))

    no_head = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))  # no out_features == 1
    rep = no_bias(no_head)
    assert rep.params["head"] == "2" and no_head[2].bias is not None and no_head[0].bias is None

    with pytest.raises(ModError, match="did you mean 'score'"):
        no_bias(_zoo(), keep=("scor",))
    bad = _zoo()
    bad.prediction_head = "nope"
    with pytest.raises(ModError, match="no module named 'nope'"):
        no_bias(bad)
    with pytest.raises(ModError, match="Module"):
        no_bias("not a model")  # type: ignore[arg-type]


def test_no_bias_skips_what_it_cannot_handle() -> None:
    class WithAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.conv = nn.Conv1d(3, 3, 1)
            self.lin = nn.Linear(16, 16)
            self.tied = nn.Linear(16, 16)
            self.tied.bias = self.lin.bias
            self.head = nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.tied(self.lin(self.attn(x, x, x)[0])))

    m = WithAttention()
    rep = no_bias(m)
    assert "MultiheadAttention" in rep.skipped_modules["attn.out_proj"]
    assert "not a linear" in rep.skipped_modules["conv"]
    assert "shared" in rep.skipped_modules["lin"] and "shared" in rep.skipped_modules["tied"]
    assert m.attn.out_proj.bias is not None and m.lin.bias is not None
    assert torch.isfinite(m(torch.randn(2, 3, 16))).all()


# ----------------------------------------------------------------------------- blocknorm pass


def test_blocknorm_pass_on_unseen_model() -> None:
    model = _zoo()
    rep = blocknorm(model, 16)
    assert rep.changed_modules == ["blocks.0.1", "blocks.1.norm", "blocks.1.act.norm"]
    assert "last 2 dims" in rep.skipped_modules["norm2d"]
    assert any("dropped" in n for n in rep.notes)
    assert isinstance(model.blocks[0][1], BlockNorm) and model.blocks[0][1].block == 16
    assert isinstance(model.blocks[1]["act"], SwishLayerNorm)  # the gate stays; its LayerNorm is replaced
    assert isinstance(model.blocks[1]["act"].norm, BlockNorm)
    assert model.blocks[0][1].weight is None  # parameter-free
    assert model.blocks[0][1].eps == 1e-5  # the replaced norm's eps is kept
    assert isinstance(model.norm2d, nn.LayerNorm)
    assert "ragged block of 8" in rep.changed[0].after  # 40 = 16 + 16 + 8
    x = _x()
    assert torch.isfinite(model(x)).all()
    # the replaced norm computes BlockNorm of its input
    h = torch.randn(3, 5, 40)
    assert torch.equal(model.blocks[0][1](h), BlockNorm(16, eps=1e-5)(h))
    snap = _snapshot(model)
    again = blocknorm(model, 16)
    assert again.n_changed == 0 and "norm2d" in again.skipped_modules
    _assert_unchanged(model, snap)


def test_blocknorm_pass_affine_and_skips() -> None:
    model = _zoo()
    ln_w = model.blocks[0][1].weight.detach().clone()
    rep = blocknorm(model, 8, affine=True)
    assert any("kept" in n for n in rep.notes)
    bn = model.blocks[0][1]
    assert torch.equal(bn.weight.detach(), ln_w)

    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(8)
            self.hooked = nn.LayerNorm(8)
            self.hooked.register_forward_hook(lambda *a: None)

            class MyLN(nn.LayerNorm):
                def forward(self, x: torch.Tensor) -> torch.Tensor:
                    return super().forward(x.float()).to(x.dtype)

            self.custom = MyLN(8)
            self.plain = nn.LayerNorm(8)

    odd = Odd()
    rep = blocknorm(odd, 4)
    assert rep.changed_modules == ["plain"]
    assert "batch" in rep.skipped_modules["bn"]
    assert "hooks" in rep.skipped_modules["hooked"]
    assert "own forward" in rep.skipped_modules["custom"]


# ----------------------------------------------------------------------------- hardswish pass


def test_hardswish_pass_on_unseen_model() -> None:
    model = _zoo()
    rep = hardswish(model)
    assert rep.changed_modules == ["blocks.0.2", "blocks.1.act"]
    assert rep.changed[0].aliases == ("alias",)
    assert model.alias is model.blocks[0][2] and isinstance(model.alias, nn.Hardswish)  # sharing kept
    assert isinstance(model.blocks[1]["act"], nn.Hardswish)
    assert isinstance(model.gelu, nn.GELU)  # not a Swish
    assert isinstance(model.custom, MySwish) and "unknown type" in rep.skipped_modules["custom"]
    assert not any(isinstance(m, (nn.SiLU, SwishLayerNorm)) for m in model.modules())
    x = torch.linspace(-6, 6, 97)
    assert torch.allclose(model.alias(x), x * F.relu6(x + 3) / 6)
    assert torch.isfinite(model(_x())).all()
    inplace = nn.Sequential(nn.Linear(3, 3), nn.SiLU(inplace=True))
    hardswish(inplace)
    assert isinstance(inplace[1], nn.Hardswish) and inplace[1].inplace
    snap = _snapshot(model)
    assert hardswish(model).n_changed == 0
    _assert_unchanged(model, snap)


# ----------------------------------------------------------------------------- pad pass


def _param_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients by the unpadded parameter names (the real block of padded parameters)."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, PaddedLinear):
            out[f"{name}.weight"] = mod.linear.weight.grad[: mod.out_features, : mod.in_features]
            if mod.linear.bias is not None:
                out[f"{name}.bias"] = mod.linear.bias.grad[: mod.out_features]
        elif isinstance(mod, nn.Linear) and not name.endswith(".linear"):
            out[f"{name}.weight"] = mod.weight.grad
            if mod.bias is not None:
                out[f"{name}.bias"] = mod.bias.grad
        elif not isinstance(mod, nn.Linear):
            for pn, p in mod.named_parameters(recurse=False):
                out[f"{name}.{pn}"] = p.grad
    return out


@pytest.mark.parametrize("multiple", [16, 8])
def test_pad_is_exact_in_output_and_gradients(multiple: int) -> None:
    ref = _zoo(torch.float64)
    padded = copy.deepcopy(ref)
    rep = pad(padded, multiple)
    aligned = {16: ["towers.0", "towers.2"], 8: ["blocks.1.proj", "towers.0", "towers.2"]}[multiple]  # K, N multiples
    assert sorted(n for n, r in rep.skipped_modules.items() if "aligned" in r) == aligned
    assert "prediction head" in rep.skipped_modules["score"]
    assert "blocks.0.0" in rep.changed_modules and "out" in rep.changed_modules
    assert isinstance(padded.blocks[0][0], PaddedLinear)
    for name, m in padded.named_modules():
        if isinstance(m, PaddedLinear):
            assert m.padded_in % multiple == 0 and m.padded_out % multiple == 0
            assert m.padding_is_zero()
    x1 = _x(torch.float64).requires_grad_(True)
    x2 = x1.detach().clone().requires_grad_(True)
    g = torch.Generator().manual_seed(5)
    y1, y2 = ref(x1), padded(x2)
    assert y1.shape == y2.shape
    assert torch.allclose(y1, y2, rtol=0, atol=1e-12)
    dy = torch.randn(y1.shape, generator=g, dtype=torch.float64)
    y1.backward(dy)
    y2.backward(dy)
    assert torch.allclose(x1.grad, x2.grad, rtol=0, atol=1e-12)
    g1, g2 = _param_grads(ref), _param_grads(padded)
    assert g1.keys() == g2.keys()
    for k in g1:
        assert torch.allclose(g1[k], g2[k], rtol=0, atol=1e-12), k
    # gradients of the padding regions are exactly zero
    for m in padded.modules():
        if isinstance(m, PaddedLinear):
            gw = m.linear.weight.grad
            assert torch.count_nonzero(gw[m.out_features :]) == 0
            assert torch.count_nonzero(gw[:, m.in_features :]) == 0
            if m.linear.bias is not None:
                assert torch.count_nonzero(m.linear.bias.grad[m.out_features :]) == 0


def test_pad_state_dict_unpad_and_idempotence() -> None:
    ref = _zoo(torch.float64)
    padded = copy.deepcopy(ref)
    rep = pad(padded, 16)
    sd = padded.state_dict()
    assert "blocks.0.0.weight" not in sd and sd["blocks.0.0.linear.weight"].shape == (48, 16)
    assert any("state dict" in n for n in rep.notes)
    snap = _snapshot(padded)
    again = pad(padded, 16)
    assert again.n_changed == 0 and "already padded" in again.skipped_modules["blocks.0.0"]
    _assert_unchanged(padded, snap)
    back = unpad(padded)
    assert back.changed_modules == rep.changed_modules
    sd_ref, sd_back = ref.state_dict(), padded.state_dict()
    assert sd_ref.keys() == sd_back.keys()
    for k in sd_ref:
        assert torch.equal(sd_ref[k], sd_back[k]), k
    x = _x(torch.float64)
    assert torch.allclose(ref(x), padded(x), rtol=0, atol=1e-12)


def test_pad_repads_to_a_new_multiple_exactly() -> None:
    ref = _zoo(torch.float64)
    m = copy.deepcopy(ref)
    pad(m, 8)
    rep = pad(m, 16)
    assert "blocks.0.0" in rep.changed_modules  # 13x40 -> (16, 40) -> (16, 48)
    assert m.blocks[0][0].padded_out == 48
    x = _x(torch.float64)
    assert torch.allclose(ref(x), m(x), rtol=0, atol=1e-12)


def test_padded_linear_3d_noncontiguous_inputs_and_views() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(12, 20).double()
    p = PaddedLinear.from_linear(lin, 16)
    x = torch.randn(3, 12, 7, dtype=torch.float64).transpose(1, 2)  # (3, 7, 12), non-contiguous
    y = p(x)
    assert y.is_contiguous() and y.shape == (3, 7, 20)
    assert torch.allclose(y, lin(x), rtol=0, atol=1e-12)
    assert y.view(3, -1).shape == (3, 140)  # merging dims after the slice works
    assert p.weight.shape == (20, 12) and torch.equal(p.weight, lin.weight)
    assert torch.equal(p.bias, lin.bias)
    with pytest.raises(RuntimeError, match="expected 12"):
        p(torch.randn(2, 16, dtype=torch.float64))
    fresh = PaddedLinear(12, 20, multiple=16)
    assert fresh.padding_is_zero() and fresh.linear.weight.shape == (32, 16)
    bound = 1 / 12**0.5  # nn.Linear(12, 20)'s init bound, fan-in 12 not 16
    assert fresh.weight.abs().max() <= bound and fresh.weight.abs().max() > bound / 2


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
        lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
        lambda ps: torch.optim.Adagrad(ps, lr=0.1, weight_decay=0.1),
        lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, weight_decay=0.1),
    ],
    ids=["sgd", "adam", "adamw", "adagrad", "rmsprop"],
)
def test_padding_stays_zero_under_optimizers(make_opt) -> None:
    model = _zoo()
    pad(model, 16)
    opt = make_opt(model.parameters())
    x = _x()
    before = model.blocks[0][0].weight.detach().clone()
    for _ in range(5):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    assert not torch.equal(model.blocks[0][0].weight, before)  # it did train
    assert padding_violations(model) == []


def test_rezero_padding() -> None:
    model = _zoo()
    pad(model, 16)
    with torch.no_grad():
        model.out.linear.weight.fill_(1.0)  # e.g. a coordinate-mixing optimizer or a re-init
    assert padding_violations(model) == ["out"]
    assert rezero_padding_(model) == 4
    assert padding_violations(model) == []


def test_pad_skips_what_it_cannot_handle() -> None:
    class Swapped(nn.Linear):  # stands in for an already precision-swapped LokaLinear
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x)

    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(12, 2, batch_first=True)
            self.swapped = Swapped(12, 12)
            self.hooked = nn.Linear(12, 12)
            self.hooked.register_forward_pre_hook(lambda *a: None)
            self.a = nn.Linear(12, 12)
            self.b = nn.Linear(12, 12)
            self.b.weight = self.a.weight
            self.lazy = nn.LazyLinear(12)
            self.ok = nn.Linear(12, 12)

    odd = Odd()
    rep = pad(odd, 16, skip=())
    assert rep.changed_modules == ["ok"]
    s = rep.skipped_modules
    assert "MultiheadAttention" in s["attn.out_proj"]
    assert "precision swap" in s["swapped"]
    assert "hooks" in s["hooked"]
    assert "tied" in s["a"] and "tied" in s["b"]
    assert "lazy" in s["lazy"]
    with pytest.raises(ModError, match="multiple"):
        pad(odd, 0)


# ----------------------------------------------------------------------------- apply_mods


def test_apply_mods_order_report_and_idempotence() -> None:
    model = _zoo()
    mods = ModsConfig(no_bias=True, keep_bias=("out",), blocknorm=16, hardswish=True, pad=16)
    rep = apply_mods(model, mods)
    assert isinstance(rep, ModsReport)
    assert rep.pass_names == list(PASS_ORDER) == ["no_bias", "blocknorm", "hardswish", "pad"]
    assert rep["no_bias"].params["keep"] == ["out"] and model.out.bias is not None
    assert rep.n_changed == sum(p.n_changed for p in rep.passes) > 0
    text = str(rep)
    assert "nobias+bn16+hswish+pad16" in text
    for name in PASS_ORDER:
        assert f"{name}(" in text
    d = json.loads(json.dumps(rep.to_dict()))
    assert [p["name"] for p in d["passes"]] == list(PASS_ORDER) and d["mods"]["blocknorm"] == 16
    assert rep.summary()["pad.changed"] == rep["pad"].n_changed
    assert torch.isfinite(model(_x())).all()
    snap = _snapshot(model)
    again = apply_mods(model, mods.to_dict())
    assert again.n_changed == 0
    _assert_unchanged(model, snap)

    subset = apply_mods(_zoo(), ModsConfig(hardswish=True, pad=16))
    assert subset.pass_names == ["hardswish", "pad"] and "no_bias" not in subset
    assert apply_mods(_zoo(), None).passes == [] and "no pass" in str(apply_mods(_zoo(), ModsConfig()))
    with pytest.raises(ModError, match="ModsConfig"):
        apply_mods(_zoo(), 16)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown key"):
        apply_mods(_zoo(), {"blocknrm": 16})
    with pytest.raises(KeyError, match="no pass"):
        subset["blocknorm"]


# ----------------------------------------------------------------------------- search helpers


def test_mod_choices_and_params_round_trip() -> None:
    choices = mod_choices()
    assert choices == {
        "no_bias": [False, True],
        "blocknorm": [None, 64, 128, 256],
        "hardswish": [False, True],
        "pad": [None, 16],
        "fuse_epilogue": [False, True],
        "fp8_chain": [False, True],
    }
    assert mod_choices(include=("pad",), pad=(16, 32)) == {"pad": [None, 16, 32]}
    with pytest.raises(ConfigError, match="unknown Mod"):
        mod_choices(include=("nobias",))
    with pytest.raises(ConfigError, match="positive"):
        mod_choices(blocknorm=(0,))
    seen = set()
    for nb in choices["no_bias"]:
        for bn in choices["blocknorm"]:
            for hs in choices["hardswish"]:
                for pd in choices["pad"]:
                    for fu in choices["fuse_epilogue"]:
                        m = mods_from_params({"mods.no_bias": nb, "blocknorm": bn, "mods.hardswish": hs,
                                              "mods.pad": pd, "mods.fuse_epilogue": fu, "site.head.fwd": "bf16"})
                        assert (m.no_bias, m.blocknorm, m.hardswish, m.pad, m.fuse_epilogue) == (nb, bn, hs, pd, fu)
                        assert mods_from_params(mods_to_params(m)) == m
                        seen.add(m.short_str())
    assert len(seen) == 2 * 4 * 2 * 2 * 2
    assert mods_from_params({"fuse_epilogue": "True"}).fuse_epilogue is True
    with pytest.raises(ConfigError, match="mods.fuse_epilogue"):
        mods_from_params({"mods.fuse_epilogue": "maybe"})
    assert mods_from_params({}) == ModsConfig()
    m = mods_from_params({"mods.no_bias": "True", "mods.blocknorm": "128", "mods.pad": "None"}, keep_bias=("x",))
    assert m == ModsConfig(no_bias=True, keep_bias=("x",), blocknorm=128)
    with pytest.raises(ConfigError, match="unknown Mod"):
        mods_from_params({"mods.blocknrm": 64})
    with pytest.raises(ConfigError, match="mods.blocknorm"):
        mods_from_params({"mods.blocknorm": -3})
    with pytest.raises(ConfigError, match="twice"):
        mods_from_params({"pad": 16, "mods.pad": 16})


# ----------------------------------------------------------------------------- reference models


def _reference(name: str) -> nn.Module:
    torch.manual_seed(0)
    return build_model(
        name, "tiny", num_dense=13, cardinalities=[50] * 8, activation="swish_layernorm", norm="layernorm"
    )


def _batch(n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 13, generator=g), torch.randint(0, 50, (n, 8), generator=g)


@pytest.mark.parametrize("name", ["dlrm", "dcnv2", "wukong", "interformer"])
def test_reference_models_each_pass(name: str) -> None:
    dense, sparse = _batch()
    model = _reference(name)
    head = model.prediction_head
    n_linears = sum(isinstance(m, nn.Linear) for m in model.modules())

    rep = no_bias(model)
    assert rep.params["head"] == head and rep.n_changed == n_linears - 1
    assert model.get_submodule(head).bias is not None
    assert all(m.bias is None for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != head)

    rep = blocknorm(model, 16)
    assert rep.n_changed > 0 and not any(isinstance(m, (nn.LayerNorm, nn.RMSNorm)) for m in model.modules())
    assert any(n.endswith("act.norm") for n in rep.changed_modules)  # SwishLayerNorm's norm

    rep = hardswish(model)
    assert rep.n_changed > 0 and not any(isinstance(m, (SwishLayerNorm, nn.SiLU)) for m in model.modules())

    rep = pad(model, 16)
    assert rep.skipped_modules[head].startswith("the prediction head")
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear) and n != head:
            assert m.in_features % 16 == 0 and m.out_features % 16 == 0, n

    y = model(dense, sparse)
    assert y.shape == (16,) and torch.isfinite(y).all()
    y.square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None and not p.grad.is_sparse)


@pytest.mark.parametrize("name", ["dlrm", "dcnv2", "wukong", "interformer"])
def test_reference_models_apply_mods_pad_exact_and_idempotent(name: str) -> None:
    dense, sparse = _batch()
    ref = _reference(name).double()
    padded = copy.deepcopy(ref)
    assert apply_mods(padded, ModsConfig(pad=16))["pad"].n_changed > 0
    assert torch.allclose(ref(dense.double(), sparse), padded(dense.double(), sparse), rtol=0, atol=1e-12)

    model = _reference(name)
    mods = ModsConfig(no_bias=True, blocknorm=16, hardswish=True, pad=16)
    rep = apply_mods(model, mods)
    assert rep.pass_names == list(PASS_ORDER)
    assert model.get_submodule(model.prediction_head).bias is not None
    y = model(dense, sparse)
    assert torch.isfinite(y).all()
    snap = _snapshot(model)
    assert apply_mods(model, mods).n_changed == 0
    _assert_unchanged(model, snap)


def test_passes_keep_dtype_device_and_requires_grad() -> None:
    model = nn.Sequential(nn.Linear(13, 40), nn.LayerNorm(40), nn.SiLU(), nn.Linear(40, 1)).to(torch.bfloat16)
    model[0].weight.requires_grad_(False)
    apply_mods(model, ModsConfig(no_bias=True, blocknorm=16, hardswish=True, pad=16))
    assert isinstance(model[0], PaddedLinear) and model[0].linear.weight.dtype == torch.bfloat16
    assert not model[0].linear.weight.requires_grad
    y = model(torch.randn(3, 13, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(13, 40), nn.LayerNorm(40), nn.Linear(40, 1))
    rep = apply_mods(meta, ModsConfig(no_bias=True, blocknorm=16, pad=16))
    assert rep.n_changed == 3 and meta[0].linear.weight.is_meta
