"""benchmarks/train_step.py on the CPU: a failing variant must not end the run; the compiled
probe-overhead run (issue 22) works end to end."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest
from _bench import load_bench

REPO = Path(__file__).resolve().parents[1]


def _load():  # noqa: ANN202
    return load_bench('train_step.py', 'train_step_bench')


def test_a_failing_variant_is_recorded_and_the_next_ones_run(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from loka_tune.data.synthetic import SyntheticCTR

    ts = _load()

    def cpu_timed_loop(step, batches, steps):  # noqa: ANN001, ANN202 - CUDA events -> perf_counter
        out = []
        for _ in range(steps):
            b = next(batches)
            t0 = time.perf_counter()
            step(b)
            out.append(time.perf_counter() - t0)
        return out

    monkeypatch.setattr(ts, "timed_loop", cpu_timed_loop)
    src = SyntheticCTR(num_dense=3, cardinalities=[20, 30], eval_examples=64)
    args = argparse.Namespace(
        model="dlrm", preset="tiny", num_dense=3, batch=16, variant_steps=3, warmup=0, compile=False,
        variant=["bf16|none|bf16", "broken|none|uniform:e4m3.row.no_such_backend", "bf16 again|nobias|bf16"])
    rows = ts.run_variants(args, src, torch.device("cpu"))
    assert [r["variant"] for r in rows] == ["bf16", "broken", "bf16 again"]
    assert "no_such_backend" in rows[1]["error"] and "median_ms" not in rows[1]
    assert rows[0]["median_ms"] > 0 and rows[2]["median_ms"] > 0
    assert rows[0]["speedup_vs_first"] == pytest.approx(1.0) and rows[1]["speedup_vs_first"] is None
    ts.print_variants(rows, args)
    assert "failed: BackendError" in capsys.readouterr().out


def test_the_script_runs_compiled_on_the_cpu_with_the_side_probe(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    """The issue-22 receipt's code path, small: --compile --probe-every on a tiny model on the
    CPU (dynamo's aot_eager backend: the same guards, no code generation); the JSON carries what
    the H200 receipt must (compile, overhead, per-call cost, plain-vs-plain noise, recompiles)."""
    import json
    import math
    import sys

    ts = _load()
    out = tmp_path / "probe_overhead.json"
    monkeypatch.setattr(sys, "argv", [
        "train_step.py", "--device", "cpu", "--model", "dlrm", "--preset", "tiny", "--batch", "48",
        "--steps", "8", "--warmup", "2", "--num-sparse", "3", "--cardinality", "40", "--num-dense", "4",
        "--probe-every", "4", "--probe-steps", "12", "--probe-rows", "16", "--probe-profile", "2",
        "--compile", "--compile-backend", "aot_eager", "--out", str(out)])
    assert ts.main() == 0
    r = json.loads(out.read_text())
    assert r["compile"] is True and r["probe_step_on"] == "batch" and r["probe_sub_batch"] == 16
    assert r["probe_collections"] == 3 and len(r["probe_collection_extra_ms"]) == 3
    assert r["probe_recompiled"] is False and r["dynamo_after_probe"]["graph_breaks"] == 0
    assert r["dynamo_after_probe"]["unique_graphs"] >= 1
    for key in ("probe_overhead_mean", "plain_noise_mean", "probe_collection_ms_mean", "probe_overhead_steady"):
        assert math.isfinite(r[key]), key
    assert r["probe"]["steps"] == 10 and r["plain"]["steps"] == r["plain_after"]["steps"] == 6
    # the headline: interleaved probed / plain blocks (3 pairs of 4 steps, ABBA), one collection per probed block
    pr = r["probe_paired"]
    assert pr["pairs"] == 3 and pr["collections"] == 3 and len(pr["per_pair"]) == len(pr["collection_extra_ms"]) == 3
    assert r["probe_overhead_mean"] == pr["overhead"] and r["plain_noise_mean"] == pr["noise"]
    assert math.isfinite(r["probe_overhead_mean_sequential"]) and r["probe_graph"] == pr["graph"] == "eager"
    pp = r["probe_profile"]
    assert set(pp["parts_ms_per_collection"]) == {"forward_backward", "weights", "stats"}
    assert r["probe_precision"] == pp["precision"] == "float64"  # auto on the CPU
    assert len(pp["wall_ms_per_collection"]) == 2 and pp["aten_ops_per_collection"] > 0
