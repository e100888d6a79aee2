"""``loka_tune.applier``: swapping linears per a PrecisionConfig, errors, idempotence, training."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from loka_tune.applier import ApplySummary, apply, as_config, export, load_config
from loka_tune.config import BF16, GemmChoice, ModsConfig, PrecisionConfig, SitePrecision
from loka_tune.errors import BackendError, ConfigError, UnsupportedChoiceError
from loka_tune.kernels.linear import LokaLinear, find_linears
from loka_tune.kernels.quant import sqnr_db
from loka_tune.kernels.registry import Backend, register_backend, unregister_backend
from loka_tune.models import build_model


class Toy(nn.Module):
    """Nested Sequential + ModuleDict, a Linear applied to a 3-D (B, n, d) tensor, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(13, 32)
        self.blocks = nn.ModuleDict(
            {
                "a": nn.Sequential(
                    nn.Linear(32, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 48), nn.LayerNorm(48))
                ),
                "b": nn.Linear(48, 33),
            }
        )
        self.token = nn.Linear(8, 8)  # over (B, 4, 8)
        self.head = nn.Linear(33 + 32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 13) -> (B,)
        h = torch.relu(self.embed(x))  # (B, 32)
        t = self.token(h.reshape(-1, 4, 8))  # (B, 4, 8)
        h = self.blocks["b"](self.blocks["a"](h))  # (B, 33)
        return self.head(torch.cat([h, t.flatten(1)], dim=1)).squeeze(1)


SITES = ["embed", "blocks.a.0", "blocks.a.2.0", "blocks.b", "token", "head"]

MIXED = PrecisionConfig.from_sites(
    {
        "blocks.a.0": "e4m3.tensor.emulated|e5m2+e4m3.tensor.emulated|e4m3.block.emulated",
        "re:blocks\\.a\\.2\\..*": "mxfp8.mx.emulated",
        "token": "e4m3.block.pow2.emulated",
        "head": "bf16",
    },
    default="e4m3.row.emulated|e5m2+e4m3.row.emulated|e4m3.row.emulated",
)


def _toy(seed: int = 0) -> Toy:
    torch.manual_seed(seed)
    return Toy()


def _batch(step: int, b: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(b, 13, generator=g)
    y = (x[:, :3].sum(1) + 0.5 * x[:, 3] * x[:, 4] > 0).float()  # learnable labels
    return x, y


def _train(model: nn.Module, steps: int) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for s in range(steps):
        x, y = _batch(s)
        loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


# ---------------------------------------------------------------------------- the swap
def test_find_linears_on_toy() -> None:
    assert list(find_linears(_toy())) == SITES


def test_apply_mixed_config_swaps_in_place_and_shares_parameters() -> None:
    model = _toy()
    params_before = {n: p for n, p in model.named_parameters()}
    summary = apply(model, MIXED)
    assert isinstance(summary, ApplySummary)
    assert summary.unchanged == ["head"]
    assert sorted(summary.replaced) == sorted(SITES[:-1])
    assert summary.replaced["blocks.a.2.0"] == "mxfp8.mx.emulated"
    assert summary.replaced["embed"] == "e4m3.row.emulated|e5m2+e4m3.row.emulated|e4m3.row.emulated"
    assert summary.shapes["token"] == (8, 8)
    assert sum(summary.counts.values()) == 3 * len(SITES)
    assert summary.counts["bf16"] == 3 and summary.counts["mxfp8.mx.emulated"] == 3
    assert summary.counts["e4m3.row.emulated"] == 2 * 2  # fwd + wgrad of embed and blocks.b
    # the modules in their nested homes
    assert isinstance(model.blocks["a"][0], LokaLinear)
    assert isinstance(model.blocks["a"][2][0], LokaLinear)
    assert isinstance(model.blocks["b"], LokaLinear)
    assert type(model.head) is nn.Linear
    assert model.blocks["a"][0].precision.wgrad.short_str() == "e4m3.block.emulated"
    # parameters are shared, not copied: an optimizer built before apply still trains the model
    assert all(p is params_before[n] for n, p in model.named_parameters())
    text = str(summary)
    for site in SITES:
        assert site in text
    assert "mxfp8.mx.emulated" in text and "bf16 (nn.Linear)" in text
    assert json.loads(json.dumps(summary.to_dict()))["unchanged"] == ["head"]


def test_apply_trains_and_matches_the_unquantized_model() -> None:
    ref = _toy(seed=1)
    model = copy.deepcopy(ref)
    apply(model, MIXED)
    x, _ = _batch(999, b=256)
    with torch.no_grad():
        assert sqnr_db(ref(x), model(x)) >= 17.0
    losses = _train(model, 50)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10  # it learns
    for m in model.modules():
        if isinstance(m, LokaLinear):
            assert m.nonfinite_fallbacks == 0
    # the trained state dict loads into the unmodified model, and back
    plain = _toy(seed=2)
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        y_plain, y_q = plain(x), model(x)
    assert sqnr_db(y_plain, y_q) >= 17.0
    fresh = _toy(seed=3)
    apply(fresh, MIXED)
    fresh.load_state_dict(plain.state_dict())
    with torch.no_grad():
        assert torch.equal(fresh(x), y_q)


def test_apply_is_idempotent_and_updates_precision() -> None:
    model = _toy()
    x, _ = _batch(5)
    s1 = apply(model, MIXED)
    mods1 = {n: m for n, m in model.named_modules()}
    with torch.no_grad():
        y1 = model(x)
    s2 = apply(model, MIXED)
    assert s2.replaced == s1.replaced and s2.unchanged == s1.unchanged and s2.counts == s1.counts
    assert all(mods1[n] is m for n, m in model.named_modules())  # same module objects
    with torch.no_grad():
        assert torch.equal(model(x), y1)
    # another config: precisions update in place, a LokaLinear that becomes plain bf16 turns
    # back into an nn.Linear sharing its parameters, and a bf16 site becomes a LokaLinear
    other = PrecisionConfig.from_sites({"head": "e4m3.row.emulated"}, default="bf16")
    w = model.embed.weight
    s3 = apply(model, other)
    assert list(s3.replaced) == ["head"] and isinstance(model.head, LokaLinear)
    assert type(model.embed) is nn.Linear and model.embed.weight is w
    apply(model, PrecisionConfig())
    assert not any(isinstance(m, LokaLinear) for m in model.modules())
    ref = _toy()
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_applied_model_compiles_without_graph_breaks() -> None:
    torch._dynamo.reset()
    model = _toy()
    apply(model, MIXED)
    x, y = _batch(3)
    eager_loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
    eager_loss.backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss = nn.functional.binary_cross_entropy_with_logits(compiled(x), y)
    loss.backward()
    torch.testing.assert_close(loss, eager_loss)
    for p, g in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(p.grad, g)


def test_shared_linear_is_swapped_everywhere() -> None:
    shared = nn.Linear(4, 4)
    model = nn.ModuleDict({"a": nn.Sequential(shared, nn.ReLU()), "b": shared})
    s = apply(model, PrecisionConfig(default=SitePrecision.uniform("e4m3.row.emulated")))
    assert list(s.replaced) == ["a.0"]
    assert model["a"][0] is model["b"] and isinstance(model["b"], LokaLinear)


def test_config_inputs_export_and_load(tmp_path: Path) -> None:
    path = export(MIXED, tmp_path / "cfg.json")
    assert load_config(path) == MIXED
    assert as_config(str(path)) == MIXED and as_config(MIXED.to_dict()) == MIXED
    for cfg in (str(path), path, MIXED.to_dict()):
        model = _toy()
        s = apply(model, cfg)
        assert s.unchanged == ["head"]
    with pytest.raises(ConfigError) as ei:
        apply(_toy(), tmp_path / "missing.json")
    assert ei.value.key is None and ei.value.path == str(tmp_path / "missing.json")
    with pytest.raises(ConfigError):
        apply(_toy(), 42)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="single nn.Linear"):
        apply(nn.Linear(3, 3), MIXED)


# ------------------------------------------------------------------------------ errors
def test_rule_matching_no_linear_names_it_and_lists_real_sites() -> None:
    cfg = PrecisionConfig.from_sites({"blocks.a.1": "e4m3.row.emulated", "re:nothing.*": "bf16"})
    with pytest.raises(ConfigError) as ei:
        apply(_toy(), cfg)
    msg = str(ei.value)
    assert ei.value.key == "sites.blocks.a.1"
    assert "'blocks.a.1'" in msg and "blocks.a.0" in msg and "re:nothing.*" in msg


def test_unknown_backend_names_the_site() -> None:
    cfg = PrecisionConfig.from_sites({"token": "e4m3.row.nosuchbackend"})
    for strict in (True, False):
        with pytest.raises(BackendError) as ei:
            apply(_toy(), cfg, strict=strict)
        assert "token" in str(ei.value) and "nosuchbackend" in str(ei.value) and "emulated" in str(ei.value)


@pytest.fixture
def cuda_only_backend():  # type: ignore[no-untyped-def]
    @register_backend("cudaonly")
    class CudaOnly(Backend):
        devices = frozenset({"cuda"})
        alignment = 16

        def gemm(self, a, b, choice, role):  # type: ignore[no-untyped-def]
            raise AssertionError("never called on CPU")

    yield CudaOnly
    unregister_backend("cudaonly")


def test_unsupported_choice_strict_and_fallback(cuda_only_backend) -> None:  # type: ignore[no-untyped-def]
    cfg = PrecisionConfig.from_sites({"token": "e4m3.row.cudaonly|e4m3.row.emulated|e4m3.row.cudaonly"})
    model = _toy()
    with pytest.raises(UnsupportedChoiceError) as ei:
        apply(model, cfg)
    msg = str(ei.value)
    assert "'token'" in msg and "e4m3.row.cudaonly" in msg and "devices ['cuda']" in msg and "strict=False" in msg
    assert type(model.token) is nn.Linear  # nothing swapped on error
    s = apply(model, cfg, strict=False)
    assert set(s.fallbacks["token"]) == {"fwd", "wgrad"}
    assert "device 'cpu'" in s.fallbacks["token"]["fwd"]
    assert model.token.precision == SitePrecision(BF16, GemmChoice.parse("e4m3.row.emulated"), BF16)
    assert "fallback to bf16" in str(s)
    x, _ = _batch(0)
    model(x).sum().backward()  # runs on CPU with the fallbacks


def test_missing_gpu_backend_strict_and_fallback() -> None:
    if "fbgemm_gpu" in sys.modules or torch.cuda.is_available():
        pytest.skip("checks the error without a GPU backend; fbgemm_gpu or a CUDA GPU is present")
    cfg = PrecisionConfig.from_sites({"token": "e4m3.row.fbgemm"})
    with pytest.raises(UnsupportedChoiceError) as ei:
        apply(_toy(), cfg)
    assert "'token'" in str(ei.value) and "fbgemm" in str(ei.value)
    s = apply(_toy(), cfg, strict=False)
    assert set(s.fallbacks["token"]) == {"fwd", "dgrad", "wgrad"} and s.unchanged == SITES


# -------------------------------------------------------------------------------- mods
def test_mods_run_first_and_once() -> None:
    cfg = PrecisionConfig(default=SitePrecision.uniform("e4m3.row.emulated"), mods=ModsConfig(no_bias=True))
    model = _toy()
    s = apply(model, cfg)
    assert s.mods is not None and "no_bias" in s.mods
    assert model.embed.bias is None and model.blocks["b"].bias is None
    assert model.head.bias is not None  # the prediction head keeps its bias
    assert isinstance(model.embed, LokaLinear)
    x, _ = _batch(1)
    model(x).sum().backward()
    s2 = apply(model, cfg)
    assert s2.mods is None and "already applied" in s2.mods_note and "already applied" in str(s2)


def _structure(model: nn.Module) -> list[tuple[str, str, bool, tuple[int, ...]]]:
    """Every module's name, class, whether it has a bias, and its parameters' identities."""
    return [(n, type(m).__name__, getattr(m, "bias", None) is not None,
             tuple(id(p) for p in m.parameters(recurse=False))) for n, m in model.named_modules()]


@pytest.mark.parametrize("bad", [
    {"blocks.a.1": "e4m3.row.emulated"},  # a site name that matches nothing (found after the Mods ran)
    {"token": "e4m3.row.fbgemm" if not torch.cuda.is_available() else "e4m3.row.nosuchbackend"},
    {"token": "e4m3.row.nosuchbackend"},  # an unknown backend
], ids=["unmatched-site", "unavailable-backend", "unknown-backend"])
def test_apply_is_all_or_nothing(bad: dict[str, str]) -> None:
    mods = ModsConfig(no_bias=True)
    model = _toy()
    before = _structure(model)
    biased = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m.bias is not None]
    assert len(biased) == 6
    with pytest.raises((ConfigError, BackendError)):
        apply(model, PrecisionConfig.from_sites(bad, default="e4m3.row.emulated", mods=mods))
    assert _structure(model) == before  # every bias still there, nothing swapped
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    # the corrected config removes the biases and says so (the failed call left no "applied" mark)
    s = apply(model, PrecisionConfig.from_sites({"token": "e4m3.row.emulated"}, mods=mods))
    assert s.mods is not None and "no_bias" in s.mods and "no_bias" in str(s)
    assert model.embed.bias is None and model.head.bias is not None


def test_apply_restores_a_model_applied_before() -> None:
    """A model applied with fused epilogues: a failing second apply leaves it fused (apply unfuses
    before it checks the new config's site names)."""
    from loka_tune.kernels.fused import FusedLinearBlockNormHardswish

    torch.manual_seed(0)
    model = build_model("wukong", "tiny", num_dense=13, cardinalities=[50] * 8, activation="silu")
    mods = ModsConfig(blocknorm=8, hardswish=True, fuse_epilogue=True)
    s = apply(model, PrecisionConfig.from_sites({"head": "bf16"}, default="e4m3.row.emulated", mods=mods))
    assert s.fused
    before = _structure(model)
    precisions = {n: m.precision for n, m in model.named_modules() if isinstance(m, LokaLinear)}
    with pytest.raises(ConfigError, match="'nope'"):
        apply(model, PrecisionConfig.from_sites({"nope": "bf16"}, default="e4m3.row.emulated", mods=mods))
    assert _structure(model) == before
    assert sorted(n for n, m in model.named_modules() if isinstance(m, FusedLinearBlockNormHardswish)) == sorted(s.fused)
    assert {n: m.precision for n, m in model.named_modules() if isinstance(m, LokaLinear)} == precisions


def test_strict_false_skips_rules_that_match_nothing_and_says_so() -> None:
    cfg = PrecisionConfig.from_sites({"blocks.a.1": "e4m3.row.emulated", "token": "e4m3.block.emulated"})
    with pytest.raises(ConfigError, match="strict=False"):
        apply(_toy(), cfg)
    model = _toy()
    s = apply(model, cfg, strict=False)
    assert s.unmatched == ["blocks.a.1"] and s.to_dict()["unmatched"] == ["blocks.a.1"]
    assert list(s.replaced) == ["token"] and isinstance(model.token, LokaLinear)
    assert "skipped 1 rule(s) that match no linear layer (strict=False): 'blocks.a.1'" in str(s)
    assert "skipped" not in str(apply(_toy(), PrecisionConfig.from_sites({"token": "e4m3.row.emulated"})))


# ------------------------------------------------------------------ reference models
@pytest.mark.parametrize("name", ["dlrm", "dcnv2", "wukong"])
def test_reference_models(name: str) -> None:
    torch.manual_seed(0)
    ref = build_model(name, "tiny", num_dense=13, cardinalities=[50] * 8)
    model = copy.deepcopy(ref)
    sites = list(find_linears(model))
    cfg = PrecisionConfig.from_sites(
        {
            "head": "bf16",
            "re:.*\\.linear": "e4m3.block.emulated|e5m2+e4m3.block.emulated|mxfp8.mx.emulated",
        },
        default="e4m3.row.emulated|e5m2+e4m3.row.emulated|e4m3.tensor.pow2.emulated",
    )
    s = apply(model, cfg)
    assert s.unchanged == ["head"] and len(s.replaced) == len(sites) - 1

    def batch(step: int, b: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        dense = torch.randn(b, 13, generator=g)
        sparse = torch.randint(0, 50, (b, 8), generator=g)
        y = ((dense[:, 0] + (sparse[:, 0] % 2) - 0.5) > 0).float()
        return dense, sparse, y

    dense, sparse, _ = batch(10_000, b=256)
    model.eval(), ref.eval()
    with torch.no_grad():
        assert sqnr_db(ref(dense, sparse), model(dense, sparse)) >= 17.0
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)  # embedding grads may be sparse
    for step in range(50):
        d, sp, y = batch(step)
        loss = nn.functional.binary_cross_entropy_with_logits(model(d, sp), y)
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    plain = build_model(name, "tiny", num_dense=13, cardinalities=[50] * 8)
    plain.load_state_dict(model.state_dict())
    plain.eval(), model.eval()
    with torch.no_grad():
        assert sqnr_db(plain(dense, sparse), model(dense, sparse)) >= 17.0
    back = copy.deepcopy(ref)
    apply(back, cfg)
    back.load_state_dict(plain.state_dict())
    back.eval()
    with torch.no_grad():
        assert torch.equal(back(dense, sparse), model(dense, sparse))


def test_top_level_apply_is_the_function_even_after_submodule_import(tmp_path):
    """``loka_tune.apply(model, path)`` is the one-line user API: importing the module that
    implements it must not shadow it (the module is ``loka_tune.applier``)."""
    import torch.nn as nn

    import loka_tune
    import loka_tune.applier  # noqa: F401  (would shadow a same-named submodule)
    from loka_tune.config import PrecisionConfig

    path = PrecisionConfig.from_sites({"0": "e4m3.row.emulated"}).save(tmp_path / "c.json")
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    summary = loka_tune.apply(model, path)
    assert callable(loka_tune.apply)
    assert "0" in summary.replaced
