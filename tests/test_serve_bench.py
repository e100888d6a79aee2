"""benchmarks/serve.py on the CPU (its smoke mode): every row runs or says why, the JSON holds what
the GPU receipt needs, the planned config is written and reusable."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _bench import load_bench

from loka_tune.config import ModsConfig, PrecisionConfig, SitePrecision

REPO = Path(__file__).resolve().parents[1]


def _load():  # noqa: ANN202
    return load_bench('serve.py', 'serve_bench')


def serve_model(serve):  # noqa: ANN001, ANN201 - the tiny study model the smoke serves
    from dataclasses import replace

    from loka_tune.tuner.build import make_model, make_source
    from loka_tune.tuner.study import load_study

    cfg = load_study(REPO / "studies" / "wukong_h200.toml")
    cfg = replace(cfg, model=replace(cfg.model, preset="tiny"))
    return make_model(cfg, make_source(cfg), seed=0)


def _config(tmp_path: Path) -> Path:
    cfg = PrecisionConfig(default=SitePrecision.parse("e4m3.row.emulated|bf16|bf16"),
                          mods=ModsConfig(no_bias=True, blocknorm=8, hardswish=True))
    return cfg.save(tmp_path / "best.json")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU smoke mode (torchao rows skipped)")
def test_serve_bench_smoke_on_the_cpu(tmp_path: Path) -> None:
    serve = _load()
    out = tmp_path / "serve.json"
    rc = serve.main(["--preset", "tiny", "--device", "cpu", "--config", str(_config(tmp_path)), "--batches", "8,32",
                     "--reps", "3", "--warmup", "1", "--plan", "none",
                     "--variants", "config,bf16_mods,config_dynamic,torchao_rowwise,loka_tensorwise", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["meta"]["device"] and res["meta"]["compile_mode"] == "none" and res["meta"]["argv"][0] == "--preset"
    rows = {(r["variant"], r["batch"]): r for r in res["rows"]}
    order = [(r["variant"], r["batch"]) for r in res["rows"]]
    assert order == [(v, b) for b in (8, 32)
                     for v in ("bf16_mods", "config", "config_dynamic", "torchao_rowwise", "loka_tensorwise")]
    for b in (8, 32):
        assert rows[("torchao_rowwise", b)]["skipped"] == "needs a CUDA GPU"
        # our static-weight kernels on exactly the sites torchao's inference takes (emulated on the CPU)
        lk = rows[("loka_tensorwise", b)]
        assert lk["fp8_sites"] == len(serve.torchao_sites(serve_model(serve))) > 0 and not lk["fallbacks"]
        assert 20.0 <= lk["sqnr_db"] < 80.0
        ref, cfg = rows[("bf16_mods", b)], rows[("config", b)]
        assert ref["sqnr_db"] is None and ref["fp8_sites"] == 0
        assert cfg["fp8_sites"] > 0 and cfg["bucket"] is None and not cfg["fallbacks"]
        assert 20.0 <= cfg["sqnr_db"] < 80.0  # FP8 logits: close to bf16 + Mods, not identical
        assert cfg["sqnr_centered_db"] < cfg["sqnr_db"]  # the constant part of the logits taken off
        for r in (ref, cfg, rows[("config_dynamic", b)]):
            assert 0 < r["p50_ms"] <= r["p99_ms"] and r["throughput"] > 0
    sp = res["summary"]["speedup_vs_bf16_mods"]
    assert set(sp["config"]) == {"8", "32"} and sp["bf16_mods"] == {"8": 1.0, "32": 1.0}
    assert "config logits SQNR >= 25 dB" in res["summary"]["checks"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's modeled plan")
def test_serve_bench_prices_a_plan_and_writes_the_served_config(tmp_path: Path) -> None:
    serve = _load()
    out = tmp_path / "serve.json"
    rc = serve.main(["--preset", "tiny", "--device", "cpu", "--config", str(_config(tmp_path)), "--batches", "16",
                     "--reps", "2", "--warmup", "0", "--variants", "bf16_mods,config", "--budget", "1e9",
                     "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["meta"]["plan"] == "modeled" and res["plan"]["time_source"] == "modeled"
    written = PrecisionConfig.load(tmp_path / "serve_config.json")
    assert written.serving is not None and written.serving.sizes == (16,)
    assert res["plan"] == written.serving.to_dict()
    cfg_row = next(r for r in res["rows"] if r["variant"] == "config")
    assert cfg_row["bucket"] == 16
    # tiny widths at 16 rows: FP8 never pays on an H200, so the plan serves every site in bf16
    assert cfg_row["fp8_sites"] == 0 and all(c == "bf16" for c in res["plan"]["buckets"]["16"].values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's modeled plan")
def test_serve_bench_verify_checks_the_plan_against_whole_model_alternatives(tmp_path: Path) -> None:
    """--verify: each bucket's plan timed whole beside its alternatives (on a CPU the eager
    model's wall time); the record is in the receipt's plan and the served config."""
    serve = _load()
    out = tmp_path / "serve.json"
    rc = serve.main(["--preset", "tiny", "--device", "cpu", "--config", str(_config(tmp_path)), "--batches", "16",
                     "--reps", "1", "--warmup", "0", "--variants", "bf16_mods,config", "--verify",
                     "--alternatives", "sites,tensor_all,bf16", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    rec = res["plan"]["prices"]["whole_model"]["16"]
    assert set(rec["alternatives"]) == {"sites", "tensor_all", "bf16"} and rec["chosen"] in rec["alternatives"]
    cfg_row = next(r for r in res["rows"] if r["variant"] == "config")
    assert cfg_row["fp8_sites"] == rec["alternatives"][rec["chosen"]].get("fp8_sites", cfg_row["fp8_sites"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke mode")
def test_serve_bench_calibrate_serves_calibrated_activation_scales(tmp_path: Path) -> None:
    """--calibrate N: our tensorwise rows serve calibrated activation scales (N eval batches of
    another seed); the logits stay an FP8 SQNR away from bf16 + Mods; a receipt of another
    --calibrate is not merged with this one."""
    serve = _load()
    out, dyn = tmp_path / "serve.json", tmp_path / "dyn.json"
    common = ["--preset", "tiny", "--device", "cpu", "--batches", "16", "--reps", "1", "--warmup", "0",
              "--variants", "bf16_mods,loka_tensorwise,loka_rowwise"]
    assert serve.main(common + ["--calibrate", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["meta"]["calibrate"] == 2
    rows = {r["variant"]: r for r in res["rows"]}
    assert rows["loka_tensorwise"]["calibrated_sites"] == rows["loka_tensorwise"]["fp8_sites"] > 0
    assert rows["loka_rowwise"]["calibrated_sites"] == 0  # a row's scale follows its request
    assert 20.0 <= rows["loka_tensorwise"]["sqnr_db"] < 80.0
    assert serve.main(common + ["--out", str(dyn)]) == 0
    with pytest.raises(SystemExit, match="differs from .* in calibrate: 2 vs 0"):
        serve.main(["--merge", str(out), str(dyn), "--out", str(tmp_path / "m.json")])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke mode")
def test_serve_bench_contains_a_variants_inductor_settings_to_its_own_rows(tmp_path: Path, monkeypatch: Any) -> None:
    """torchao's quantize_ turns on inductor's coordinate-descent tuning for the whole process:
    each row now starts from the configuration the run started with and records what it compiled
    with, so a later row is not tuned behind its back; --autotune tunes every row alike."""
    import torch._inductor.config as inductor

    serve = _load()
    build = serve.build_variant

    def leaky(name: str, *a: Any, **k: Any) -> Any:
        if name == "loka_tensorwise":  # as torchao's recommended_inductor_config_setter does
            inductor.coordinate_descent_tuning = True
        return build(name, *a, **k)

    monkeypatch.setattr(serve, "build_variant", leaky)
    out = tmp_path / "serve.json"
    common = ["--preset", "tiny", "--device", "cpu", "--batches", "8,16", "--reps", "1", "--warmup", "0",
              "--variants", "bf16_mods,loka_tensorwise"]
    assert serve.main(common + ["--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    tuned = [(r["variant"], r["batch"], r["inductor"]["coordinate_descent_tuning"]) for r in rows]
    assert tuned == [("bf16_mods", 8, False), ("loka_tensorwise", 8, True), ("bf16_mods", 16, False),
                     ("loka_tensorwise", 16, True)]
    assert inductor.coordinate_descent_tuning is False
    assert serve.main(common + ["--autotune", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["meta"]["autotune"] is True and all(r["inductor"]["coordinate_descent_tuning"] for r in res["rows"])
    assert inductor.coordinate_descent_tuning is False


def test_serve_bench_rejects_bad_arguments(tmp_path: Path) -> None:
    serve = _load()
    base = ["--preset", "tiny", "--device", "cpu", "--out", str(tmp_path / "x.json")]
    with pytest.raises(SystemExit, match="unknown variant"):
        serve.main(base + ["--variants", "bf16_mods,fp4"])
    with pytest.raises(SystemExit, match="need --config"):
        serve.main(base + ["--variants", "config"])
    with pytest.raises(SystemExit, match="has no serving section"):
        serve.main(base + ["--variants", "config", "--config", str(_config(tmp_path)), "--plan", "config"])
    with pytest.raises(SystemExit, match="--calibrate -1: give a count"):
        serve.main(base + ["--variants", "bf16_mods", "--calibrate", "-1"])
    with pytest.raises(SystemExit, match="--alternatives 'sites,fastest': unknown \\['fastest'\\]; choose from sites"):
        serve.main(base + ["--variants", "bf16_mods", "--alternatives", "sites,fastest"])
    with pytest.raises(SystemExit, match="torchao_static variant calibrates .*add --calibrate N"):
        serve.main(base + ["--variants", "bf16_mods,torchao_static"])
    with pytest.raises(SystemExit, match="--compile-mode graph captures CUDA graphs: it needs a CUDA device"):
        serve.main(base + ["--variants", "bf16_mods", "--compile-mode", "graph"])


def test_timed_rounds_give_every_variant_every_place_in_the_order() -> None:
    serve = _load()
    order: list[str] = []
    calls = {n: (lambda n=n: order.append(n)) for n in ("a", "b", "c")}
    timed = serve.timed_rounds(calls, torch.device("cpu"), rounds=3, warmup=0, reps=1)
    # each variant: one timed call and one back-to-back call per round, its rounds started in turn
    assert order == ["a", "a", "b", "b", "c", "c", "b", "b", "c", "c", "a", "a", "c", "c", "a", "a", "b", "b"]
    for t in timed.values():
        assert len(t["rounds_p50_ms"]) == 3 and len(t["lat_s"]) == 3
        assert min(t["rounds_p50_ms"]) <= t["p50_s"] * 1e3 <= max(t["rounds_p50_ms"])


def test_serve_bench_rounds_time_the_rows_of_a_batch_in_turns(tmp_path: Path) -> None:
    serve = _load()
    out = tmp_path / "serve.json"
    common = ["--preset", "tiny", "--device", "cpu", "--batches", "8,16", "--reps", "2", "--warmup", "0",
              "--variants", "bf16_mods,loka_tensorwise", "--out", str(out)]
    assert serve.main(common + ["--rounds", "3"]) == 0
    res = json.loads(out.read_text())
    assert res["meta"]["rounds"] == 3
    assert [(r["variant"], r["batch"]) for r in res["rows"]] == [("bf16_mods", 8), ("loka_tensorwise", 8),
                                                                  ("bf16_mods", 16), ("loka_tensorwise", 16)]
    for r in res["rows"]:
        assert "error" not in r and len(r["rounds_p50_ms"]) == 3 and 0 < r["p50_ms"] <= r["p99_ms"]
    assert res["rows"][1]["sqnr_db"] is not None and res["rows"][1]["sqnr_db"] > 15.0
    with pytest.raises(SystemExit, match="--rounds 0: give a count of timing rounds >= 1"):
        serve.main(common + ["--rounds", "0"])


@pytest.mark.gpu
def test_serve_bench_captured_graph_serves_what_the_compiled_model_does(tmp_path: Path) -> None:
    """``--compile-mode graph`` on a GPU: each row's model compiled, captured as one CUDA graph
    and replayed on a copy of the request; the logits it serves are the compiled model's (bf16
    + Mods: identical; our FP8 serving: an FP8 SQNR, not noise)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    serve = _load()
    out = tmp_path / "serve.json"
    rc = serve.main(["--preset", "tiny", "--device", "cuda", "--batches", "256", "--reps", "5", "--warmup", "2",
                     "--variants", "bf16_mods,loka_tensorwise", "--compile-mode", "graph", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["meta"]["compile_mode"] == "graph"
    rows = {r["variant"]: r for r in res["rows"]}
    assert all("error" not in r for r in rows.values()), rows
    assert 0 < rows["bf16_mods"]["p50_ms"] <= rows["bf16_mods"]["p99_ms"]
    assert rows["loka_tensorwise"]["fp8_sites"] > 0 and 15.0 <= rows["loka_tensorwise"]["sqnr_db"] < 80.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke mode")
def test_serve_bench_profile_records_each_rows_calls(tmp_path: Path) -> None:
    """``--profile N``: each row keeps the profile of N more calls (no GPU here: no kernels, the
    host time of the calls)."""
    serve = _load()
    out = tmp_path / "serve.json"
    rc = serve.main(["--preset", "tiny", "--device", "cpu", "--batches", "8", "--reps", "1", "--warmup", "0",
                     "--variants", "bf16_mods,loka_tensorwise", "--profile", "2", "--out", str(out)])
    assert rc == 0
    for r in json.loads(out.read_text())["rows"]:
        prof = r["profile"]
        assert prof["steps"] == 2 and prof["gpu_ms"] is None and prof["host_ms"] > 0, r


def test_serve_bench_over_the_budget_records_skipped_rows(tmp_path: Path) -> None:
    serve = _load()
    out = tmp_path / "serve.json"
    rc = serve.main(["--preset", "tiny", "--device", "cpu", "--batches", "8", "--reps", "1", "--warmup", "0",
                     "--variants", "bf16_mods", "--budget", "0", "--out", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows == [{"variant": "bf16_mods", "batch": 8, "skipped": "over the --budget"}]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke mode")
def test_serve_bench_merges_the_receipts_of_two_calls(tmp_path: Path) -> None:
    """One device call per batch bucket (torchao's compile alone takes minutes a row): --merge
    makes the one receipt issue 23 asks for, with every batch's rows, the plans' buckets and the
    summary over all batches; runs of another setup are refused, naming what differs."""
    serve = _load()
    common = ["--preset", "tiny", "--device", "cpu", "--config", str(_config(tmp_path)), "--reps", "2",
              "--warmup", "0", "--variants", "bf16_mods,config", "--budget", "1e9"]
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "merged.json"
    assert serve.main(common + ["--batches", "32", "--out", str(a)]) == 0
    assert serve.main(common + ["--batches", "8", "--out", str(b)]) == 0
    assert serve.main(["--merge", str(a), str(b), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["variant"], r["batch"]) for r in res["rows"]] == [
        ("bf16_mods", 32), ("config", 32), ("bf16_mods", 8), ("config", 8)]
    assert res["meta"]["batches"] == [32, 8] and res["meta"]["merged_from"] == [str(a), str(b)]
    assert [r["receipt"] for r in res["rows"]] == [str(a), str(a), str(b), str(b)]
    assert res["meta"]["rounds_each"] == [1, 1]
    assert set(res["plan"]["buckets"]) == {"32", "8"}
    assert set(res["summary"]["speedup_vs_bf16_mods"]["config"]) == {"32", "8"}
    assert "config >= 1.20x bf16_mods at 32" in res["summary"]["checks"]
    other = json.loads(b.read_text())
    other["meta"]["compile_mode"] = "reduce-overhead"
    (tmp_path / "c.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match=r"c.json differs from .*a.json in compile_mode: 'none' vs 'reduce-overhead'"):
        serve.main(["--merge", str(a), str(tmp_path / "c.json"), "--out", str(out)])
    with pytest.raises(SystemExit, match="takes two or more receipts"):
        serve.main(["--merge", str(a), "--out", str(out)])
