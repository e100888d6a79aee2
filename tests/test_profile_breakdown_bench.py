"""benchmarks/profile_breakdown.py on the CPU: the GEMM / other split of e2e receipts whose
profiles come from the trainer's own summary (``kernel_summary``: its field names, not copies)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _bench import load_bench

from loka_tune.objectives.profiling import kernel_summary

REPO = Path(__file__).resolve().parents[1]


def _load():  # noqa: ANN202
    return load_bench('profile_breakdown.py', 'profile_breakdown_bench')


def _run(variant: str, seed: int, gemm_us: float, other_us: float, fp8: int, steps: int = 10) -> dict[str, Any]:
    """One e2e run whose profile has one GEMM kernel and one fused elementwise kernel per step."""
    kernels = [("nvjet_sm90_tst_128x128_NNT", gemm_us)] * steps + [("triton_poi_fused_add_mul_0", other_us)] * steps
    prof = kernel_summary(kernels, steps)
    return {"variant": variant, "seed": seed, "fp8_sites": fp8, "status": "ok",
            "step_time_s": (gemm_us + other_us) / 1e6 * 1.01, "profile": prof}


def _receipt() -> dict[str, Any]:
    runs = []
    for s in (0, 1):
        runs += [_run("bf16_mods", s, 16000 + 100 * s, 13500, 0),
                 _run("torchao_tensorwise_filter", s, 13000 + 100 * s, 13750, 15),
                 _run("config", s, 13200 + 100 * s, 13450, 15)]  # less GEMM saved, a saving around it
    runs.append({"variant": "broken", "seed": 0, "status": "error", "step_time_s": None, "profile": None})
    return {"meta": {"batch": 8192, "seeds": [0, 1], "device": "NVIDIA H200", "torch": "2.11", "date": "d"},
            "runs": runs}


def test_deltas_zero_overhead_and_ceiling() -> None:
    b = _load().breakdown(_receipt(), name="r.json")
    rows = {r["variant"]: r for r in b["rows"]}
    assert "broken" not in rows  # a run without a profile is left out
    ao, cfg, ref = rows["torchao_tensorwise_filter"], rows["config"], rows["bf16_mods"]
    assert ao["seeds"] == 2 and ao["gemm_ms"] == pytest.approx(13.05)  # seeds averaged: (13.0 + 13.1) / 2 ms
    assert ao["d_gemm_ms"] == pytest.approx(13.05 - 16.05) and ao["d_other_ms"] == pytest.approx(0.25)
    assert ao["other_ms"] == pytest.approx(ao["gpu_ms"] - ao["gemm_ms"])
    assert ao["zero_overhead_step_ms"] == pytest.approx(ao["step_ms"] - 0.25)
    assert cfg["d_other_ms"] == pytest.approx(-0.05)
    assert cfg["zero_overhead_step_ms"] == pytest.approx(cfg["step_ms"])  # a saving around the GEMMs is kept
    assert ref["zero_overhead_step_ms"] is None  # no FP8 site: nothing to take away
    best = min(r["step_ms"] for r in rows.values())
    assert b["best_step_ms"] == best
    assert b["ceiling"]["from"] == "torchao_tensorwise_filter"
    assert b["ceiling"]["step_ms"] == pytest.approx(ref["step_ms"] - 3.0)
    assert b["ceiling"]["vs_best"] == pytest.approx(best / b["ceiling"]["step_ms"])


def test_errors_name_the_fix() -> None:
    bench = _load()
    with pytest.raises(SystemExit, match="'runs' list"):
        bench.breakdown({"meta": {}}, name="x.json")
    r = _receipt()
    for run in r["runs"]:
        run["profile"] = None
    with pytest.raises(SystemExit, match="--profile-steps"):
        bench.breakdown(r)
    with pytest.raises(SystemExit, match=r"'bf16' has no profiled run.*--ref"):
        bench.breakdown(_receipt(), ref="bf16")


def test_cli_writes_json_and_markdown(tmp_path: Path) -> None:
    src = tmp_path / "results.json"
    src.write_text(json.dumps(_receipt()))
    out = tmp_path / "breakdown.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "profile_breakdown.py"), str(src),
                           "--out", str(out), "--md"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    d = json.loads(out.read_text())
    assert [p["receipt"] for p in d["receipts"]] == ["results.json"]
    md = out.with_suffix(".md").read_text()
    assert "| `torchao_tensorwise_filter` |" in md and "Ceiling of these variants" in md
    bad = subprocess.run([sys.executable, str(REPO / "benchmarks" / "profile_breakdown.py"), str(tmp_path / "no.json"),
                          "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "no such receipt" in bad.stderr


def test_kinds_of_kernels_and_their_deltas() -> None:
    """Profiles made by ``kernel_summary`` carry GPU ms per kind of kernel; each row gets them
    (seeds averaged) and their deltas against the reference, and the table lists them."""
    bench = _load()
    b = bench.breakdown(_receipt(), name="r.json")
    rows = {r["variant"]: r for r in b["rows"]}
    ao = rows["torchao_tensorwise_filter"]
    assert ao["kinds"]["gemm"] == pytest.approx(13.05) and ao["kinds"]["pointwise"] == pytest.approx(13.75)
    assert ao["d_kinds"]["gemm"] == pytest.approx(-3.0) and ao["d_kinds"]["pointwise"] == pytest.approx(0.25)
    assert rows["bf16_mods"]["d_kinds"]["pointwise"] == pytest.approx(0.0)
    md = bench.table([b])
    assert "GPU ms per kind of kernel" in md and "| `torchao_tensorwise_filter` |" in md and "13.75 (+0.25)" in md
    old = _receipt()  # a receipt from before the kinds: no second table, the rest as before
    for run in old["runs"]:
        if run["profile"]:
            run["profile"].pop("kinds")
    b_old = bench.breakdown(old)
    assert all("kinds" not in r for r in b_old["rows"]) and "per kind" not in bench.table([b_old])
