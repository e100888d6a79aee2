"""The precision-config vocabulary: choice ids, site precisions, PrecisionConfig JSON and errors."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from loka_tune.config import (
    BF16,
    ROLES,
    SCHEMA_VERSION,
    Format,
    GemmChoice,
    GemmRole,
    Granularity,
    ModsConfig,
    PrecisionConfig,
    ScaleRounding,
    SitePrecision,
    SiteRule,
    role_operands,
)
from loka_tune.errors import ConfigError


def _all_valid_choices() -> list[GemmChoice]:
    """Every GemmChoice the constructor accepts, over two backends (plus the bf16 ones)."""
    out = [GemmChoice(), GemmChoice(backend="emulated")]
    for a, b, g, r, fa, be in itertools.product(
        list(Format), list(Format), list(Granularity), list(ScaleRounding), (False, True), ("emulated", "fbgemm")
    ):
        try:
            out.append(GemmChoice(a, b, g, r, fa, be))
        except ConfigError:
            continue
    return out


VALID = _all_valid_choices()


def test_valid_choice_space_is_what_the_docstring_says() -> None:
    fp8 = [c for c in VALID if not c.is_bf16]
    # e4m3/e5m2 pairs (4) x {tensor,row,block} x {exact,pow2} x fa x 2 backends + mxfp8 (mx, pow2 only)
    n_pairs = 4 * 3 * 2 * 2 * 2
    n_mx = 1 * 2 * 2  # rounding normalised to pow2: exact and pow2 give the same choice
    assert len({c.short_str() for c in fp8}) == n_pairs + n_mx
    assert all(c.rounding == ScaleRounding.POW2 for c in fp8 if c.granularity == Granularity.MX)


@pytest.mark.parametrize("choice", VALID, ids=lambda c: c.short_str())
def test_parse_short_str_round_trip(choice: GemmChoice) -> None:
    s = choice.short_str()
    back = GemmChoice.parse(s)
    assert back == choice
    assert back.short_str() == s


def test_short_str_examples() -> None:
    assert GemmChoice.fp8("row").short_str() == "e4m3.row.emulated"
    c = GemmChoice.fp8("block", a_format="e5m2", b_format="e4m3", rounding="pow2", fast_accum=True, backend="triton")
    assert c.short_str() == "e5m2+e4m3.block.pow2.fa.triton"
    assert BF16.short_str() == "bf16"
    assert GemmChoice.bf16("emulated").short_str() == "bf16.emulated"
    assert GemmChoice.parse("mxfp8.mx.pow2.emulated") == GemmChoice.parse("mxfp8.mx.emulated")


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("", "GEMM choice"),
        ("e4m3", "e4m3"),
        ("e4m3.row", "e4m3.row"),
        ("e9m9.row.emulated", "e9m9"),
        ("e4m3.rows.emulated", "rows"),
        ("e4m3.row.pow3.emulated", "pow3"),
        ("e4m3.row.pow2.pow2.emulated", "pow2"),
        ("e4m3.row.pow2", "pow2"),  # the backend is missing: 'pow2' is not a backend
        ("e4m3.row.fa", "fa"),
        ("e4m3.row.Emulated", "Emulated"),
        ("e4m3.none.emulated", "none"),
        ("e4m3.mx.emulated", "mx"),
        ("mxfp8.row.emulated", "mxfp8"),
        ("mxfp8+e4m3.mx.emulated", "mxfp8"),
        ("bf16+e4m3.row.emulated", "bf16"),
        ("bf16.row.emulated", "bf16"),
    ],
)
def test_bad_choice_strings(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as ei:
        GemmChoice.parse(text, key="sites.top.fwd")
    assert ei.value.key == "sites.top.fwd"
    assert fragment in str(ei.value)


def test_bad_choice_fields() -> None:
    with pytest.raises(ConfigError, match="fast_accum"):
        GemmChoice("e4m3", "e4m3", "row", "exact", "yes", "emulated")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="rounding"):
        GemmChoice(rounding="pow2")
    with pytest.raises(ConfigError, match="granularity"):
        GemmChoice(granularity="row")


def test_site_precision_parse_and_index() -> None:
    p = SitePrecision.parse("e4m3.row.emulated|e5m2+e4m3.row.emulated|bf16")
    assert p[GemmRole.FWD] == GemmChoice.fp8("row")
    assert p["dgrad"].a_format == Format.E5M2
    assert p.wgrad == BF16
    assert SitePrecision.parse(p.short_str()) == p
    assert SitePrecision.uniform("e4m3.block.emulated").short_str() == "e4m3.block.emulated"
    assert SitePrecision.from_obj(p.to_dict()) == p
    assert SitePrecision().is_bf16
    with pytest.raises(ConfigError, match="fwd|dgrad|wgrad"):
        SitePrecision.parse("bf16|bf16")


def _cfg() -> PrecisionConfig:
    return PrecisionConfig.from_sites(
        {
            "top.0": "e4m3.row.emulated",
            "re:bottom\\..*": "e4m3.tensor.emulated|e5m2+e4m3.row.emulated|bf16",
            "re:.*": "mxfp8.mx.emulated",
            "bottom.1": {"fwd": "bf16", "dgrad": "bf16", "wgrad": "e4m3.block.pow2.emulated"},
        },
        default="bf16",
        mods=ModsConfig(no_bias=True, keep_bias=("head",), blocknorm=64),
        provenance={"study": "s1", "trial": 7, "metrics": {"rel_ll": 0.0001}},
    )


def test_resolution_exact_then_regex_in_order_then_default() -> None:
    cfg = _cfg()
    assert cfg.resolve("top.0").fwd == GemmChoice.fp8("row")
    # exact name wins over an earlier regex
    assert cfg.resolve("bottom.1").fwd == BF16
    assert cfg.resolve("bottom.1").wgrad.short_str() == "e4m3.block.pow2.emulated"
    # first matching regex in file order
    assert cfg.resolve("bottom.0").fwd.short_str() == "e4m3.tensor.emulated"
    assert cfg.resolve("head").fwd.short_str() == "mxfp8.mx.emulated"
    no_catch_all = PrecisionConfig.from_sites({"top.0": "e4m3.row.emulated"})
    assert no_catch_all.resolve("head") == SitePrecision()
    assert no_catch_all.unmatched_rules(["a", "b"]) == ["top.0"]


def test_json_round_trip(tmp_path: Path) -> None:
    cfg = _cfg()
    path = cfg.save(tmp_path / "sub" / "cfg.json")
    back = PrecisionConfig.load(path)
    assert back == cfg
    assert back.key() == cfg.key()
    assert [r.pattern for r in back.sites] == [r.pattern for r in cfg.sites]  # order kept
    obj = json.loads(path.read_text())
    assert obj["schema_version"] == SCHEMA_VERSION
    assert obj["kind"] == "loka-tune.precision-config"
    assert PrecisionConfig.from_json(cfg.to_json()) == cfg
    # the key ignores provenance
    assert cfg.with_provenance(trial=8).key() == cfg.key()


def _good() -> dict:
    return json.loads(_cfg().to_json())


def _mutate(fn):  # type: ignore[no-untyped-def]
    obj = _good()
    fn(obj)
    return obj


MALFORMED = {
    "missing schema_version": (_mutate(lambda o: o.pop("schema_version")), "schema_version", "schema_version"),
    "wrong schema_version": (_mutate(lambda o: o.update(schema_version=2)), "schema_version", "2"),
    "bool schema_version": (_mutate(lambda o: o.update(schema_version=True)), "schema_version", "True"),
    "unknown top-level key": (_mutate(lambda o: o.update(sitez={})), "(top level)", "sitez"),
    "wrong kind": (_mutate(lambda o: o.update(kind="loka-tune.probe-report")), "kind", "probe-report"),
    "bad choice string": (_mutate(lambda o: o["sites"].update({"top.0": "e4m3.rowz.emulated"})), "sites.top.0", "rowz"),
    "bad default": (_mutate(lambda o: o.update(default="e4m3")), "default", "e4m3"),
    "bad role choice": (
        _mutate(lambda o: o["sites"]["bottom.1"].update(wgrad="e4m3.block")),
        "sites.bottom.1.wgrad",
        "e4m3.block",
    ),
    "unknown site key": (
        _mutate(lambda o: o["sites"]["bottom.1"].update(bwd="bf16")),
        "sites.bottom.1",
        "bwd",
    ),
    "missing site role": (_mutate(lambda o: o["sites"]["bottom.1"].pop("dgrad")), "sites.bottom.1", "dgrad"),
    "site not str or object": (_mutate(lambda o: o["sites"].update({"top.0": 3})), "sites.top.0", "3"),
    "sites not an object": (_mutate(lambda o: o.update(sites=["top.0"])), "sites", "list"),
    "bad regex": (_mutate(lambda o: o["sites"].update({"re:top.(": "bf16"})), "sites.re:top.(", "top.("),
    "provenance not an object": (_mutate(lambda o: o.update(provenance=[1])), "provenance", "[1]"),
    "unknown mods key": (_mutate(lambda o: o["mods"].update(blocknrom=8)), "mods", "blocknrom"),
    "bad mods value": (_mutate(lambda o: o["mods"].update(blocknorm=0)), "mods.blocknorm", "0"),
    "bad keep_bias": (_mutate(lambda o: o["mods"].update(keep_bias="head")), "mods.keep_bias", "head"),
    "top level not an object": ([1, 2], "(top level)", "list"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_config_names_the_key(case: str) -> None:
    obj, key, fragment = MALFORMED[case]
    with pytest.raises(ConfigError) as ei:
        PrecisionConfig.from_json(json.dumps(obj))
    assert ei.value.key == key, str(ei.value)
    assert fragment in str(ei.value)
    assert str(ei.value).startswith(f"{key}: ")


def test_duplicate_site_in_json_is_an_error() -> None:
    text = _cfg().to_json()
    dup = text.replace('"sites": {', '"sites": {\n    "top.0": "bf16",', 1)
    assert dup.count('"top.0"') == 2
    with pytest.raises(ConfigError) as ei:
        PrecisionConfig.from_json(dup)
    assert ei.value.key == "top.0" and "twice" in str(ei.value)


def test_duplicate_rule_in_code_is_an_error() -> None:
    rule = SiteRule("top.0", SitePrecision())
    with pytest.raises(ConfigError) as ei:
        PrecisionConfig(sites=(rule, rule))
    assert ei.value.key == "sites.top.0"


def test_non_json_and_missing_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1,\n "sites": {oops}}')
    with pytest.raises(ConfigError) as ei:
        PrecisionConfig.load(bad)
    assert ei.value.key is None and str(ei.value).startswith(f"{bad}: not valid JSON (line 2")
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError) as ei:
        PrecisionConfig.load(binary)
    assert ei.value.key is None and str(ei.value).startswith(f"{binary}: cannot read it as a UTF-8 JSON file")
    with pytest.raises(ConfigError) as ei:
        PrecisionConfig.load(tmp_path / "nope.json")
    assert ei.value.key is None and ei.value.path == str(tmp_path / "nope.json")
    assert "(file)" not in str(ei.value) and str(ei.value).count("nope.json") == 2  # the file, and the fix's --out


def test_errors_in_a_config_file_name_the_file_and_the_key(tmp_path: Path) -> None:
    f = tmp_path / "best.json"
    f.write_text('{"schema_version": 1, "sites": {"top.0": "e4m3.rowwise.emulated"}}')
    with pytest.raises(ConfigError) as ei:
        PrecisionConfig.load(f)
    assert ei.value.key == "sites.top.0" and ei.value.path == str(f)
    assert str(ei.value).startswith(f"{f}: sites.top.0: ") and "'rowwise'" in str(ei.value)


def test_mods_config() -> None:
    m = ModsConfig(no_bias=True, blocknorm=256, hardswish=True, pad=16)
    assert m.any and m.short_str() == "nobias+bn256+hswish+pad16"
    assert ModsConfig.from_dict(m.to_dict()) == m
    assert not ModsConfig().any and ModsConfig().short_str() == "none"
    with pytest.raises(ConfigError, match="mods.pad"):
        ModsConfig(pad=True)  # type: ignore[arg-type]


def test_mods_fuse_epilogue_json() -> None:
    m = ModsConfig(blocknorm=128, hardswish=True, fuse_epilogue=True)
    assert m.any and m.short_str() == "bn128+hswish+fused"
    assert m.passes == ModsConfig(blocknorm=128, hardswish=True) and not m.passes.fuse_epilogue
    assert ModsConfig(fuse_epilogue=True).any and not ModsConfig(fuse_epilogue=True).any_pass
    assert m.to_dict()["fuse_epilogue"] is True and ModsConfig.from_dict(m.to_dict()) == m
    cfg = PrecisionConfig(default=SitePrecision.uniform("e4m3.row.emulated"), mods=m)
    back = PrecisionConfig.from_json(cfg.to_json())
    assert back == cfg and back.mods.fuse_epilogue and back.key() == cfg.key()
    # off: not written, so the file (and the trial cache key) is what it was before the option
    off = PrecisionConfig(default=SitePrecision.uniform("e4m3.row.emulated"), mods=m.passes)
    assert "fuse_epilogue" not in off.to_json() and "fuse_epilogue" not in off.key()
    assert off.key() != cfg.key()
    # an old file (schema 1, no such key) loads with fusion off
    old = json.loads(off.to_json())
    assert "fuse_epilogue" not in old["mods"] and old["schema_version"] == SCHEMA_VERSION
    loaded = PrecisionConfig.from_dict(old)
    assert loaded.mods.fuse_epilogue is False and loaded == off
    for bad in ("yes", 1, None):
        obj = json.loads(cfg.to_json())
        obj["mods"]["fuse_epilogue"] = bad
        with pytest.raises(ConfigError) as ei:
            PrecisionConfig.from_dict(obj)
        assert ei.value.key == "mods.fuse_epilogue" and repr(bad) in str(ei.value)


def test_roles_order() -> None:
    assert [r.value for r in ROLES] == ["fwd", "dgrad", "wgrad"]


# The GEMM table of config.py's docstring, for a linear with M batch rows, K in, N out (all
# different): canonical (m, k, n) = (rows of A, reduction, rows of B), and what A @ B.T is.
_M, _K, _N = 7, 5, 3
ROLE_TABLE = [
    (GemmRole.FWD, ("M", "K", "N"), "y"),  # Y = X W^T
    (GemmRole.DGRAD, ("M", "N", "K"), "dx"),  # dX = dY W
    (GemmRole.WGRAD, ("N", "M", "K"), "dw"),  # dW = dY^T X: reduces over the batch M
]


@pytest.mark.parametrize("role,dims,output", ROLE_TABLE, ids=lambda v: getattr(v, "value", None))
def test_role_table(role: GemmRole, dims: tuple[str, str, str], output: str) -> None:
    import torch

    size = {"M": _M, "K": _K, "N": _N}
    assert role.shape(_M, _K, _N) == tuple(size[d] for d in dims)
    assert role.shape(None, _K, _N) == tuple(None if d == "M" else size[d] for d in dims)  # batch unknown
    assert (dims[1] == "M") == (role is GemmRole.WGRAD)  # only wgrad reduces over the batch
    g = torch.Generator().manual_seed(0)
    x = torch.randn(_M, _K, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(_N, _K, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(_M, _N, generator=g, dtype=torch.float64)
    y = x @ w.T
    y.backward(dy)
    a, b = role_operands(role.value, x.detach(), dy, w.detach())
    m, k, n = role.shape(_M, _K, _N)
    assert tuple(a.shape) == (m, k) and tuple(b.shape) == (n, k)  # both (rows, reduction)
    want = {"y": y, "dx": x.grad, "dw": w.grad}[output]
    torch.testing.assert_close(a @ b.T, want.detach())  # the GEMM autograd runs


def test_sites_given_as_a_mapping_become_ordered_rules() -> None:
    from loka_tune.config import PrecisionConfig, SitePrecision, SiteRule

    c = PrecisionConfig(sites={"a": SitePrecision.parse("e4m3.row.emulated"), "re:b.*": "e5m2.tensor.emulated"})
    assert [r.pattern for r in c.sites] == ["a", "re:b.*"] and all(isinstance(r, SiteRule) for r in c.sites)
    assert c.resolve("b1").fwd.short_str() == "e5m2.tensor.emulated"
    assert PrecisionConfig.from_json(c.to_json()) == c
    with pytest.raises(ConfigError, match="sites"):
        PrecisionConfig(sites=["a"])
    with pytest.raises(ConfigError, match=r"sites\.a"):
        PrecisionConfig(sites={"a": "e9m9.row"})
