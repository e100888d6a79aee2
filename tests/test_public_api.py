"""The public API (issue 12, R3): the grouped top-level names, the sub-packages' cut ``__all__``s
and the named recipes of ``PrecisionConfig.from_recipe``."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import loka_tune
from loka_tune.config import GemmRole, PrecisionConfig
from loka_tune.errors import ConfigError, LokaError
from loka_tune.kernels.quant import sqnr_db

REPO = Path(__file__).resolve().parents[1]

WORKFLOW = ["load_study", "run_study", "export_best", "load_config", "apply", "export", "Probe", "measure",
            "build_plan", "recipe_config", "build_model", "TrainConfig", "train"]


def test_top_level_lists_the_workflow_and_every_name_resolves() -> None:
    names = loka_tune.__all__
    assert set(WORKFLOW) <= set(names)
    # the verbs of one workflow appear in its order
    pos = [names.index(n) for n in ("load_study", "run_study", "export_best", "apply")]
    assert pos == sorted(pos)
    for name in names:
        assert getattr(loka_tune, name) is not None, name
    for err in ("ConfigError", "DataError", "BackendError", "ProbeError", "StudyError", "ModError"):
        assert issubclass(getattr(loka_tune, err), LokaError)
    assert loka_tune.__version__ == importlib.import_module("loka_tune.version").__version__


def test_unknown_top_level_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError):
        loka_tune.not_a_public_name  # noqa: B018


def test_import_loka_tune_stays_light() -> None:
    code = ("import sys, loka_tune; loka_tune.PrecisionConfig.from_recipe('rowwise');"
            "heavy = [m for m in ('torch', 'optuna', 'mlflow', 'triton', 'torchao') if m in sys.modules];"
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


@pytest.mark.parametrize("pkg", ["probe", "mods", "space", "objectives", "tuner", "models", "data", "kernels"])
def test_subpackage_all_is_small_and_resolves(pkg: str) -> None:
    mod = importlib.import_module(f"loka_tune.{pkg}")
    assert 0 < len(mod.__all__) <= 16, f"loka_tune.{pkg} makes {len(mod.__all__)} names public"
    for name in mod.__all__:
        assert not name.startswith("_")
        assert getattr(mod, name) is not None, f"loka_tune.{pkg}.{name}"


# ------------------------------------------------------------------------------------- recipes
@pytest.mark.parametrize("name, fwd, dgrad, wgrad", [
    ("bf16", "bf16", "bf16", "bf16"),
    ("tensorwise", "e4m3.tensor.torch_scaled_mm", "e4m3.tensor.torch_scaled_mm", "e4m3.tensor.torch_scaled_mm"),
    ("tensorwise_fa", "e4m3.tensor.fa.torch_scaled_mm", "e4m3.tensor.fa.torch_scaled_mm", "e4m3.tensor.fa.torch_scaled_mm"),
    ("rowwise", "e4m3.row.pow2.torch_scaled_mm", "e4m3.row.pow2.torch_scaled_mm", "e4m3.row.pow2.torch_scaled_mm"),
    ("rowwise_with_gw_hp", "e4m3.row.pow2.torch_scaled_mm", "e4m3.row.pow2.torch_scaled_mm", "bf16"),
])
def test_uniform_recipes(name: str, fwd: str, dgrad: str, wgrad: str) -> None:
    cfg = PrecisionConfig.from_recipe(name)
    assert [cfg.default[r].short_str() for r in GemmRole] == [fwd, dgrad, wgrad]
    assert cfg.sites == () and cfg.provenance["recipe"] == name
    # a recipe is an ordinary config: it survives its JSON form
    assert PrecisionConfig.from_json(cfg.to_json()).key() == cfg.key()


def test_recipe_backend_and_mods() -> None:
    from loka_tune.config import ModsConfig

    cfg = PrecisionConfig.from_recipe("tensorwise", backend="torchao", mods=ModsConfig(no_bias=True))
    assert cfg.default.fwd.backend == "torchao" and cfg.mods.no_bias


def test_mods_given_as_a_mapping_become_a_mods_config_that_saves(tmp_path: Path) -> None:
    """``mods={"no_bias": True}`` (the JSON file's form) is taken everywhere a config is made;
    it once stayed a dict and broke ``save``."""
    from loka_tune.config import ModsConfig

    cfg = PrecisionConfig.from_recipe("rowwise", backend="emulated", mods={"no_bias": True, "blocknorm": 256})
    assert cfg.mods == ModsConfig(no_bias=True, blocknorm=256)
    cfg.save(tmp_path / "c.json")
    assert PrecisionConfig.load(tmp_path / "c.json") == cfg
    assert PrecisionConfig(mods={"hardswish": True}).mods.hardswish
    assert PrecisionConfig.from_sites({}, mods={"pad": 16}).mods.pad == 16
    with pytest.raises(ConfigError, match=r"mods: unknown key\(s\) \['nobias'\]"):
        PrecisionConfig.from_recipe("bf16", mods={"nobias": True})
    with pytest.raises(ConfigError, match="got 'no_bias'; mods take a ModsConfig or a mapping"):
        PrecisionConfig.from_recipe("bf16", mods="no_bias")


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="rowwize"), "unknown recipe 'rowwize'; choose one of bf16, tensorwise, tensorwise_fa, rowwise"),
    (dict(name="dispatch"), "built from a probe report: call loka_tune.recipe_config"),
    (dict(name="rowwise", report=object()), "report belong"),
    (dict(name="rowwise", max_error=0.1), "max_error belong"),
    (dict(name="rowwise", backend="bf16"), "name an FP8 backend"),
    (dict(name="rowwise", backend="Bad-Name"), "a backend name is lower-case"),
])
def test_recipe_errors_quote_the_value_and_the_fix(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        PrecisionConfig.from_recipe(**kwargs)


def test_dispatch_recipe_is_build_plan_of_the_report() -> None:
    from loka_tune.config import ModsConfig
    from loka_tune.dispatch import build_plan

    rep = []  # candidate records as Dispatch reads them (a probe report's results, here plain dicts)
    for role in GemmRole:
        m, k, n = role.shape(4096, 1024, 512)
        for choice, mere, speedup in (("e4m3.row.emulated", 0.01, 1.4), ("e4m3.tensor.emulated", 0.5, 1.6)):
            rep.append({"site": "mlp.0", "role": role.value, "choice": choice, "m": m, "k": k, "n": n,
                        "mere": mere, "speedup": speedup, "time_source": "modeled"})
    cfg = loka_tune.recipe_config("dispatch", report=rep, mods=ModsConfig(no_bias=True), resolve_emulated=False)
    want = build_plan(rep, resolve_emulated=False)
    with pytest.raises(ConfigError, match="recipe_config"):  # the vocabulary does not import Dispatch
        PrecisionConfig.from_recipe("dispatch", report=rep)
    with pytest.raises(ConfigError, match="built from a probe report: pass report="):
        loka_tune.recipe_config("dispatch")
    assert cfg.resolve("mlp.0") == want.resolve("mlp.0")
    assert cfg.resolve("mlp.0").fwd.short_str() == "e4m3.row.emulated"  # the accurate one, not the faster unsafe one
    assert cfg.mods.no_bias and not want.mods.no_bias


def test_recipe_config_gives_the_uniform_recipes_as_from_recipe() -> None:
    for name in ("bf16", "tensorwise", "tensorwise_fa", "rowwise", "rowwise_with_gw_hp"):
        assert loka_tune.recipe_config(name, backend="emulated", mods={"no_bias": True}) == \
            PrecisionConfig.from_recipe(name, backend="emulated", mods={"no_bias": True})
    with pytest.raises(ConfigError, match="report belong"):
        loka_tune.recipe_config("rowwise", report=[])


def test_recipe_applied_to_a_model_runs_fp8_and_stays_close() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    x = torch.randn(256, 64)
    ref = model(x).detach().double()
    summary = loka_tune.apply(model, PrecisionConfig.from_recipe("rowwise", backend="emulated"))
    assert summary is not None
    lins = [m for m in model.modules() if isinstance(m, loka_tune.LokaLinear)]
    assert len(lins) == 2
    out = model(x).detach().double()
    db = float(sqnr_db(ref, out))
    assert 20.0 < db < 60.0, db  # e4m3 rowwise: about 30 dB, far from bf16-exact and far from noise
