"""The GPU smoke suite's code on a CPU (tests/gpu_smoke.py): one tiny model, eager, emulated FP8.

tests/test_gpu_smoke.py runs these helpers on the H200 only; here CI runs them end to end on a
tiny DLRM (its probe report, every variant, the summary), and checks the loss rule, so that a
typo or an API change in the smoke code fails here and not on the next device call.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from gpu_smoke import (
    VARIANTS,
    SmokeCase,
    learning_problem,
    make_model,
    make_source,
    modeled_report,
    probe_report,
    record,
    report_problem,
    run_study,
    run_variant,
    summary,
    variant_config,
)

REPO = Path(__file__).resolve().parents[1]

CPU_CASE = SmokeCase(
    model="dlrm", preset="tiny", device="cpu", compile=False, batch_size=64, steps=10,
    fp8_choice="e4m3.tensor.emulated", fp8_sites="all",
    candidates=("bf16", "e4m3.tensor.emulated", "e4m3.row.emulated"), resolve_emulated=False,
    probe_steps=4, probe_every=2, cardinalities=(50, 40, 30, 20), num_dense=5,
)


def test_the_smoke_probe_of_a_compiled_case_collects_in_the_regime() -> None:
    """A compiled case's probe (as a study's baseline attaches it, issue 22): compiled with the
    side probe, strict (a graph break would raise), two collections, a report that forms."""
    from dataclasses import replace

    case = replace(CPU_CASE, compile=True)
    source = make_source(case)
    report, stats, info = probe_report(case, source)
    assert info["status"] == "ok" and info["collections"] == 2 and report_problem(report, stats) is None
    assert all(s.x.count == 2 * case.batch_size for s in stats.sites.values())  # the whole batch on the CPU
    assert info["statistics"] == "eager"  # the side probe's statistics: a CUDA graph on a GPU only


def test_the_smoke_helpers_run_a_tiny_model_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from loka_tune.probe import ProbeReport

    log = tmp_path / "smoke.jsonl"
    monkeypatch.setenv("LOKA_SMOKE_LOG", str(log))
    source = make_source(CPU_CASE)
    out = tmp_path / "probe_report.json"
    report, stats, info = probe_report(CPU_CASE, source, out=out)
    assert report_problem(report, stats) is None
    assert info["status"] == "ok" and info["collections"] == 2 and info["sites"] == len(stats.sites) > 0
    assert len(ProbeReport.load(out).results) == len(report.results) == info["results"]
    assert info["statistics"] in ("eager", "in-step (eager)")  # no CUDA graph on the CPU
    record({"what": "probe dlrm/tiny", **info, "problem": None})
    results = {}
    for variant in VARIANTS:
        r = run_variant(CPU_CASE, variant, source, report if variant == "dispatch" else None)
        assert r.problem is None, r.line()
        assert len(r.losses) == CPU_CASE.steps and r.dynamo == {}  # eager: no dynamo report
        record(r.to_dict())
        results[variant] = r
    assert results["bf16"].fp8_gemms == 0 and results["bf16_mods"].fp8_gemms == 0
    assert results["fp8_tensorwise"].fp8_gemms == results["fp8_tensorwise"].gemms > 0  # fp8_sites = "all"
    plan = variant_config(CPU_CASE, "dispatch", make_model(CPU_CASE, source), report)
    assert plan.provenance["source"] == "loka-tune dispatch" and plan.mods == CPU_CASE.mods
    assert plan.provenance["fp8_gemms"] == results["dispatch"].fp8_gemms
    modeled = modeled_report(CPU_CASE, source)  # the plan's input when the probe fails
    assert {r["site"] for r in modeled} == set(stats.sites) and all(r["mere"] == 0.0 for r in modeled)
    fallback = run_variant(CPU_CASE, "dispatch", source, modeled)
    assert fallback.problem is None, fallback.line()
    assert "dlrm/tiny fp8_tensorwise" in results["fp8_tensorwise"].line() and " ok" in results["bf16"].line()
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(rows) == 1 + len(VARIANTS)
    table = summary(log)
    assert table.splitlines()[-1] == f"{1 + len(VARIANTS)} entries, 0 failing"
    assert all(v in table for v in VARIANTS)


def test_the_loss_rule_needs_a_finished_finite_decreasing_curve() -> None:
    falling = tuple(0.7 - 0.01 * i for i in range(20))
    assert learning_problem(falling, 20, "ok") is None
    assert "did not decrease" in (learning_problem(tuple(reversed(falling)), 20, "ok") or "")
    assert "did not decrease" in (learning_problem((0.5,) * 20, 20, "ok") or "")  # flat is not learning
    assert learning_problem(falling[:-1] + (math.nan,), 20, "ok") == "non-finite loss"
    assert learning_problem(falling[:12], 20, "ok") == "12 of 20 steps ran"
    assert learning_problem(falling, 20, "nonfinite") == "status 'nonfinite'"


def test_variant_errors_name_the_fix() -> None:
    source = make_source(CPU_CASE)
    model = make_model(CPU_CASE, source)
    with pytest.raises(ValueError, match="needs a probe report"):
        variant_config(CPU_CASE, "dispatch", model)
    with pytest.raises(ValueError, match="choose one of bf16, bf16_mods"):
        variant_config(CPU_CASE, "fp16", model)


def test_the_gpu_smoke_study_file_is_the_tiny_compiled_measured_study() -> None:
    from loka_tune.tuner.study import load_study

    cfg = load_study(REPO / "studies" / "gpu_smoke.toml")
    assert cfg.training.device == "cuda" and cfg.regime.compiled("cuda") and cfg.objective.speed == "measured"
    assert cfg.trials.n_trials == 2 and cfg.confirm.enabled and len(cfg.training.seeds) == 2


def _cpu_study(tmp_path: Path) -> Path:
    """studies/gpu_smoke.toml for a CPU: emulated FP8, eager, smaller and shorter (the same tables)."""
    text = (REPO / "studies" / "gpu_smoke.toml").read_text()
    for old, new in (('device = "cuda"', 'device = "cpu"'), ('backends = ["torch_scaled_mm"]', 'backends = ["emulated"]'),
                     ("top_mlp = [1024, 1024]", "top_mlp = [64]"), ("bottom_mlp = [256]", "bottom_mlp = [32]"),
                     ("batch_size = 1024", "batch_size = 64"), ("steps = 30", "steps = 8"), ("window = 10", "window = 4"),
                     ("warmup_steps = 5", "warmup_steps = 1"), ("every = 10", "every = 4"),
                     ("eval_examples = 8192", "eval_examples = 256"), ('speed = "measured"', 'speed = "modeled"')):
        assert text.count(old) == 1, f"studies/gpu_smoke.toml has no single {old!r} line any more: update this test"
        text = text.replace(old, new)
    path = tmp_path / "gpu_smoke.toml"
    path.write_text(text)
    return path


@pytest.mark.slow
def test_run_study_tunes_confirms_and_exports_the_smoke_study_on_the_cpu(tmp_path: Path) -> None:
    entry = run_study(_cpu_study(tmp_path), tmp_path / "out", "cpu")
    assert entry["problem"] is None, entry
    assert entry["trials"] == 2 and entry["confirmed"] is not None
