"""benchmarks/e2e.py on the CPU: the paired runs, the summary arithmetic, skipped GPU variants."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _bench import load_bench

from loka_tune.config import ModsConfig, PrecisionConfig, SitePrecision

REPO = Path(__file__).resolve().parents[1]


def _load():  # noqa: ANN202
    return load_bench('e2e.py', 'e2e_bench')


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour (GPU variants skipped)")
def test_e2e_pairs_runs_and_summarizes(tmp_path: Path) -> None:
    e2e = _load()
    cfg = PrecisionConfig(default=SitePrecision.parse("e4m3.row.emulated"), mods=ModsConfig(no_bias=True, hardswish=True))
    cfg_path = tmp_path / "best.json"
    cfg_path.write_text(cfg.to_json())
    rc = e2e.main(["--study", str(REPO / "studies" / "quickstart.toml"), "--steps", "4", "--warmup", "1",
                   "--seeds", "0,1", "--variants", "bf16,bf16_mods,config,fbgemm_rowwise", "--config", str(cfg_path),
                   "--infer-batches", "32", "--infer-reps", "2", "--out", str(tmp_path / "out")])
    assert rc == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    runs = res["runs"]
    assert [(r["variant"], r["seed"]) for r in runs] == [
        (v, s) for v in ("bf16", "bf16_mods", "config", "fbgemm_rowwise") for s in (0, 1)]
    assert all(r["skipped"] == "needs a CUDA GPU" for r in runs if r["variant"] == "fbgemm_rowwise")
    ok = [r for r in runs if "skipped" not in r]
    assert all(r["status"] == "ok" and r["step_time_s"] > 0 for r in ok)
    rows = {r["variant"]: r for r in res["rows"]}
    assert rows["config"]["fp8_sites"] > 0 and rows["config"]["mods"] == "nobias+hswish"
    ll = {(r["variant"], r["seed"]): r["eval_logloss"] for r in ok}
    rel = [100 * (ll[("config", s)] / ll[("bf16_mods", s)] - 1) for s in (0, 1)]  # paired by seed
    assert rows["config"]["rel_ll_pct_vs_bf16_mods"] == pytest.approx(sum(rel) / 2)
    assert rows["bf16_mods"]["rel_ll_pct_vs_bf16_mods"] == 0.0
    assert rows["bf16"]["speedup_vs_bf16"] == 1.0
    assert set(rows["config"]["infer_ms"]) == {"32"} and "infer_speedup_vs_bf16_mods" in rows["config"]
    assert "| config |" in (tmp_path / "out" / "table.md").read_text()


def test_e2e_rejects_unknown_variants_and_a_missing_config(tmp_path: Path) -> None:
    e2e = _load()
    base = ["--study", str(REPO / "studies" / "quickstart.toml"), "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="unknown variant"):
        e2e.main(base + ["--variants", "bf16,fp4"])
    with pytest.raises(SystemExit, match="need --config"):
        e2e.main(base + ["--variants", "config"])


def test_uniform_policy_keeps_bf16_where_the_backend_refuses_the_real_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    from loka_tune.config import BF16
    from loka_tune.kernels.registry import get_backend
    from loka_tune.tuner.build import make_model, make_source
    from loka_tune.tuner.study import load_study

    e2e = _load()
    cfg = load_study(REPO / "studies" / "quickstart.toml")
    src = make_source(cfg)
    model = make_model(cfg, src)
    dev = torch.device("cpu")
    full, kept = e2e.uniform_config(model, "e4m3.row.emulated", src, 128, dev)
    assert kept == 0 and full.sites and all(r.precision.wgrad.short_str() == "e4m3.row.emulated" for r in full.sites)
    backend = get_backend("emulated")
    real = backend.supports
    seen: list[tuple[int, int, int]] = []

    def refuse_big_wgrad(choice, role, *, device=None, shape=None):  # noqa: ANN001, ANN202
        if str(getattr(role, "value", role)) == "wgrad":
            seen.append(shape)
            return "reduction over more than 100 rows" if shape[1] > 100 else None
        return real(choice, role, device=device, shape=shape)

    monkeypatch.setattr(backend, "supports", refuse_big_wgrad)
    cfg2, kept2 = e2e.uniform_config(model, "e4m3.row.emulated", src, 128, dev)
    assert seen and all(k == 128 for _, k, _ in seen)  # wgrad's reduction dim is the real batch's rows
    assert kept2 == len(cfg2.sites)
    assert all(r.precision.wgrad == BF16 and r.precision.fwd.short_str() == "e4m3.row.emulated" for r in cfg2.sites)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour (GPU variants skipped)")
def test_e2e_compiled_variants_are_checked_and_a_forced_recompile_fails_loudly(tmp_path: Path) -> None:
    e2e = _load()
    cfg = PrecisionConfig(default=SitePrecision.parse("e4m3.row.emulated"), mods=ModsConfig(no_bias=True))
    cfg_path = tmp_path / "best.json"
    cfg_path.write_text(cfg.to_json())
    base = ["--study", str(REPO / "studies" / "quickstart.toml"), "--steps", "4", "--warmup", "1", "--seeds", "0",
            "--config", str(cfg_path), "--compile", "--profile-steps", "1", "--infer-reps", "1"]
    rc = e2e.main(base + ["--variants", "bf16_mods,config", "--infer-batches", "32", "--out", str(tmp_path / "ok")])
    assert rc == 0
    res = json.loads((tmp_path / "ok" / "results.json").read_text())
    assert res["meta"]["compile"] and res["meta"]["compile_mode"] == "default"
    for r in res["runs"]:
        assert "error" not in r, r.get("error")
        assert r["dynamo"]["unique_graphs"] >= 1 and r["dynamo"]["graph_breaks"] == 0
        assert r["profile"]["steps"] == 1
    # one graph per code object and grad mode: the inference at a second static batch size
    # needs another one, past a limit of 1: that variant must fail, loudly, not run eagerly
    import torch._dynamo.config as dcfg

    with dcfg.patch(recompile_limit=1):  # not monkeypatch: it would delete the setting (tests/conftest.py)
        rc = e2e.main(base + ["--variants", "bf16_mods", "--infer-batches", "32,64", "--infer-variants", "bf16_mods",
                              "--out", str(tmp_path / "bad")])
    assert rc == 1
    bad = json.loads((tmp_path / "bad" / "results.json").read_text())["runs"][0]
    assert "CompileHealthError" in bad["error"] and "recompile limit" in bad["error"]
    assert "recompile limit" in (tmp_path / "bad" / "table.md").read_text()


def test_the_table_lists_gpu_time_by_kind_of_kernel_against_bf16_mods() -> None:
    """Profiled runs (``kernel_summary``'s ``kinds``) give a second table: each variant's GPU ms per
    kind of kernel, seeds averaged, and its change against bf16 + Mods; runs profiled before the
    kinds existed give none."""
    from loka_tune.kernels.timing import kernel_summary

    e2e = _load()

    def run(variant: str, seed: int, kernels: list[tuple[str, float]]) -> dict:
        return {"variant": variant, "seed": seed, "status": "ok", "step_time_s": 0.03, "eval_logloss": 0.44,
                "profile": kernel_summary(kernels, steps=1)}

    bf16 = [("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", 4000.0), ("triton_poi_fused_hardswish_0", 500.0)]
    fp8 = [("nvjet_sm90_qqtst_128x256_128x4_2x1_v_bz_coopA_TNN", 2000.0),
           ("triton_poi_fused__scaled_mm__to_copy_clamp_hardswish_mul_t_4", 600.0),
           ("triton_red_fused_abs_amax_hardswish_0", 200.0 + 100.0)]
    fp8_1 = [(n, us * 1.1) for n, us in fp8]
    summary = e2e.summarize([run("bf16_mods", 0, bf16), run("bf16_mods", 1, bf16),
                             run("config", 0, fp8), run("config", 1, fp8_1)])
    rows = {r["variant"]: r for r in summary["rows"]}
    k = rows["config"]["kinds_ms"]
    assert k["gemm_fp8"] == pytest.approx(2.1) and k["gemm"] == 0.0 and k["pointwise"] == pytest.approx(0.63)
    assert k["reduction"] == pytest.approx(0.315) and rows["config"]["gemm_share"] == pytest.approx(2 / 2.9)
    md = e2e.table(summary)
    assert "by kind of kernel" in md and "| config | 2.10 (+2.10) | 0.00 (-4.00) |" in md
    assert rows["config"]["fp8_casts_ms"] == pytest.approx(0.63) and rows["config"]["amax_ms"] == pytest.approx(0.315)
    assert rows["bf16_mods"]["fp8_casts_ms"] == 0.0 and "| FP8 casts | amax reductions |" in md
    assert next(x for x in md.splitlines() if x.startswith("| config | 2.10")).endswith("| 0.63 | 0.32 |")
    for r in summary["rows"]:
        r.pop("kinds_ms")
    assert "by kind of kernel" not in e2e.table(summary)
