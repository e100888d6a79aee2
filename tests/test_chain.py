"""loka_tune.kernels.chain, the product's FP8 chain: what the benchmark tests (tests/test_fp8_chain_bench.py,
through benchmarks/fp8_chain.py's re-export) do not: its import stays light and its ops live in the
``loka`` namespace."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from loka_tune.layers import BlockNorm
from loka_tune.models.base import MLPBlock


def test_importing_the_chain_imports_no_triton() -> None:
    code = ("import sys, loka_tune.kernels.chain as c; assert 'triton' not in sys.modules, 'triton imported'; "
            "assert c.BLOCK == 256 and c.MARGIN >= 1.0; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_a_chain_registers_its_ops_in_the_loka_namespace_and_runs_on_the_cpu() -> None:
    from loka_tune.kernels import chain as ch

    b = MLPBlock(64, 256, norm="none", activation="relu", bias=False)
    b.norm, b.act = BlockNorm(256), nn.Hardswish()
    m = ch.ChainMLP([b], nn.Linear(256, 64, bias=False))
    for name in ("chain_cast_dual_amax", "chain_norm_fwd_cast", "chain_norm_fwd_out", "chain_norm_bwd_cast"):
        assert hasattr(torch.ops.loka, name), name
    x = torch.randn(32, 64)
    ch.calibrate(nn.Sequential(m), [(x,)], lambda out, i: out.float().square().sum())
    assert m.calibrated
    out = m(x)
    assert out.shape == (32, 64) and torch.isfinite(out).all()


TW = "e4m3.tensor.torch_scaled_mm"
MODS = {"no_bias": True, "blocknorm": 256, "hardswish": True}


def test_to_moves_a_chains_unregistered_tail_alone_and_inside_a_model() -> None:
    """A chain built alone keeps its tail unregistered: ``.to()`` must still convert it (on an
    H100 a chain moved with ``.cuda()`` left its tail on the CPU, 2026-12-07). Inside a model the
    tail's weight stays the FoldedTail's parameter, one object, converted once."""
    from loka_tune import apply
    from loka_tune.kernels import chain as ch

    b = MLPBlock(64, 256, norm="none", activation="relu", bias=False)
    b.norm, b.act = BlockNorm(256), nn.Hardswish()
    m = ch.ChainMLP([b], nn.Linear(256, 64, bias=False)).to(torch.float64)
    assert m.tail is not None and m.tail.weight.dtype == torch.float64
    assert all(w.dtype == torch.float64 for w in m.weights) and m.amax.dtype == torch.float32
    model = _wukong()
    apply(model, _config(True), strict=False)
    model.to(torch.float64)
    folded = model.get_submodule("layers.1.fmb.out")
    chain = model.get_submodule("layers.1.fmb.mlp")
    assert isinstance(folded, ch.FoldedTail) and isinstance(chain, ch.ChainMLP) and chain.tail is not None
    assert chain.tail.weight is folded.weight and folded.weight.dtype == torch.float64
    assert [n for n, _ in model.named_parameters()].count("layers.1.fmb.out.weight") == 1
    assert chain.amax.dtype == torch.float32 and "amax" in dict(chain.named_buffers())


def _wukong() -> nn.Module:
    from loka_tune.models.registry import build_model

    torch.manual_seed(0)
    return build_model("wukong", preset="tiny", num_dense=13, cardinalities=[100] * 8, fmb_mlp=(256, 256),
                       head_mlp=(256, 256), dense_mlp=(256,), activation="silu")


def _config(chain: bool):  # noqa: ANN202
    from loka_tune.config import PrecisionConfig

    return PrecisionConfig(mods={**MODS, "fp8_chain": chain}, sites={r"re:.*mlp\.\d+\.linear": TW, r"re:.*fmb\.out": TW})


def _batch(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 13, generator=g), torch.randint(0, 100, (n, 8), generator=g)


def test_apply_runs_each_wukong_mlp_of_tensorwise_sites_as_a_chain_and_keeps_the_state_dict() -> None:
    from loka_tune import apply
    from loka_tune.kernels import chain as ch

    plain = _wukong()
    apply(plain, _config(False), strict=False)
    m = _wukong()
    s = apply(m, _config(True), strict=False)
    assert list(m.state_dict()) == list(plain.state_dict())  # the same keys as without the chains
    assert set(s.chains) == {"layers.0.fmb.mlp", "layers.1.fmb.mlp", "head_mlp"}
    # an FMB's MLP from its second block (the first's K, 36, is not a multiple of 16), with the FMB's out as tail
    assert s.chains["layers.0.fmb.mlp"] == ["layers.0.fmb.mlp.1.linear", "layers.0.fmb.out"]
    assert s.chains["layers.1.fmb.mlp"] == ["layers.1.fmb.mlp.0.linear", "layers.1.fmb.mlp.1.linear", "layers.1.fmb.out"]
    assert "multiples of 16, got 13 x 256" in s.chain_skipped["dense_mlp"]
    assert isinstance(m.get_submodule("layers.0.fmb.out"), ch.FoldedTail) and "FP8 chains" in str(s)
    assert s.to_dict()["chained"]["head_mlp.0.linear"] == TW and not set(s.chained) & set(s.fallbacks)
    for site in s.chained:
        assert s.n_sites == len(s.shapes) and site not in s.replaced
    m.load_state_dict(plain.state_dict())  # the same weights: FP8 error apart from the plain model
    x, sp = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = plain(x, sp).float()
        out = m(x, sp).float()  # the chains' first call: their own amaxes (self-calibration)
    out.sum().backward()
    assert all(c.calibrated for c in m.modules() if isinstance(c, ch.ChainMLP))
    # the Mod's chains cast their gradients to e5m2, as torchao's tensorwise recipe (GRAD_FORMAT)
    assert {c.grad_format for c in m.modules() if isinstance(c, ch.ChainMLP)} == {"e5m2"} == {ch.GRAD_FORMAT}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out2 = m(x, sp).float()  # delayed scales from the first call
    from loka_tune.kernels.quant import sqnr_db

    assert sqnr_db(ref, out) > 15.0 and sqnr_db(ref, out2) > 15.0
    assert all(p.grad is None or p.grad.is_sparse or torch.isfinite(p.grad).all() for p in m.parameters())


def test_apply_again_keeps_or_undoes_the_chains_and_restores_the_model_on_error() -> None:
    from loka_tune import apply
    from loka_tune.config import PrecisionConfig
    from loka_tune.errors import ConfigError
    from loka_tune.kernels import chain as ch
    from loka_tune.models.base import MLP

    m = _wukong()
    first = apply(m, _config(True), strict=False)
    again = apply(m, _config(True), strict=False)
    assert again.chained == first.chained
    tree = [(n, type(x).__name__) for n, x in m.named_modules()]
    with pytest.raises(ConfigError):  # a rule that matches no layer (strict): the model stays as it was
        apply(m, PrecisionConfig(mods={**MODS, "fp8_chain": True}, sites={"no.such.site": TW}))
    assert [(n, type(x).__name__) for n, x in m.named_modules()] == tree
    off = apply(m, _config(False), strict=False)
    assert not off.chained and not any(isinstance(x, (ch.ChainMLP, ch.FoldedTail)) for x in m.modules())
    assert isinstance(m.get_submodule("head_mlp"), MLP) and type(m.get_submodule("layers.0.fmb.out")) is nn.Linear


def test_the_fp8_chain_mod_is_data_and_says_what_it_needs() -> None:
    from loka_tune.config import ModsConfig, PrecisionConfig
    from loka_tune.errors import ConfigError

    on = ModsConfig(**MODS, fp8_chain=True)
    assert on.short_str() == "nobias+bn256+hswish+chain" and on.passes == ModsConfig(**MODS) and on.any
    assert ModsConfig.from_dict(on.to_dict()) == on and "fp8_chain" not in ModsConfig(**MODS).to_dict()
    cfg = PrecisionConfig(mods=on)
    assert PrecisionConfig.from_dict(cfg.to_dict()) == cfg and cfg.key() != PrecisionConfig(mods=ModsConfig(**MODS)).key()
    with pytest.raises(ConfigError, match="turn on no_bias, blocknorm = 256 and hardswish"):
        ModsConfig(fp8_chain=True)
    with pytest.raises(ConfigError, match="fp8_chain and fuse_epilogue both take"):
        ModsConfig(**MODS, fp8_chain=True, fuse_epilogue=True)
    with pytest.raises(ConfigError, match="expected true or false"):
        ModsConfig(**MODS, fp8_chain="yes")  # type: ignore[arg-type]


def test_an_uncalibrated_chain_compiles_twice_then_stays_one_graph() -> None:
    """Its first call casts with its own amaxes, then it flips to delayed scales: one recompile."""
    from torch._dynamo.utils import counters

    from loka_tune.kernels import chain as ch

    torch._dynamo.reset()
    counters.clear()
    b0 = MLPBlock(64, 256, norm="none", activation="relu", bias=False)
    b1 = MLPBlock(256, 256, norm="none", activation="relu", bias=False)
    for b in (b0, b1):
        b.norm, b.act = BlockNorm(256), nn.Hardswish()
    m = ch.ChainMLP([b0, b1])
    cm = torch.compile(m, fullgraph=True)
    for i in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = cm(torch.randn(32, 64))
        out.float().square().sum().backward()
        assert m.calibrated and bool((m.amax > 0).all()), i
    assert counters["stats"]["unique_graphs"] == 2


def test_the_space_searches_fp8_chain_only_where_its_blocks_exist(tmp_path) -> None:  # noqa: ANN001
    from pathlib import Path

    from loka_tune.config import ModsConfig
    from loka_tune.errors import ConfigError
    from loka_tune.mods.search import mod_choices, mods_from_params, mods_to_params
    from loka_tune.tuner.study import load_study

    assert mod_choices(include=("fp8_chain",)) == {"fp8_chain": [False, True]}
    assert mods_from_params({"mods.fp8_chain": True}) == ModsConfig()  # no blocks to chain: the trial without it
    assert not mods_from_params({"mods.no_bias": True, "mods.blocknorm": 128, "mods.hardswish": True,
                                 "mods.fp8_chain": True}).fp8_chain
    both = mods_from_params({"mods.no_bias": True, "mods.blocknorm": 256, "mods.hardswish": True,
                             "mods.fuse_epilogue": True, "mods.fp8_chain": True})
    assert both.fp8_chain and not both.fuse_epilogue and mods_from_params(mods_to_params(both)) == both
    text = (Path(__file__).resolve().parents[1] / "studies" / "quickstart.toml").read_text()
    assert 'mods = ["no_bias"]' in text

    def study(mods: str, extra: str = "") -> object:
        p = tmp_path / "s.toml"
        p.write_text(text.replace('mods = ["no_bias"]', f"mods = {mods}{extra}"))
        return load_study(p)

    ok = study('["no_bias", "blocknorm", "hardswish", "fp8_chain"]', "\nblocknorm_sizes = [256]")
    assert "fp8_chain" in ok.space.mods  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="'fp8_chain' runs MLPs of bias-free"):
        study('["fp8_chain"]')
    with pytest.raises(ConfigError, match="keep one of them"):
        study('["no_bias", "blocknorm", "hardswish", "fp8_chain", "fuse_epilogue"]', "\nblocknorm_sizes = [256]")
    with pytest.raises(ConfigError, match="add 256 to blocknorm_sizes"):
        study('["no_bias", "blocknorm", "hardswish", "fp8_chain"]', "\nblocknorm_sizes = [128]")


def test_the_trainer_calibrates_the_chains_before_its_first_compiled_step() -> None:
    """TrainStep fills an applied model's chain amaxes from its first batch, eagerly: the compiled
    step then traces the delayed-scale graph once (one graph, no recompile)."""
    from loka_tune import apply
    from loka_tune.data.base import Batch
    from loka_tune.kernels import chain as ch
    from loka_tune.objectives.compiled import strict_compile
    from loka_tune.objectives.step import TrainStep

    m = _wukong()
    apply(m, _config(True), strict=False)
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=1e-3)
    step = TrainStep(m, [opt], device=torch.device("cpu"), dtype=torch.bfloat16, compile=True)
    x, sp = _batch()
    batch = Batch(dense=x, sparse=sp, labels=(torch.rand(64) < 0.3).float())
    with strict_compile() as report:
        losses = [float(step(batch)) for _ in range(2)]
    assert all(c.calibrated for c in m.modules() if isinstance(c, ch.ChainMLP))
    assert report["unique_graphs"] == 1 and all(torch.isfinite(torch.tensor(losses)))  # no recompile


@pytest.mark.gpu
def test_the_fp8_chain_mod_trains_compiled_on_a_gpu_within_fp8_error_of_the_unchained_config() -> None:
    """The product's path on a GPU: apply makes the chains (the Triton kernels), the trainer
    calibrates them and compiles one graph; the chained model's output is within FP8 error of the
    same config without chains (LokaLinear, dynamic scales), on the same weights."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from loka_tune import apply
    from loka_tune.data.base import Batch
    from loka_tune.kernels import chain as ch
    from loka_tune.kernels.quant import sqnr_db
    from loka_tune.objectives.compiled import strict_compile
    from loka_tune.objectives.step import TrainStep

    dev = torch.device("cuda")
    plain, m = _wukong().to(dev), _wukong().to(dev)
    apply(plain, _config(False), strict=False)
    s = apply(m, _config(True), strict=False)
    m.load_state_dict(plain.state_dict())
    assert set(s.chains) == {"layers.0.fmb.mlp", "layers.1.fmb.mlp", "head_mlp"}, (s.chains, s.chain_skipped)
    x, sp = (t.to(dev) for t in _batch(1024))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        ref, out = plain(x, sp).float(), m(x, sp).float()
    assert sqnr_db(ref, out) > 15.0
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad and not p.is_sparse], lr=1e-3)
    step = TrainStep(m, [opt], device=dev, dtype=torch.bfloat16, compile=True)
    batch = Batch(dense=x, sparse=sp, labels=(torch.rand(1024, device=dev) < 0.3).float())
    with strict_compile() as report:
        losses = torch.stack([step(batch) for _ in range(3)]).float().cpu()
    assert torch.isfinite(losses).all() and report["unique_graphs"] == 1
    assert all(c.calibrated and bool((c.amax > 0).all()) for c in m.modules() if isinstance(c, ch.ChainMLP))
