"""The search space: site discovery, eligibility, probe pruning, and the Optuna encoding."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from loka_tune.config import GemmChoice, ModsConfig, PrecisionConfig, SitePrecision
from loka_tune.space import (
    SearchSpace,
    build_space,
    config_from_params,
    discover_sites,
    params_from_config,
    prune_by_probe,
)
from loka_tune.space.candidates import enumerate_candidates
from loka_tune.space.encode import distributions, mods_dims, param_name, params_picking, suggest
from loka_tune.space.sites import Site

ROW = "e4m3.row.emulated"
TEN = "e4m3.tensor.emulated"
E5 = "e5m2+e4m3.row.emulated"


class Toy(nn.Module):
    """(B, 13) dense -> (B, 4, 32) tokens -> a per-token linear; one linear used twice, one unused."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(13, 128)
        self.tok = nn.Linear(32, 48)
        self.shared = nn.Linear(48, 48)
        self.unused = nn.Linear(48, 48)
        self.head = nn.Linear(48 * 4, 1)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x = self.inp(dense).view(-1, 4, 32)  # (B, 4, 32)
        x = self.shared(self.shared(self.tok(x)))  # (B, 4, 48), twice through shared
        return self.head(x.flatten(1)).squeeze(-1)




def test_discover_sites_shapes_from_one_forward() -> None:
    torch.manual_seed(0)
    model = Toy()
    dense, sparse = torch.randn(8, 13), torch.zeros(8, 2, dtype=torch.long)
    sites = {s.name: s for s in discover_sites(model, dense, sparse)}
    assert list(sites) == ["inp", "tok", "shared", "head"]  # module order, 'unused' never called
    assert sites["inp"].rows_per_example == 1.0
    assert sites["tok"].rows_per_example == 4.0  # (B, 4, 32) input -> 4 rows per example
    assert sites["shared"].rows_per_example == 8.0  # called twice
    s = sites["tok"]
    assert (s.in_features, s.out_features) == (32, 48)
    assert s.shape("fwd", 1000) == (4000, 32, 48)
    assert s.shape("wgrad", 1000) == (48, 4000, 32)
    assert Site.from_dict(s.to_dict()) == s
    assert model.training  # mode restored


def _sites() -> list[Site]:
    return [Site("a", 64, 128, 1.0), Site("b", 24, 64, 1.0), Site("c", 8, 8, 1.0), Site("d", 256, 256, 2.0)]


def _fake_supports(choice: GemmChoice, role, device, shape):  # noqa: ANN001
    # pretend the tensorwise kernel cannot run wgrad on this device
    if choice.granularity.value == "tensor" and role.value == "wgrad":
        return "tensorwise wgrad not implemented"
    return None


def _space(per_role: bool = True, mods=None) -> SearchSpace:  # noqa: ANN001
    cands = {"fwd": [GemmChoice.parse(ROW), GemmChoice.parse(TEN)],
             "dgrad": [GemmChoice.parse(ROW), GemmChoice.parse(TEN), GemmChoice.parse(E5)],
             "wgrad": [GemmChoice.parse(ROW), GemmChoice.parse(TEN), GemmChoice.parse(E5)]}
    return build_space(_sites(), cands, batch_size=32, align=16, min_dim=16, per_role=per_role,
                       supports=_fake_supports, mods=mods)


def test_build_space_eligibility_filters() -> None:
    sp = _space()
    a = sp.site("a")
    assert a.choices["fwd"] == ("bf16", ROW, TEN)
    assert a.choices["dgrad"] == ("bf16", ROW, TEN, E5)
    assert a.choices["wgrad"] == ("bf16", ROW, E5)
    assert "not implemented" in a.dropped["wgrad"][TEN]
    b = sp.site("b")  # K = 24 is not a multiple of 16
    assert all(c == ("bf16",) for c in b.choices.values())
    assert "align" in b.dropped["fwd"][ROW]
    c = sp.site("c")  # too small
    assert "min_dim" in c.dropped["fwd"][ROW]
    assert sp.n_fp8_candidates() == 2 * (2 + 3 + 2)
    assert SearchSpace.from_dict(sp.to_dict()) == sp


def test_prune_by_probe_drops_unsafe_and_slow_keeps_unmeasured() -> None:
    sp = _space()
    results = [
        {"site": "a", "role": "fwd", "choice": ROW, "mere": 0.05, "speedup": 1.3},
        {"site": "a", "role": "fwd", "choice": TEN, "mere": 0.5, "speedup": 1.5},  # unsafe
        {"site": "a", "role": "dgrad", "choice": ROW, "mere": 0.05, "speedup": 0.8},  # slow
        {"site": "a", "role": "dgrad", "choice": TEN, "mere": float("nan"), "speedup": 2.0},  # broken
        {"site": "d", "role": "wgrad", "choice": ROW, "mere": 0.01, "speedup": 1.1},
    ]
    p = prune_by_probe(sp, results, max_error=0.2, min_speedup=1.0)
    a = p.site("a")
    assert a.choices["fwd"] == ("bf16", ROW)
    assert a.dropped["fwd"][TEN].startswith("unsafe")
    assert a.choices["dgrad"] == ("bf16", E5)  # E5 not measured: kept
    assert a.dropped["dgrad"][ROW].startswith("slow")
    assert a.dropped["dgrad"][TEN].startswith("unsafe")
    assert a.error["fwd"][ROW] == 0.05 and a.speedup["fwd"][ROW] == 1.3
    assert p.site("d").choices["wgrad"] == ("bf16", ROW, E5)
    # a speed-up override (e.g. the cost model at the target batch) replaces the probe's
    p2 = prune_by_probe(sp, results, max_error=0.2, min_speedup=1.0,
                        speedup=lambda site, role, cid: 2.0 if cid == ROW else 0.5)
    assert p2.site("a").choices["dgrad"] == ("bf16", ROW)
    assert p2.site("d").choices["fwd"] == ("bf16", ROW)


def test_encode_round_trip_per_role() -> None:
    sp = _space(mods=mods_dims(["no_bias", "blocknorm"], blocknorm_sizes=(64,)))
    d = distributions(sp)
    assert param_name("a", "fwd") in d and param_name("b", "fwd") not in d  # bf16-only: no parameter
    assert d["mods.blocknorm"].choices == (None, 64)
    params = {param_name("a", "fwd"): ROW, param_name("a", "dgrad"): E5, param_name("a", "wgrad"): "bf16",
              param_name("d", "fwd"): TEN, param_name("d", "dgrad"): "bf16", param_name("d", "wgrad"): "bf16",
              "mods.no_bias": True, "mods.blocknorm": 64}
    cfg = config_from_params(sp, params)
    assert cfg.resolve("a") == SitePrecision(ROW, E5, "bf16")
    assert cfg.resolve("b").is_bf16 and cfg.resolve("c").is_bf16
    assert cfg.mods == ModsConfig(no_bias=True, blocknorm=64)
    assert [r.pattern for r in cfg.sites] == ["a", "d"]  # bf16 sites give no rule
    back, notes = params_from_config(sp, cfg)
    assert back == params and notes == []
    # same params -> same key (the trial cache key)
    assert config_from_params(sp, dict(params)).key() == cfg.key()


def test_fuse_epilogue_dimension() -> None:
    dims = mods_dims(["blocknorm", "hardswish", "fuse_epilogue"], blocknorm_sizes=(64,))
    assert dims["mods.fuse_epilogue"] == (False, True)
    sp = _space(mods=dims)
    assert distributions(sp)["mods.fuse_epilogue"].choices == (False, True)
    assert SearchSpace.from_dict(sp.to_dict()).mods == sp.mods
    params = {param_name("a", "fwd"): ROW, "mods.blocknorm": 64, "mods.hardswish": True, "mods.fuse_epilogue": True}
    cfg = config_from_params(sp, params)
    assert cfg.mods == ModsConfig(blocknorm=64, hardswish=True, fuse_epilogue=True)
    back, notes = params_from_config(sp, cfg)
    assert notes == [] and back["mods.fuse_epilogue"] is True
    assert config_from_params(sp, back).key() == cfg.key()
    unfused = config_from_params(sp, {**params, "mods.fuse_epilogue": False})
    assert unfused.mods == ModsConfig(blocknorm=64, hardswish=True) and unfused.key() != cfg.key()
    # without BlockNorm or Hard Swish there is no chain: fusion is dropped, same config as unfused
    for off in ({"mods.blocknorm": None}, {"mods.hardswish": False}):
        c = config_from_params(sp, {**params, **off})
        assert c.mods.fuse_epilogue is False
        assert c.key() == config_from_params(sp, {**params, **off, "mods.fuse_epilogue": False}).key()
    lonely = PrecisionConfig.from_sites({"a": ROW}, mods=ModsConfig(blocknorm=64, fuse_epilogue=True))
    _, notes = params_from_config(sp, lonely)
    assert any(n.startswith("mods.fuse_epilogue") and "blocknorm and hardswish" in n for n in notes)
    # a space without the dimension: a fused config is noted and decodes unfused
    sp2 = _space(mods=mods_dims(["blocknorm", "hardswish"], blocknorm_sizes=(64,)))
    p2, notes2 = params_from_config(sp2, cfg)
    assert any("mods.fuse_epilogue" in n and "not searched" in n for n in notes2)
    assert config_from_params(sp2, p2).mods == ModsConfig(blocknorm=64, hardswish=True)


def test_params_from_config_notes_what_does_not_fit() -> None:
    sp = _space()
    cfg = PrecisionConfig.from_sites({"a": f"{TEN}|{TEN}|{TEN}", "b": ROW}, mods=ModsConfig(hardswish=True))
    params, notes = params_from_config(sp, cfg)
    assert params[param_name("a", "wgrad")] == "bf16"  # tensor wgrad is not in the space
    assert params[param_name("a", "fwd")] == TEN
    assert any("a@wgrad" in n for n in notes) and any(n.startswith("b@fwd") for n in notes)
    assert any("hardswish" in n for n in notes)


def test_tied_roles_space() -> None:
    sp = _space(per_role=False)
    d = distributions(sp)
    assert set(d) == {param_name("a", None), param_name("d", None)}
    assert d[param_name("a", None)].choices == ("bf16", ROW)  # only ROW is in all three roles
    cfg = config_from_params(sp, {param_name("a", None): ROW})
    assert cfg.resolve("a") == SitePrecision.uniform(ROW)
    assert params_from_config(sp, cfg)[0][param_name("a", None)] == ROW


def test_pad_rules_match_the_padded_child() -> None:
    sp = _space(mods=mods_dims(["pad"], pad_multiples=(16,)))
    cfg = config_from_params(sp, {param_name("a", "fwd"): ROW, "mods.pad": 16})
    (rule,) = cfg.sites
    assert rule.matches("a") and rule.matches("a.linear") and not rule.matches("ab")
    assert cfg.resolve("a.linear").fwd.short_str() == ROW


def test_params_picking_and_suggest() -> None:
    import optuna

    sp = _space()
    fastest = params_picking(sp, lambda sc, role, ch: ch[-1])
    assert fastest[param_name("a", "dgrad")] == E5
    assert all(v != "bf16" for v in fastest.values())
    trial = optuna.trial.FixedTrial(fastest)
    assert suggest(trial, sp).key() == config_from_params(sp, fastest).key()


def test_enumerate_candidates_from_the_registry() -> None:
    c = enumerate_candidates(["emulated"], ["e4m3", "e5m2"], ["row", "tensor"], ["exact"])
    ids = {r: {x.short_str() for x in v} for r, v in c.items()}
    assert ROW in ids["fwd"] and TEN in ids["fwd"]
    assert not any(i.startswith("e5m2") for i in ids["fwd"])  # e5m2 is for gradients only
    assert E5 in ids["dgrad"] and E5 in ids["wgrad"]
    assert all(not x.is_bf16 for v in c.values() for x in v)
    from loka_tune.errors import StudyError

    with pytest.raises(StudyError, match="no FP8 candidate"):
        enumerate_candidates(["bf16"], ["e4m3"], ["row"], ["exact"])


def test_real_model_space_builds() -> None:
    """A built-in model through the registry's real eligibility (emulated backend)."""
    from loka_tune.models import build_model

    torch.manual_seed(0)
    m = build_model("dlrm", "tiny", num_dense=13, cardinalities=[50] * 4, top_mlp=(64,), bottom_mlp=(32,),
                    embedding_dim=16)
    sites = discover_sites(m, torch.randn(16, 13), torch.randint(0, 50, (16, 4)))
    cands = enumerate_candidates(["emulated"], ["e4m3"], ["row"], ["exact"])
    sp = build_space(sites, cands, batch_size=16)
    names = sp.site_names
    assert "head" in names and sp.site("head").choices["fwd"] == ("bf16",)  # N = 1
    assert any(len(sc.choices["fwd"]) > 1 for sc in sp.sites)
    assert all(re.match(r"^[\w.]+$", n) for n in names)


@pytest.mark.parametrize("per_role", [True, False])
def test_size_is_the_product_of_the_parameters_optuna_sees(per_role: bool) -> None:
    """``SearchSpace.size()`` (computed in ``space.candidates``, which imports nothing of
    ``space.encode``) counts exactly the configurations of ``encode.distributions``."""
    import math

    sp = _space(per_role=per_role, mods=mods_dims(["no_bias", "blocknorm"], blocknorm_sizes=(64, 128)))
    want = math.prod(len(d.choices) for d in distributions(sp).values())
    assert sp.size() == want and want > 3 * 2  # the sites' choices and the two Mods dims
    assert _space(per_role=per_role).size() == math.prod(len(d.choices) for d in distributions(_space(per_role=per_role)).values())


def test_enumerate_candidates_imports_only_the_backends_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A study on one backend never imports the others (fbgemm, torchao, triton: slow to import
    on a GPU machine, and a broken install of one must not stop a study that does not use it);
    a backend asked for that cannot import is left out with a warning when others remain."""
    from loka_tune.errors import BackendError
    from loka_tune.kernels import registry

    real = registry.get_backend
    asked: list[str] = []

    def spy(name: str) -> object:
        asked.append(name)
        if name == "broken":
            raise BackendError("backend 'broken' cannot be imported: pip install broken")
        return real(name)

    monkeypatch.setattr(registry, "get_backend", spy)
    enumerate_candidates(["emulated"], ["e4m3"], ["row"], ["exact"])
    assert set(asked) <= {"emulated"}, asked
    asked.clear()
    monkeypatch.setattr(registry, "candidate_choices",
                        lambda backends, **kw: [GemmChoice.parse("e4m3.row.emulated")] if backends == ("emulated",) else [])
    with pytest.warns(UserWarning, match=r"backends \['broken'\] cannot be imported"):
        c = enumerate_candidates(["emulated", "broken"], ["e4m3"], ["row"], ["exact"])
    assert set(asked) == {"emulated", "broken"}
    assert all(x.backend == "emulated" for v in c.values() for x in v)
