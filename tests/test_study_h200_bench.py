"""benchmarks/study_h200.py on the CPU: the receipt's JSON from an export's provenance and
e2e.py's own summary (its field names, not copies of them)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name.replace(".py", "_bench"), REPO / "benchmarks" / name)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _e2e_results(step_ms: dict[str, float]) -> dict[str, Any]:
    e2e = _load("e2e.py")
    runs = [{"variant": v, "seed": s, "status": "ok", "step_time_s": ms / 1e3 * (1 + 0.01 * s),
             "eval_logloss": 0.45 + 0.001 * s + (0.0002 if v == "config" else 0.0)}
            for v, ms in step_ms.items() for s in (0, 1)]
    return {"meta": {"compile": True, "batch": 8192, "seeds": [0, 1], "device": "NVIDIA H200"}, **e2e.summarize(runs)}


def test_receipt_assembles_study_confirmation_and_e2e() -> None:
    bench = _load("study_h200.py")
    prov = {"study": "wukong_h200", "trial": 7, "claimed_speedup": 1.10, "claimed_speedup_vs_bf16": 1.16,
            "confirmed_speedup": 1.09, "confirmed_rel_logloss_pct": 0.1, "confirmed_rel_logloss_sd_pct": 0.02,
            "confirmed_regime": {"compile": True, "batch_size": 8192}}
    r = bench.assemble(prov, _e2e_results({"bf16": 50.0, "bf16_mods": 47.0, "config": 43.0}), 41.5)
    assert r["e2e_speedup"] == pytest.approx(47.0 / 43.0)
    assert r["study_speedup"] == 1.10 and r["confirmed_speedup"] == 1.09 and r["compile"] is True
    assert r["study_vs_e2e"] == pytest.approx(abs(1.10 - 47 / 43) / (47 / 43))
    assert r["pass"] == {"prepare_s": True, "compile": True, "study_vs_e2e": True}
    # a claim e2e does not bear out, a slow preparation, an eager e2e: each fails its own check
    r = bench.assemble({**prov, "claimed_speedup": 1.125}, _e2e_results({"bf16": 50.0, "bf16_mods": 47.3,
                                                                          "config": 47.25}), 256.0)
    assert r["study_vs_e2e"] > 0.1 and r["pass"] == {"prepare_s": False, "compile": True, "study_vs_e2e": False}
    r = bench.assemble({**prov, "confirmed_regime": {"compile": False}}, {"rows": [], "meta": {}}, None)
    assert r["e2e_speedup"] is None and r["study_vs_e2e"] is None
    assert r["pass"] == {"prepare_s": False, "compile": False, "study_vs_e2e": False}
