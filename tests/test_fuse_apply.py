"""The fused Linear -> BlockNorm -> Hard Swish epilogue as a Mod: ``mods.fuse_epilogue`` through
``loka_tune.apply`` (per-site choices, skips with reasons, idempotence, state dict names), the
study file's ``[space] mods`` and the ``loka-tune train --config`` path. CPU, ``.emulated``."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from loka_tune import apply
from loka_tune.config import ModsConfig, PrecisionConfig, SitePrecision
from loka_tune.errors import ConfigError, UnsupportedChoiceError
from loka_tune.kernels.fused import FusedLinearBlockNormHardswish
from loka_tune.kernels.linear import LokaLinear
from loka_tune.layers import BlockNorm
from loka_tune.models import build_model
from loka_tune.models.base import MLPBlock
from loka_tune.mods.fuse import fuse_epilogues, unfuse_epilogues
from loka_tune.space import discover_sites

ROWS = "e4m3.row.emulated|e5m2+e4m3.row.emulated|e4m3.row.emulated"
MODS = ModsConfig(blocknorm=8, hardswish=True, fuse_epilogue=True)
CARDS = [50] * 8


def _wukong(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)  # silu: the hardswish Mod turns it into nn.Hardswish
    return build_model("wukong", "tiny", num_dense=13, cardinalities=CARDS, activation="silu")


def _cfg(mods: ModsConfig = MODS, **sites: str) -> PrecisionConfig:
    return PrecisionConfig.from_sites({"head": "bf16", **sites}, default=ROWS, mods=mods)


def _batch(seed: int = 0, b: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 13, generator=g), torch.randint(0, 50, (b, 8), generator=g)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _fused_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, FusedLinearBlockNormHardswish)]


def _chains(model: nn.Module) -> list[str]:
    """MLPBlocks that are Linear -> BlockNorm -> Hardswish (after the Mods)."""
    return [n for n, m in model.named_modules()
            if isinstance(m, MLPBlock) and isinstance(m.norm, BlockNorm) and type(m.act) is nn.Hardswish]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.to_dense() for n, p in model.named_parameters() if p.grad is not None}


def test_apply_fuses_wukong_chains_like_the_unfused_model() -> None:
    model, ref = _wukong(), _wukong()
    s = apply(model, _cfg())
    r = apply(ref, _cfg(MODS.passes))  # same Mods and precisions, no fusion
    assert not r.fuse_epilogue and r.fused == [] and _fused_names(ref) == []
    chains = _chains(ref)
    assert len(chains) >= 3  # dense MLP, the FMB MLPs of every layer, the head MLP
    assert s.fuse_epilogue and sorted(s.fused) == sorted(chains) == sorted(_fused_names(model))
    assert s.fuse_skipped == {} and s.fuse_note == ""
    assert s.replaced == r.replaced and s.counts == r.counts  # the precision swap is the same
    for c in s.fused:  # each fused chain runs its own site's three choices
        f = model.get_submodule(c)
        assert f.follows_linear and f.precision == SitePrecision.parse(ROWS)
        assert isinstance(f.linear, LokaLinear) and f.precision == f.linear.precision
    text = str(s)
    assert f"{len(chains)} chain(s) fused" in text and "fused epilogue" in text
    assert s.to_dict()["fused"] == s.fused
    assert list(model.state_dict()) == list(ref.state_dict())  # the names, in order
    ref.load_state_dict(model.state_dict())
    dense, sparse = _batch()
    out, out_ref = model(dense, sparse), ref(dense, sparse)
    assert torch.isfinite(out).all() and out.std() > 0
    assert _rel(out, out_ref) < 1e-5
    out.square().mean().backward()
    out_ref.square().mean().backward()
    g, g_ref = _grads(model), _grads(ref)
    assert set(g) == set(g_ref)
    for n, chain in ((f"{c}.linear.weight", c) for c in s.fused):
        assert g[n].abs().sum() > 0, chain
    for n in g:
        assert _rel(g[n], g_ref[n]) < 1e-4, n


def test_apply_fused_is_idempotent_and_switches_back() -> None:
    model = _wukong()
    s1 = apply(model, _cfg())
    keys = list(model.state_dict())
    params = {n: id(p) for n, p in model.named_parameters()}
    dense, sparse = _batch(1)
    out1 = model(dense, sparse).detach()
    s2 = apply(model, _cfg())
    assert s2.fused == s1.fused and s2.replaced == s1.replaced and "already applied" in s2.mods_note
    assert sorted(_fused_names(model)) == sorted(s1.fused)
    assert not any(isinstance(m.linear, FusedLinearBlockNormHardswish) for m in model.modules()
                   if isinstance(m, FusedLinearBlockNormHardswish))  # no fused-in-fused
    assert {n: id(p) for n, p in model.named_parameters()} == params  # same Parameters: optimizers stay valid
    assert torch.equal(model(dense, sparse), out1)
    # fusion off: the chains come back as MLPBlocks holding the (swapped) linears
    s3 = apply(model, _cfg(MODS.passes))
    assert s3.fused == [] and _fused_names(model) == [] and sorted(_chains(model)) == sorted(s1.fused)
    assert all(isinstance(model.get_submodule(f"{c}.linear"), LokaLinear) for c in s1.fused)
    assert _rel(model(dense, sparse), out1) < 1e-5
    # all bf16: the linears become nn.Linear again, and every chain is skipped as a bf16 site
    s4 = apply(model, PrecisionConfig(mods=MODS))
    assert s4.fused == [] and sorted(s4.fuse_skipped) == sorted(s1.fused)
    assert all("bf16" in why for why in s4.fuse_skipped.values())
    s5 = apply(model, _cfg())
    assert sorted(s5.fused) == sorted(s1.fused)
    assert list(model.state_dict()) == keys  # never a renamed parameter


def test_bf16_sites_and_unsupported_choices_are_skipped_with_reasons() -> None:
    model = _wukong()
    cfg = _cfg(**{"head_mlp.0.linear": "bf16", "dense_mlp.0.linear": "bf16|e5m2+e4m3.row.emulated|e4m3.row.emulated"})
    s = apply(model, cfg)
    assert "head_mlp.0" in s.fuse_skipped and "bf16" in s.fuse_skipped["head_mlp.0"]
    assert "nn.Linear" in s.fuse_skipped["head_mlp.0"]
    assert "dense_mlp.0" in s.fuse_skipped and "fwd GEMM is 'bf16'" in s.fuse_skipped["dense_mlp.0"]
    assert s.fused and not set(s.fused) & set(s.fuse_skipped)
    assert type(model.get_submodule("head_mlp.0")) is MLPBlock
    assert "skipped head_mlp.0: " in str(s)
    dense, sparse = _batch(2)
    model(dense, sparse).sum().backward()
    # a GPU backend on a CPU model: apply refuses it (strict) or sends it to bf16; then not fused
    gpu = _cfg(**{"re:head_mlp\\..*": "e4m3.row.fa.triton"})
    with pytest.raises(UnsupportedChoiceError, match="head_mlp.0.linear"):
        apply(_wukong(), gpu)
    s2 = apply(_wukong(), gpu, strict=False)
    assert set(s2.fallbacks["head_mlp.0.linear"]) == {"fwd", "dgrad", "wgrad"}
    assert "bf16" in s2.fuse_skipped["head_mlp.0"] and "head_mlp.0" not in s2.fused


def test_fuse_pass_per_site_reasons_on_cpu() -> None:
    """``fuse_epilogues(choice=None)``: a LokaLinear's choice the fused kernel does not run, or
    runs on CUDA only, is skipped with the reason; supported ones use all three of its choices."""

    def block(prec: str) -> MLPBlock:
        b = MLPBlock(16, 32, norm="none", activation="hardswish", bias=True)
        b.norm = BlockNorm(16)  # a block the Triton kernel takes: only the device stops it
        b.linear = LokaLinear.from_linear(b.linear, prec)
        return b

    model = nn.Sequential(block("e4m3.row.fa.triton"), block("e4m3.row.torch_scaled_mm"),
                          block("mxfp8.mx.emulated|e5m2+e4m3.block.emulated|e4m3.tensor.emulated"))
    rep = fuse_epilogues(model, choice=None)
    assert rep.fused == ["2"] and rep.choice == "per site"
    why = dict(rep.skipped)
    assert "CUDA" in why["0"] and "'e4m3.row.torch_scaled_mm'" in why["1"]
    assert model[2].precision.short_str() == "mxfp8.mx.emulated|e5m2+e4m3.block.emulated|e4m3.tensor.emulated"
    with pytest.raises(ValueError, match="dgrad"):
        fuse_epilogues(model, choice=None, dgrad="bf16")
    plain = MLPBlock(16, 32, norm="none", activation="hardswish", bias=True)
    plain.norm = BlockNorm(8)
    with pytest.raises(UnsupportedChoiceError, match="plain"):
        FusedLinearBlockNormHardswish(plain.linear, plain.norm, plain.act, choice=None)
    # an nn.Sequential run is fused by the pass by default, but not where names must stay
    seq = nn.Sequential(LokaLinear.from_linear(nn.Linear(16, 32), "e4m3.row.emulated"), BlockNorm(8), nn.Hardswish())
    keys = list(seq.state_dict())
    rep2 = fuse_epilogues(seq, choice=None, sequential=False)
    assert rep2.fused == [] and "state dict" in dict(rep2.skipped)["0"] and list(seq.state_dict()) == keys
    assert fuse_epilogues(seq, choice=None).fused == ["0"] and list(seq.state_dict()) != keys
    assert unfuse_epilogues(seq) == ["0"] and list(seq.state_dict()) == keys
    assert isinstance(seq[1], BlockNorm) and type(seq[2]) is nn.Hardswish


def test_fused_model_hooks_deepcopy_and_discovery() -> None:
    """Hooks on a fused chain's linear see its input (site discovery, the probe); deep copies
    keep what unfusing needs."""
    model, ref = _wukong(), _wukong()
    apply(model, _cfg())
    apply(ref, _cfg(MODS.passes))
    dense, sparse = _batch(3)
    sites, sites_ref = discover_sites(model, dense, sparse), discover_sites(ref, dense, sparse)
    assert [s.to_dict() for s in sites] == [s.to_dict() for s in sites_ref]
    twin = copy.deepcopy(model)
    assert sorted(_fused_names(twin)) == sorted(_fused_names(model))
    assert torch.equal(twin(dense, sparse), model(dense, sparse))
    restored = unfuse_epilogues(twin)
    assert sorted(restored) == sorted(_fused_names(model)) and _fused_names(twin) == []
    assert all(m.linear is not model.get_submodule(n).linear for n, m in twin.named_modules() if n in restored)
    assert _rel(twin(dense, sparse), model(dense, sparse)) < 1e-5


def test_no_chain_is_noted() -> None:
    model = _wukong()
    s = apply(model, _cfg(ModsConfig(fuse_epilogue=True)))  # neither BlockNorm nor Hard Swish
    assert s.fused == [] and s.fuse_skipped == {} and "no Linear -> BlockNorm -> Hard Swish chain" in s.fuse_note
    assert s.mods is None  # fusion alone runs no Mods pass
    assert "fuse" in str(s).lower()


# ----------------------------------------------------------------------------- study file
STUDY = """
[study]
name = "fuse"
[model]
name = "wukong"
[data]
source = "synthetic"
[space]
mods = {mods}
"""


def _study(mods: list[str]):  # noqa: ANN202
    import tomllib

    from loka_tune.tuner.study import parse_study

    return parse_study(tomllib.loads(STUDY.format(mods=json.dumps(mods))))


def test_study_mods_fuse_epilogue() -> None:
    cfg = _study(["blocknorm", "hardswish", "fuse_epilogue"])
    assert cfg.space.mods == ("blocknorm", "hardswish", "fuse_epilogue")
    from loka_tune.space.encode import mods_dims

    assert mods_dims(cfg.space.mods)["mods.fuse_epilogue"] == (False, True)
    for bad, quoted in ((["blocknorm", "hardswish", "fuse"], "fuse"), (["fused_epilogue"], "fused_epilogue")):
        with pytest.raises(ConfigError) as ei:
            _study(bad)
        assert ei.value.key == "space.mods" and repr(quoted) in str(ei.value)
    for lonely in (["fuse_epilogue"], ["blocknorm", "fuse_epilogue"], ["hardswish", "fuse_epilogue"]):
        with pytest.raises(ConfigError) as ei:
            _study(lonely)
        assert ei.value.key == "space.mods" and "fuse_epilogue" in str(ei.value) and "blocknorm" in str(ei.value)


# ----------------------------------------------------------------------------- loka-tune train
def test_cli_train_applies_fusion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # noqa: ANN001
    import loka_tune.objectives.trainer as trainer
    from loka_tune.cli import main

    seen: list[list[str]] = []
    real_train = trainer.train

    def spy(model, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append(_fused_names(model))
        return real_train(model, *a, **k)

    monkeypatch.setattr(trainer, "train", spy)
    runs = {}
    for name, mods in (("fused", MODS), ("plain", MODS.passes)):
        path = _cfg(mods).save(tmp_path / f"{name}.json")
        out = tmp_path / f"{name}.out.json"
        code = main(["train", "--model", "wukong", "--preset", "tiny", "--model-arg", "activation=silu",
                     "--data", "synthetic:num_sparse=8,cardinality=50,eval_examples=256", "--steps", "6",
                     "--batch-size", "64", "--device", "cpu", "--no-progress", "--config", str(path),
                     "--json", str(out)])
        assert code == 0, capsys.readouterr().err
        runs[name] = json.loads(out.read_text())
    capsys.readouterr()
    assert len(seen) == 2 and len(seen[0]) >= 3 and seen[1] == []  # the fused run trained fused chains
    f, p = runs["fused"], runs["plain"]
    assert f["status"] == p["status"] == "ok" and f["precision_replaced"] == p["precision_replaced"]
    # same arithmetic (emulated GEMMs), fused or not: the same losses up to rounding (the fused
    # backward's dY differs in the last bits, which can flip a few e5m2 roundings of the gradient)
    assert f["loss_curve"] == pytest.approx(p["loss_curve"], rel=2e-3)
    assert f["eval_logloss"] == pytest.approx(p["eval_logloss"], rel=2e-3)


# ----------------------------------------------------------------------------- GPU: Triton choices
@pytest.mark.gpu
def test_apply_fuses_triton_sites_on_cuda() -> None:
    """On CUDA a rowwise ``.triton`` fwd choice fuses through ``apply``; the fused model matches the
    unfused one with the same config (bound as in test_fused_epilogue: 2e-2, far below FP8's own
    error), and the CPU copy of the same model refuses the Triton choice."""
    pytest.importorskip("triton")
    from loka_tune.models.base import MLP

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(MLP(256, [512, 512], norm="layernorm", activation="silu", bias=True), nn.Linear(512, 1))

    cfg = PrecisionConfig.from_sites({"re:0\\..*": "e4m3.row.fa.triton|bf16|bf16"},
                                     mods=ModsConfig(blocknorm=128, hardswish=True, fuse_epilogue=True))
    fused, ref = model().cuda().bfloat16(), model().cuda().bfloat16()
    s = apply(fused, cfg)
    apply(ref, PrecisionConfig(default=cfg.default, sites=cfg.sites, mods=cfg.mods.passes))
    assert sorted(s.fused) == ["0.0", "0.1"] and s.fuse_skipped == {}
    x = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)
    out, out_ref = fused(x), ref(x)
    assert _rel(out, out_ref) < 2e-2
    out.float().square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in fused.parameters())
    with pytest.raises(UnsupportedChoiceError):
        apply(model(), cfg)  # on the CPU: the Triton GEMM (and epilogue) cannot run there
